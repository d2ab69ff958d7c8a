"""The object store tests' fixtures (``s3``, ``proxy``, ``bucket``) are in tests/conftest.py,
shared with tests/cache/; the server and the proxy are in s3server.py here."""
