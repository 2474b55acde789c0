"""What one build is: everything builder.py needs to compile a module and publish it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["BuildSpec"]


@dataclass(frozen=True)
class BuildSpec:
    name: str
    entry: Path  # the published folder
    key: str  # the cache key, recorded in the entry
    in_place: bool  # entry is a build_directory (jitk/build/cache.py)
    archs: tuple[str, ...]
    sources: dict[str, str]  # generated file name -> text
    kernel_files: tuple[Path, ...]  # hashed into the key
    flags: dict[str, list[str]]  # "cflags", "cuda_cflags", "ldflags", "include_dirs"
    device_halves: tuple[Path, ...] = ()  # CUDA files whose kernels NVRTC builds
