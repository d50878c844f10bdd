"""What everything stands on, importing nothing of tunebench above it: errors, the cache paths, the
settings row (Decision), durable writes, JSON files, precisions, the batch rule, start-up."""

VERSION = "0.1.0"  # the package's, as pyproject.toml says (tests/test_layers.py holds them equal)
