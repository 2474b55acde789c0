"""A test-only kernel module with the precompile hook of jitk's kernel modules, built from
the probes under tests/csrc: one CUDA module (nvcc) and one C++ module (g++).

The tests register it through $JITK_PRECOMPILE_MODULES, as a project registers its own
kernels, so `python -m jitk precompile` is exercised even where no shipped kernel module
is installed."""

import probes


def precompile_configs():
    return [("launch add_one", probes.launch_probe),
            ("header cpp", lambda: probes.header_probe("cpp"))]
