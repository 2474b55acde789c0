"""The build floor: the toolchain, the module cache, its locks and trust, the builder and
load_jit. No torch: `python -m jitk cache` and serving processes load through it alone."""
