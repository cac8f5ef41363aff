"""GBA's token-controlled gradient buffer (Su et al., "GBA: A Tuning-free Approach to Switch
between Synchronous and Asynchronous Training for Recommendation Models", NeurIPS 2022): the
owner's side of ``trainer.dist_mode = "gba"`` (and of its ``"async"`` baseline), pure Python, no
transport (that is :mod:`trainer.dist.gba_model`).

**Tokens.** An owner (a shard of the sparse tables, or the dense head's owner) counts its global
steps: :attr:`TokenBuffer.token` is how many aggregated updates it has applied. A rank that pulls
parameters gets the token with them; the gradients it then computes are pushed back tagged with
that token and with their example count. A gradient's **staleness** is ``s = token now - token
pulled``: how many global steps landed between its pull and its push.

**Aggregation.** Pushes are summed until they cover ``global_batch`` examples (default: sync's
global batch, N ranks x the local batch), then released once, to be applied with the table's own
optimizer as sync applies one global batch: the rank computes its gradient of ``loss sum /
global_batch`` (sync's normalisation), so a release of exactly ``global_batch`` examples is scaled
by 1 and equals sync's summed gradient when nothing is stale; one covering ``n != global_batch``
examples (uneven batches, :meth:`TokenBuffer.flush`) is scaled by ``global_batch / n``: still the
mean over the examples it holds. That is what lets a job switch between sync and GBA with no
other learning rate: an update always averages one global batch.

**Decay.** A gradient ``s`` steps stale is weighted by :func:`decay` ``(s) = 1 / max(1, s)`` and
dropped past ``max_staleness`` (counted, its examples not applied). Why this one: the paper's
abstract (its stored ar5iv copy, 2205.11048) says the token control "decays the gradients with
severe staleness" and applies those within a threshold; its exact decay function was not in the
copies of the paper reachable from here, so it is not quoted. ``1 / s`` is the staleness-aware
learning-rate modulation of Zhang et al. ("Staleness-aware Async-SGD", 1511.05950), which GBA's
related work builds on; it is kept at 1 for ``s <= 1`` because a free-running GBA rank is one
step stale by construction half of the time (it pulls while its own push waits in the buffer for
the other ranks'): that is GBA's normal state, not severe staleness, and decaying it would lower
the learning rate with no straggler at all. The weights are not renormalised: a decayed gradient
counts its examples towards the global batch but moves the parameters less.

**Async** (``mode="async"``, the paper's baseline): every push is released at once (no
aggregation), with no decay and no drop; its scale ``global_batch / n`` makes it the mean over
its own ``n`` examples: plain apply-on-arrival asynchronous SGD.

>>> buf = TokenBuffer(global_batch=4, max_staleness=2)
>>> buf.push(token=0, examples=2, payload="a") is None          # 2 of 4 examples: held
True
>>> r = buf.push(token=0, examples=2, payload="b")                # 4 of 4: released, step 0 -> 1
>>> r.parts, r.scale, r.examples, buf.token
([(1.0, 'a'), (1.0, 'b')], 1.0, 4, 1)
>>> buf.push(token=0, examples=4, payload="c").parts              # 1 step stale: weight 1
[(1.0, 'c')]
>>> buf.push(token=0, examples=4, payload="d").parts              # 2 steps stale: decayed
[(0.5, 'd')]
>>> buf.push(token=0, examples=4, payload="e") is None            # 3 > max_staleness: dropped
True
>>> s = buf.stats
>>> s.pushed, s.applied, s.decayed, s.dropped, s.dropped_examples, round(s.mean_staleness, 3)
(4, 3, 1, 1, 4, 1.2)
>>> buf.push(token=3, examples=1, payload="f") is None; r = buf.flush(); r.parts, r.scale
True
([(1.0, 'f')], 4.0)
>>> a = TokenBuffer(global_batch=4, max_staleness=0, mode="async")
>>> r = a.push(token=0, examples=2, payload="x"); r.parts, r.scale   # the mean over its 2 examples
([(1.0, 'x')], 2.0)
>>> a.push(token=0, examples=2, payload="y").parts                   # stale, applied as is
[(1.0, 'y')]
>>> combine(TokenBuffer(2, 1).push(0, 2, np.ones(2)) or None, lambda p: p).tolist()
[1.0, 1.0]
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

__all__ = ["MODES", "GBAError", "GBAStats", "Release", "TokenBuffer", "combine", "decay"]

MODES = ("gba", "async")

P = TypeVar("P")


class GBAError(ValueError):
    """A token buffer misconfigured: a global batch under 1, a negative staleness bound, an
    unknown mode, or a token from the future."""


def decay(staleness: int) -> float:
    """The weight of a gradient ``staleness`` global steps stale (why this one: the module's docstring).

    >>> [decay(s) for s in range(5)]
    [1.0, 1.0, 0.5, 0.3333333333333333, 0.25]
    """
    return 1.0 / max(1, staleness)


@dataclass
class GBAStats:
    """What a buffer did with its pushes (metrics: per owner, summed per rank)."""

    pushed: int = 0            # gradients accepted (applied now or waiting in the buffer)
    applied: int = 0           # releases: aggregated updates applied (the owner's global steps)
    decayed: int = 0           # accepted with a weight under 1
    dropped: int = 0           # past max_staleness: not applied
    dropped_examples: int = 0
    staleness_sum: int = 0     # over accepted and dropped pushes

    @property
    def mean_staleness(self) -> float:
        n = self.pushed + self.dropped
        return self.staleness_sum / n if n else 0.0

    def add(self, other: GBAStats) -> GBAStats:
        """The sum of two buffers' counters.

        >>> GBAStats(pushed=1, staleness_sum=2).add(GBAStats(pushed=1, dropped=2)).mean_staleness
        0.5
        """
        return GBAStats(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple())))

    def as_tuple(self) -> tuple[int, ...]:
        return (self.pushed, self.applied, self.decayed, self.dropped, self.dropped_examples, self.staleness_sum)


@dataclass
class Release(Generic[P]):
    """One aggregated update to apply: ``sum(weight * payload) * scale`` over ``parts``."""

    parts: list[tuple[float, P]]
    scale: float               # global_batch / examples
    examples: int
    token: int                 # the global step this update makes (the buffer's token before it)


@dataclass
class TokenBuffer(Generic[P]):
    """One owner's gradient buffer (thread-safe: an owner's server threads push concurrently)."""

    global_batch: int
    max_staleness: int
    mode: str = "gba"
    stats: GBAStats = field(default_factory=GBAStats)

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise GBAError(f"global_batch must be >= 1, got {self.global_batch}")
        if self.max_staleness < 0:
            raise GBAError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.mode not in MODES:
            raise GBAError(f"mode must be one of {MODES}, got {self.mode!r}")
        self._token = 0
        self._parts: list[tuple[float, P]] = []
        self._examples = 0
        self._lock = threading.Lock()

    @property
    def token(self) -> int:
        """The global steps applied so far: what a pull hands out."""
        return self._token

    @property
    def pending_examples(self) -> int:
        """Examples accepted and not yet applied."""
        return self._examples

    def push(self, token: int, examples: int, payload: P) -> Release[P] | None:
        """Accept (or drop) a gradient computed against ``token`` over ``examples`` examples;
        returns the :class:`Release` to apply when this push completes a global batch (in
        ``async``: always), else None. A push of no examples changes nothing."""
        if examples <= 0:
            return None
        with self._lock:
            s = self._token - token
            if s < 0:
                raise GBAError(f"token {token} is ahead of the buffer's {self._token}")
            st = self.stats
            st.staleness_sum += s
            if self.mode == "async":
                st.pushed += 1
                return self._release([(1.0, payload)], examples)
            if s > self.max_staleness:
                st.dropped += 1
                st.dropped_examples += examples
                return None
            w = decay(s)
            st.pushed += 1
            st.decayed += w < 1.0
            self._parts.append((w, payload))
            self._examples += examples
            if self._examples < self.global_batch:
                return None
            parts, n = self._parts, self._examples
            self._parts, self._examples = [], 0
            return self._release(parts, n)

    def flush(self) -> Release[P] | None:
        """Release what is held, short of a global batch (the end of a run, a snapshot), scaled
        to the mean over its examples; None when nothing is held."""
        with self._lock:
            if not self._parts:
                return None
            parts, n = self._parts, self._examples
            self._parts, self._examples = [], 0
            return self._release(parts, n)

    def _release(self, parts: list[tuple[float, P]], examples: int) -> Release[P]:
        r = Release(parts, self.global_batch / examples, examples, self._token)
        self._token += 1
        self.stats.applied += 1
        return r


def combine(release: Release[Any] | None, dense: Callable[[Any], np.ndarray]) -> np.ndarray | None:
    """``sum(weight * dense(payload)) * scale`` of a release of array payloads, in arrival order
    (None for no release). With one part of weight 1 and a scale of 1 the sum is the payload
    itself, bit for bit; two parts of weight 1 add as sync's two-rank sum does."""
    if release is None:
        return None
    out: np.ndarray | None = None
    for w, p in release.parts:
        x = dense(p)
        x = x if w == 1.0 else x * np.float32(w)
        out = x if out is None else out + x  # never in place: x may be the pusher's buffer
    assert out is not None
    return out if release.scale == 1.0 else out * np.float32(release.scale)
