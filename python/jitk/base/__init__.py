"""The floor every other floor stands on: the version, the error base, the settings.

Nothing here imports torch, tvm-ffi or any other floor of jitk."""

__version__ = "0.1.0"  # the one source; pyproject.toml reads it

# torch warns at import when numpy is missing; jitk never needs numpy, so where importing
# jitk (or running its commands) imports torch, it keeps that warning quiet.
NUMPY_WARNING = "Failed to initialize NumPy"
