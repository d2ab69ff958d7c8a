"""The tests' kit: what more than one test module needs, by what it does.

- ``trees``: build source trees (every shape staging must keep) and compare two trees.
- ``tars``: make tar archives (GNU tar, tarfile, gzip, zstd, patched headers), extract
  them with GNU tar as the reference, compare an extraction, globs, nothing outside dst.
- ``shards``: samples, shards written by every writer (tarfile, GNU tar, webdataset),
  and each reader's view of them (fastload, webdataset, wids, tarfile, GNU tar).
- ``procs``: one fastload call in a child process (``stage_child.py``, run by path).
- ``fs``: tmpfs limits, the page cache, O_DIRECT, permissions, sizes in messages.
- ``slurm``: the loopback SLURM cluster tests/slurm run jobs on.

``tests/conftest.py`` puts ``tests/`` on ``sys.path``, so a test in any folder imports
``from kit import trees``; a test module run as a child script gets it on PYTHONPATH
(``procs.child_env``).
"""
