"""Per-row flag bits, ``meta`` slots and the change-marking kernel (see :mod:`ps.rows`)."""

from __future__ import annotations

from ._jit import njit

LIVE, DEAD, SYNC, SNAP = 1, 2, 4, 8
M_SIZE, M_HIGH, M_NFREE, M_NDIRTY, M_DHEAD, M_RNG, M_CURSOR, M_WATERMARK = range(8)


@njit
def mark_changed(r, flags, dirty, meta, track):
    f = flags[r] | SNAP
    if track and not (f & SYNC):
        f |= SYNC
        dirty[meta[M_NDIRTY]] = r
        meta[M_NDIRTY] += 1
    flags[r] = f


