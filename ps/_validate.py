"""Input checking shared by every public entry point: refuse before touching state."""

from __future__ import annotations

import numbers

import numpy as np
import numpy.typing as npt

from .errors import InvalidEventTimeError, InvalidGradientError, InvalidIdsError, NonFiniteGradientError


def as_ids(ids: npt.ArrayLike) -> np.ndarray:
    """A C-contiguous int64 1-D view/copy of ``ids``; any lossless integer input is accepted."""
    a = np.asarray(ids)
    if a.ndim != 1:
        raise InvalidIdsError(f"ids must be 1-D, got shape {a.shape}")
    if a.dtype == np.int64:
        return np.ascontiguousarray(a)
    if a.size == 0 and a.dtype.kind in "fO":  # np.asarray([]) is float64
        return np.empty(0, np.int64)
    if a.dtype.kind == "i" or (a.dtype.kind == "u" and a.dtype.itemsize < 8):
        return a.astype(np.int64)
    raise InvalidIdsError(f"ids must be an integer array that fits int64, got dtype {a.dtype}")


def as_grads(grads: npt.ArrayLike, n: int, dim: int, check_finite: bool = True) -> np.ndarray:
    """float32 ``[n, dim]`` C-contiguous gradients, all finite (unless the caller checks that
    itself, once over many slots: ``check_finite=False``)."""
    g = np.asarray(grads)
    if g.dtype.kind != "f":
        raise InvalidGradientError(f"gradients must be floating point, got dtype {g.dtype}")
    if g.shape != (n, dim):
        raise InvalidGradientError(f"gradients must have shape {(n, dim)}, got {g.shape}")
    with np.errstate(over="ignore"):
        g = np.ascontiguousarray(g, dtype=np.float32)
    if check_finite and not np.isfinite(g).all():
        # float64 -> float32 overflow is caught here too, after the cast
        bad = int((~np.isfinite(g)).any(axis=1).sum())
        raise NonFiniteGradientError(f"{bad} gradient row(s) contain NaN or Inf; nothing applied")
    return g


def as_event_time(t: npt.ArrayLike | None, n: int) -> np.ndarray:
    """Event time(s) in int64 ms: a length-1 array for a scalar, else one per id."""
    if isinstance(t, (bool, np.bool_)):
        raise InvalidEventTimeError("event time must be int64 milliseconds, got a bool")
    if isinstance(t, numbers.Integral):
        if not -(2**63) <= int(t) < 2**63:
            raise InvalidEventTimeError(f"event time {t} does not fit int64")
        return np.array([int(t)], np.int64)
    a = np.asarray(t)
    if a.ndim == 0 or a.dtype.kind not in "iu" or (a.dtype.kind == "u" and a.dtype.itemsize == 8):
        raise InvalidEventTimeError(
            f"event time must be an int (milliseconds since epoch) or an int64 array, got {a.dtype}")
    if a.ndim != 1 or a.size != n:
        raise InvalidEventTimeError(f"event times must be one per id ({n}), got shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.int64) if n != 1 else a.astype(np.int64).reshape(1)


def as_values(values: npt.ArrayLike, n: int, dim: int) -> np.ndarray:
    """float32 ``[n, dim]`` rows for replica upserts (finite, like gradients)."""
    try:
        return as_grads(values, n, dim)
    except NonFiniteGradientError as e:
        raise NonFiniteGradientError(str(e).replace("gradient", "value")) from None
