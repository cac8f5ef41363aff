"""Exception types raised by the parameter server.

Every error a caller can provoke with bad input derives from :class:`ValueError`
or :class:`KeyError`, so generic handlers keep working, and from :class:`PSError`,
so a service can catch "anything the PS refused" in one clause.

>>> issubclass(InvalidIdsError, ValueError) and issubclass(UnknownTableError, KeyError)
True
"""

from __future__ import annotations


class PSError(Exception):
    """Base class of every error raised deliberately by :mod:`ps`."""


class InvalidInputError(PSError, ValueError):
    """An argument has the wrong dtype, shape or value; nothing was changed."""


class InvalidIdsError(InvalidInputError):
    """Feature ids are not a 1-D array of integers that fit int64."""


class InvalidGradientError(InvalidInputError):
    """Gradients have the wrong dtype or shape."""


class NonFiniteGradientError(InvalidGradientError):
    """Gradients contain NaN or Inf; applying them would poison the rows."""


class InvalidEventTimeError(InvalidInputError):
    """Event time is not an int64 number of milliseconds (scalar or one per id)."""


class UnknownTableError(PSError, KeyError):
    """A batch names a table (or slot) the parameter server does not hold."""


class ReadOnlyTableError(PSError, ValueError):
    """A training operation was called on a serving replica (it has no optimizer)."""


class SnapshotError(PSError, ValueError):
    """A snapshot cannot be written or read."""


class SnapshotCorruptError(SnapshotError):
    """A snapshot file is truncated, fails its checksum or its manifest is invalid.

    Raised before any state is touched: a corrupt snapshot is never loaded half.
    """


class SnapshotNotFoundError(SnapshotError, FileNotFoundError):
    """No (complete) snapshot chain exists for the requested table/shard."""
