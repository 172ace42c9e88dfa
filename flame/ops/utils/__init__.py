"""Helpers shared by the op families: backend choice, input checks, compute dtypes, dependent launches."""
