"""Where one rank of :mod:`trainer.dist.model` runs its dense part (``trainer.device``), and the
process group its dense sum travels on.

* **The device**: ``"cuda"`` is ``cuda:LOCAL_RANK`` (the launcher's local rank; the global rank
  when no launcher set it, as in the tests' spawned ranks): one GPU per rank of a machine. NCCL
  refuses two ranks on one GPU, so ``"cuda:N"`` is taken as given only for a rank alone on its
  machine's GPU N. ``"cpu"`` is the CPU for every rank.
* **The groups**: the sparse exchange (ids, host rows and their gradients: numpy arrays of the host
  PS) stays on gloo with CPU tensors, on the engine's lookup group. The dense head's gradients live
  on the device: when every rank's device is CUDA they are summed on a second process group of
  their own, NCCL (GPU to GPU, no copy through the host), as ``torch.distributed`` intends: one
  backend per kind of tensor; otherwise on the default gloo group, as before.

The ranks agree on the kind first (one ``all_gather`` on gloo): a group where some ranks have a
GPU and others not raises :class:`trainer.dist.model.DistributedError` on every rank together,
rather than hang in a ``new_group`` only some ranks call.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..device import DeviceError, resolve_device

__all__ = ["dense_group", "rank_device"]


def rank_device(name: str | torch.device, rank: int) -> torch.device:
    """The device of rank ``rank`` for ``trainer.device`` = ``name`` (the module docstring)."""
    device = resolve_device(name)
    if device.type != "cuda" or device.index is not None:
        return device
    local = int(os.environ.get("LOCAL_RANK", rank))
    try:
        return resolve_device(f"cuda:{local}")
    except DeviceError as err:
        raise DeviceError(f"trainer.device = 'cuda' puts local rank {local} on cuda:{local}: {err}") from None


def dense_group(device: torch.device, group, error: type[Exception]):
    """The process group of the dense sum: NCCL when every rank of ``group`` runs on CUDA, else
    ``group`` itself (gloo). Collective over ``group``; raises ``error`` on every rank when the
    ranks' kinds of device differ, or when this torch has no NCCL."""
    cuda = device.type == "cuda"
    kinds = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(kinds, torch.tensor([int(cuda)]), group=group)
    n_cuda = int(torch.cat(kinds).sum())
    if n_cuda == 0:
        return group
    if n_cuda != len(kinds):
        raise error(f"{n_cuda} of {len(kinds)} ranks train on CUDA, the others on the CPU: every rank "
                    "needs one kind of device (trainer.device)")
    if not dist.is_nccl_available():
        raise error("trainer.device is CUDA on every rank, but this torch has no NCCL for the dense sum")
    torch.cuda.set_device(device)  # NCCL binds this process's communicators to the current device
    return dist.new_group(backend="nccl")
