"""``y += a * x`` in place, in one pass over both vectors, without holding the GIL.

A shard applies plain SGD and momentum steps as ``params += -lr * grad``.  numpy needs two
passes for that (a multiply into a scratch vector, then an add), reading and writing twice the
memory of BLAS's ``axpy``.  scipy's own ``blas.saxpy`` is one pass but holds the GIL while it
runs, so two shards of one worker process, or a shard and the replica beside it, wait for each
other's updates.  ctypes releases the GIL around a foreign call, so :func:`axpy` calls the same
BLAS routine, found through scipy's public Cython BLAS table (``scipy.linalg.cython_blas``),
through ctypes.  Where that table cannot be read, scipy's wrapper is used (same result, GIL
held); arrays BLAS does not take (strided, mixed or other dtypes) go through numpy.

Numpy and scipy only.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
from scipy.linalg import blas, cython_blas

__all__ = ["axpy"]

_INT = ctypes.POINTER(ctypes.c_int)


def _from_cython_table(name: str, scalar: type) -> Callable | None:
    """The BLAS routine ``name`` as a ctypes function, from scipy's Cython table; None if the
    table does not have it in the expected form."""
    capsule = getattr(cython_blas, "__pyx_capi__", {}).get(name)
    if capsule is None:
        return None
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    signature = get_name(capsule) or b""
    if signature.count(b"*") != 6:  # (int *n, s *a, s *x, int *incx, s *y, int *incy)
        return None
    pointer = get_pointer(capsule, signature)
    if not pointer:
        return None
    arguments = (_INT, ctypes.POINTER(scalar), ctypes.c_void_p, _INT, ctypes.c_void_p, _INT)
    return ctypes.CFUNCTYPE(None, *arguments)(pointer)


def _routines() -> dict[np.dtype, tuple[Callable | None, type, Callable]]:
    """Per dtype: the ctypes routine (or None), its scalar type, and scipy's wrapper."""
    table = {}
    for dtype, name, scalar, wrapper in (
        (np.float32, "saxpy", ctypes.c_float, blas.saxpy),
        (np.float64, "daxpy", ctypes.c_double, blas.daxpy),
    ):
        try:
            routine = _from_cython_table(name, scalar)
        except (AttributeError, TypeError, ValueError):  # another scipy: keep its wrapper
            routine = None
        table[np.dtype(dtype)] = (routine, scalar, wrapper)
    return table


_ROUTINES = _routines()
_ONE = ctypes.c_int(1)


def axpy(a: float, x: np.ndarray, y: np.ndarray) -> None:
    """``y += a * x`` in place (``x`` and ``y`` of the same shape).

    One BLAS pass with the GIL released for contiguous float32 or float64 arrays of the same
    dtype; numpy (two passes, with a temporary) for anything else.
    """
    if x.shape != y.shape:
        raise ValueError(f"axpy: x and y must have the same shape, got {x.shape} and {y.shape}")
    entry = _ROUTINES.get(y.dtype)
    if (
        entry is None
        or x.dtype != y.dtype
        or not (x.flags.c_contiguous and y.flags.c_contiguous)
        or y.size >= 2**31  # BLAS's int counts
    ):
        y += np.multiply(x, a)
        return
    routine, scalar, wrapper = entry
    if routine is None:
        wrapper(x.reshape(-1), y.reshape(-1), a=a)  # in place: y has BLAS's dtype and layout
        return
    n = ctypes.c_int(y.size)
    routine(ctypes.byref(n), ctypes.byref(scalar(a)), x.ctypes.data, ctypes.byref(_ONE),
            y.ctypes.data, ctypes.byref(_ONE))  # fmt: skip
