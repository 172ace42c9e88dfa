"""Benchmarks and GPU tools of flame, run from a checkout: `python bench/<tool>.py --help` says what each measures."""
