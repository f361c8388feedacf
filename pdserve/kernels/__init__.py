"""Kernels: the attention backends (C paged attention, torch) and the C CPU ops, with their
native sources (csrc/) and build flags. Imports nothing of pdserve outside this package."""
