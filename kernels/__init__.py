"""Triton kernels and their pure-torch references. Importable without a GPU."""
