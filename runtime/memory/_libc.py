"""The few libc calls the host pool needs: reserving address space and mapping a file into it at
fixed addresses (Python's `mmap` module cannot choose the address)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

# Linux values (x86-64 and aarch64); Python's mmap module lacks several of them before 3.13.
_PROT_NONE, _PROT_READ, _PROT_WRITE = 0x0, 0x1, 0x2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x1, 0x2, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

PAGE_SIZE = mmap.PAGESIZE


def _check(address: int | None, what: str) -> int:
    if address is None or address == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what} failed: {os.strerror(errno)}")
    return address


def reserve(size: int) -> int:
    """Reserve `size` bytes of inaccessible address space; nothing is committed."""
    flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE
    return _check(_libc.mmap(None, size, _PROT_NONE, flags, -1, 0), f"reserving {size} bytes")


def map_shared(address: int, size: int, fd: int, offset: int) -> None:
    """Map `[offset, offset + size)` of file `fd` read-write at `address`, replacing what is there
    (part of a reservation)."""
    flags = _MAP_SHARED | _MAP_FIXED
    prot = _PROT_READ | _PROT_WRITE
    mapped = _check(
        _libc.mmap(address, size, prot, flags, fd, offset), f"mapping {size} bytes at {address:#x}"
    )
    if mapped != address:
        raise OSError(f"mmap placed {size} bytes at {mapped:#x} instead of {address:#x}")


def unmap(address: int, size: int) -> None:
    if _libc.munmap(address, size) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"munmap of {size} bytes at {address:#x}: {os.strerror(errno)}")
