"""Where a model's dense part runs (``trainer.device``): the head, its optimizer and the pooling.

The PS tables stay on the host (numba), the source of truth for deltas and snapshots; what crosses
to the device each step is the batch's looked-up rows (host to device) and their gradients (device
to host). :class:`Transfers` makes those copies and counts their bytes: on the CPU they are the
arrays themselves (``torch.from_numpy``, ``Tensor.numpy``: no copy, nothing counted), on CUDA a
host array is staged in pinned memory and copied without blocking the host.

>>> import numpy as np
>>> io = Transfers(resolve_device("cpu"))
>>> a = np.arange(6, dtype=np.float32)
>>> t = io.to_device(a)
>>> bool(np.shares_memory(io.to_host(t), a)), io.h2d_bytes
(True, 0)
>>> resolve_device("tpu")
Traceback (most recent call last):
...
trainer.device.DeviceError: trainer.device must be "cpu", "cuda" or "cuda:N", not 'tpu'
"""

from __future__ import annotations

import re

import numpy as np
import torch

__all__ = ["DeviceError", "Transfers", "resolve_device"]

_NAME = re.compile(r"cpu|cuda(:\d+)?")


class DeviceError(ValueError):
    """``trainer.device`` names no device this process can use."""


def resolve_device(name: str | torch.device) -> torch.device:
    """The torch device ``name`` says; a CUDA one only where torch sees it."""
    if isinstance(name, torch.device):
        name = str(name)
    if not _NAME.fullmatch(name):
        raise DeviceError(f'trainer.device must be "cpu", "cuda" or "cuda:N", not {name!r}')
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"trainer.device = {name!r}, but torch sees no CUDA device here "
                              f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
        if (device.index or 0) >= torch.cuda.device_count():
            raise DeviceError(f"trainer.device = {name!r}, but torch sees {torch.cuda.device_count()} CUDA devices")
    return device


class Transfers:
    """A step's host/device copies, and their bytes (``h2d_bytes``, ``d2h_bytes``: CUDA only).

    On CUDA a host array goes over through one of :data:`STAGES` pinned buffers, reused in turn
    (pinning memory for every copy costs more than the copy): a buffer is refilled only once the
    copy that last read it is done (its event), so copies leave without blocking the host."""

    #: pinned staging buffers in the ring: more than one step's copies (rows, indices, labels)
    STAGES = 8

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self._stages: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._turn = 0

    def to_device(self, a: np.ndarray | torch.Tensor) -> torch.Tensor:
        """``a`` on the device (a host array: its own memory on the CPU, a pinned copy sent on CUDA)."""
        t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
        if not self.cuda:
            return t
        n = t.numel() * t.element_size()
        self.h2d_bytes += n
        if not n:
            return torch.empty(t.shape, dtype=t.dtype, device=self.device)
        i = self._turn % self.STAGES
        self._turn += 1
        staged = self._stage(i, n).view(t.dtype).view(t.shape)
        staged.copy_(t)
        out = staged.to(self.device, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._stages[i] = (self._stages[i][0], done)
        return out

    def _stage(self, i: int, n: int) -> torch.Tensor:
        """Pinned buffer ``i`` (at least ``n`` bytes), once the copy that last read it is done."""
        while len(self._stages) <= i:
            self._stages.append((torch.empty(0, dtype=torch.uint8, pin_memory=True), None))
        buf, done = self._stages[i]
        if done is not None:
            done.synchronize()
        if buf.numel() < n:
            buf = torch.empty(max(n, 2 * buf.numel()), dtype=torch.uint8, pin_memory=True)
            self._stages[i] = (buf, None)
        return buf[:n]

    def to_host(self, t: torch.Tensor) -> np.ndarray:
        """``t`` as a host array (its own memory on the CPU; a copy, waited for, on CUDA)."""
        t = t.detach()
        if self.cuda:
            self.d2h_bytes += t.numel() * t.element_size()
            t = t.cpu()
        return t.numpy()
