"""The parameter deltas a serving replica dead-lettered, remembered across its restarts.

A replica re-reads ``param-deltas`` from its snapshot's offset on every start, so without a memory
it would dead-letter the same refused record again at each one. One line per record,
``<broker epoch>/<partition>/<offset>`` (offsets restart with the broker's epoch), in a file under
the replica's var dir; the newest ``keep`` are kept.

>>> import pathlib, tempfile
>>> path = pathlib.Path(tempfile.mkdtemp()) / "refused"
>>> seen = RefusedDeltas(path)
>>> seen.first_time("e1", 0, 7), seen.first_time("e1", 0, 7)
(True, False)
>>> RefusedDeltas(path).first_time("e1", 0, 7), RefusedDeltas(path).first_time("e2", 0, 7)
(False, True)
"""

from __future__ import annotations

import logging
from pathlib import Path

__all__ = ["RefusedDeltas"]

log = logging.getLogger(__name__)


class RefusedDeltas:
    """``first_time(epoch, partition, offset)``: True once per record, also across restarts."""

    def __init__(self, path: Path, keep: int = 10_000) -> None:
        self.path = path
        try:
            lines = path.read_text().split()
        except FileNotFoundError:
            lines = []
        except OSError as err:
            log.warning("refused deltas: cannot read %s (%s): a refused delta may be dead-lettered again", path, err)
            lines = []
        self._seen = set(lines[-keep:])
        if len(lines) > 2 * keep:
            self._write("".join(f"{line}\n" for line in lines[-keep:]), "w")

    def first_time(self, epoch: str | None, partition: int, offset: int) -> bool:
        key = f"{epoch or '-'}/{partition}/{offset}"
        if key in self._seen:
            return False
        self._seen.add(key)
        self._write(f"{key}\n", "a")
        return True

    def _write(self, text: str, mode: str) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open(mode) as f:
                f.write(text)
        except OSError as err:  # a full disk: remembered until this process stops
            log.warning("refused deltas: cannot write %s (%s)", self.path, err)
