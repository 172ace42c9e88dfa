"""Benchmarks of flame, run from the root of a checkout: `python -m bench.<tool> --help` says what each measures."""
