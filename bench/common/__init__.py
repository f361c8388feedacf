"""Helpers every benchmark shares: machine info (machine), the results writer (results), paired
alternating runs and per-tree worker processes (paired), a 1P+1D cluster with a client (cluster)."""
