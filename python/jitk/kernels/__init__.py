"""The kernel families, a folder each (runtime/registry.py lists them): entry points,
reference, tuning and the .cuh files together."""
