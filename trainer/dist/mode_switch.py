"""When the online ranks switch between ``sync`` and ``gba`` (issue 34, "switching without
retuning"): the decisions, pure and the same on every rank. The switch itself (the model handed
over in memory) is :meth:`trainer.dist.rank_trainer.RankTrainer._switch`.

**Auto** (``trainer.dist_mode = "auto"``: starts in sync). Every round's agreement carries each
rank's *work* per step (its last full batch's step less its seconds waiting in collectives or
RPCs, plus any ``debug_slow_rank`` sleep: :class:`Speed`) and rank 0's clock, so every rank feeds
:class:`AutoSwitch` the same numbers and takes the same decision in the same round, with no
message of its own. A round is a
straggler's (:func:`straggling`) when its slowest rank worked over ``trainer.gba.straggler_ratio``
x the median of the *other* ranks' work (the median of all, with 2 ranks the mean, would need the
slow rank over 2 x itself halfway: never at ratio 2). A rank that stepped no example in a round
sends its work as it last measured it in this mode: waiting for examples does not change its
speed, and in gba the fast rank drains its partitions first, so rounds with every rank stepping
can be too few to judge a recovery by (a fresh-clone run stayed in gba so). A partial batch's step
counts only until a full one was measured (a drained rank's last, small batch would make it look
fast). A round where no rank stepped is not fed (nothing new), and one where some rank has not
stepped since the switch (its work is sent as 0: a gba step costs less than a sync one) tells
nothing and leaves the timer as it is. Once the group has been in its mode for
``trainer.gba.switch_after_s`` of rank 0's clock (and at least 3 rounds), every round looks at
the rounds of the last ``switch_after_s``: it goes to gba when each rank's *median* work over them
makes a straggler, back to sync when it no longer does. Medians, so that the straggler must have been slow in most of those rounds and one
slow round (a GC, a busy core on a shared machine) flips nothing; the window starts again after a
switch, so the new mode is judged on its own rounds and the group cannot flap faster than that.

**A setting change** (a non-auto mode): a running rank cannot re-read its settings from the
environment (the process' environment is fixed at its start, and ``driftline up --config`` copies
the project file into it: :func:`driftline.project.apply_to_environ`). So at each snapshot rank 0
re-reads the project file (``settings.project``, ``DRIFTLINE_PROJECT``) and the group switches to its ``dist_mode`` when
*the file's value changed since the last read* (:class:`FileMode`): an environment variable set
at start keeps winning over the file as it did, until someone edits the file.

>>> straggling([10_000, 45_000], 2.0)   # rank 1: 4.5 x rank 0's work
True
>>> straggling([10_000, 15_000], 2.0)
False
>>> straggling([0, 45_000], 2.0) is None   # an idle rank: no evidence
True
>>> a = AutoSwitch(2.0, after_s=5.0)
>>> [a.observe(t, "sync", [10, 50]) for t in (0.0, 3.0, 5.0)]
[None, None, 'gba']
>>> rounds = [(6.0, [10, 12]), (8.0, [10, 50]), (9.0, [10, 12]), (11.0, [11, 10])]
>>> [a.observe(t, "gba", w) for t, w in rounds]   # recovered at 6 s; one slow round at 8 s
[None, None, None, 'sync']
"""

from __future__ import annotations

import logging
from collections import deque
from pathlib import Path

import numpy as np

__all__ = ["AutoSwitch", "FileMode", "Speed", "straggling"]

log = logging.getLogger(__name__)


def straggling(work_us, ratio: float) -> bool | None:
    """Whether the slowest rank's work is over ``ratio`` x the median of the others' (None: one
    rank, or a rank that did not work: the round tells nothing)."""
    w = np.asarray(work_us, np.float64)
    if w.size < 2 or not (w > 0).all():
        return None
    slow = int(np.argmax(w))
    return bool(w[slow] > ratio * max(float(np.median(np.delete(w, slow))), 1.0))


class Speed:
    """A rank's work per step as it goes into the rounds' agreement (module docstring): a full
    batch's step always counts, a partial one's only until a full one was measured since the last
    :meth:`reset` (a switch); a rank that waits for examples keeps its speed.

    >>> s = Speed(batch_size=32)
    >>> s.stepped(32, 0.002); s.us
    2000
    >>> s.stepped(3, 0.0003); s.us   # a drained rank's last, small batch: not its speed
    2000
    >>> s.reset(); s.us              # the new mode's steps cost what they cost
    0
    >>> s.stepped(3, 0.0003); s.us   # partial batches only, so far: the best measure there is
    300
    >>> s.stepped(32, 0.0025); s.stepped(5, 0.0004); s.us
    2500
    """

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.us, self._full = 0, False

    def stepped(self, examples: int, work_s: float) -> None:
        full = examples >= self.batch_size
        if examples and (full or not self._full):
            self.us, self._full = int(1e6 * work_s), full

    def reset(self) -> None:
        self.us, self._full = 0, False


class AutoSwitch:
    """``dist_mode = "auto"``'s rule: fed every round, returns the mode to switch to (or None)."""

    MIN_ROUNDS = 3

    def __init__(self, ratio: float, after_s: float):
        self.ratio, self.after_s = ratio, after_s
        self._rounds: deque[tuple[float, np.ndarray]] = deque()  # (rank 0's clock, work per rank)
        self._start: float | None = None  # the first round with evidence in this mode

    def observe(self, now_s: float, mode: str, work_us) -> str | None:
        """``mode``: the group's now; ``work_us``: each rank's work per step (0: none yet)."""
        w = np.asarray(work_us, np.float64)
        if straggling(w, self.ratio) is None:
            return None
        if self._start is None:
            self._start = now_s
        self._rounds.append((now_s, w))
        while self._rounds[0][0] < now_s - self.after_s:
            self._rounds.popleft()
        if now_s - self._start < self.after_s or len(self._rounds) < self.MIN_ROUNDS:
            return None
        want = "gba" if straggling(np.median([r for _, r in self._rounds], axis=0), self.ratio) else "sync"
        if want == mode:
            return None
        self._rounds.clear()
        self._start = None
        return want


class FileMode:
    """The project file's ``trainer.dist_mode`` as it changes (module docstring): :meth:`changed`
    gives the new value when the file's differs from the last read, else None."""

    def __init__(self, path: Path | None):
        self.path = path
        self._last: str | None = None
        self._last = self.read()

    def read(self) -> str | None:
        """The file's ``dist_mode`` (None: no file, none set, or the file unreadable now)."""
        if self.path is None:
            return None
        from driftline.project import ProjectError, load_project  # (no torch: light)
        try:
            value = load_project(self.path).settings_overrides().get("trainer", {}).get("dist_mode")
        except ProjectError as err:  # a half-written file: the next snapshot reads it again
            log.warning("dist_mode: the project file is unreadable now (%s); mode kept", err)
            return self._last
        return str(value) if value is not None else None

    def changed(self) -> str | None:
        now = self.read()
        if now == self._last:
            return None
        self._last = now
        return now
