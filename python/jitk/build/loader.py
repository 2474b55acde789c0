"""Loads a module's library from the file descriptor whose contents were checked.

A library is hashed through an open descriptor and dlopened as /proc/self/fd/N, so that
the file checked is the file loaded: swapping the path between the check and the load
changes nothing. The descriptor stays open for the life of the process, one per library
file: the dynamic loader knows a loaded library by its path, so a closed N reused for
another library would be answered with the first one.

A library whose kernels NVRTC built (jitk/nvrtc.cuh) is handed its device code here, as
the bytes that were checked, before anyone can call it."""

from __future__ import annotations

import ctypes
import os
import threading

import tvm_ffi

_held: dict[tuple[int, int], int] = {}  # (device, inode) -> the descriptor it is loaded by
_held_lock = threading.Lock()


def load_from_fd(fd: int, device_code: dict[str, bytes] | None = None) -> tvm_ffi.Module:
    """The module in the library open at `fd`, given its `device_code` (file name -> bytes).
    Takes the descriptor over: it is kept while the library is loaded, or closed when the
    same file is already held."""
    status = os.fstat(fd)
    file_id = (status.st_dev, status.st_ino)
    with _held_lock:
        held = _held.setdefault(file_id, fd)
    if held != fd:
        os.close(fd)
    try:
        # tvm_ffi.load_module picks a loader by the file name's extension, which
        # /proc/self/fd/N lacks; this is the loader it picks for ".so".
        module = tvm_ffi.get_global_func("ffi.Module.load_from_file.so")(
            f"/proc/self/fd/{held}", "so")
    except Exception:
        if held == fd:  # a failed dlopen remembers no name: the number may be reused
            with _held_lock:
                del _held[file_id]
            os.close(fd)
        raise
    tvm_ffi.get_global_func("ffi.ModuleGlobalsAdd")(module)  # as load_module keeps it alive
    if device_code:
        _hand_over(f"/proc/self/fd/{held}", device_code)
    return module


def _hand_over(path: str, device_code: dict[str, bytes]) -> None:
    """Copies each file's bytes into the loaded library (jitk_nvrtc_adopt, which keeps the
    first copy of a name, so a second load of the same library changes nothing)."""
    library = ctypes.CDLL(path)  # the same path: the handle of the library already loaded
    adopt = library.jitk_nvrtc_adopt
    adopt.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    adopt.restype = ctypes.c_int
    with _held_lock:  # a launch on another thread never sees a half-given library
        for name, data in sorted(device_code.items()):
            if adopt(name.encode(), data, len(data)) != 0:
                raise OSError(f"{path} could not take its device code {name} "
                              f"({len(device_code)} files, {len(data)} bytes)")
