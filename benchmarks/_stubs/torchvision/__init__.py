"""Stand-in for torchvision so that ``import streaming`` works without it (see
benchmarks/_stubs/README.md). Not a usable torchvision: it has no version, no models,
no transforms; the two names mosaicml-streaming imports raise ImportError when used."""

STUB = True
