"""Loads a module's library from the file descriptor whose contents were checked.

A library is hashed through an open descriptor and dlopened as /proc/self/fd/N, so that
the file checked is the file loaded: swapping the path between the check and the load
changes nothing. The descriptor stays open for the life of the process, one per library
file: the dynamic loader knows a loaded library by its path, so a closed N reused for
another library would be answered with the first one."""

from __future__ import annotations

import os
import threading

import tvm_ffi

_held: dict[tuple[int, int], int] = {}  # (device, inode) -> the descriptor it is loaded by
_held_lock = threading.Lock()


def load_from_fd(fd: int) -> tvm_ffi.Module:
    """The module in the library open at `fd`. Takes the descriptor over: it is kept while
    the library is loaded, or closed when the same file is already held."""
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
    return module
