"""Helpers shared by the op families: backend choice, input checks, compute and accumulation dtypes, dependent launches."""
