"""Which devices a request gets, given the leases that stand: the registry's grant policy.

Selection is deterministic: the lowest free GPUs in PCI order. A lease is ``exclusive`` (no
other lease on the GPU) or ``shared`` (co-held with other shared leases only, up to a
per-GPU limit); a MIG instance and its GPU are one device for this purpose: while any of a
GPU's instances is leased the GPU is busy, and the other way round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpuhost.devices import GpuDevice
from gpuhost.errors import GpuBusy, GpusExhausted
from gpuhost.spec import SHARED

if TYPE_CHECKING:
    from gpuhost.leases import Lease


def grant(
    leases: Sequence[Lease],
    inventory: Sequence[GpuDevice],
    count: int,
    exact: Sequence[GpuDevice],
    mode: str,
    share_limit: int,
) -> tuple[GpuDevice, ...]:
    """What a request gets given ``leases``, or the error that refuses it."""
    if exact:
        for gpu in exact:
            reason = _blocked(gpu, mode, leases, share_limit)
            if reason:
                raise GpuBusy(gpu.describe(), reason)
        return tuple(exact)
    open_ = [gpu for gpu in inventory if not _blocked(gpu, mode, leases, share_limit)]
    if mode == SHARED:  # fill the GPUs already shared before taking free ones
        open_.sort(key=lambda gpu: not _related(gpu, leases))
    if len(open_) < count:
        held = [gpu for gpu in inventory if _related(gpu, leases)]
        shared = [gpu for gpu in held if all(x.mode == SHARED for x in _related(gpu, leases))]
        raise GpusExhausted(
            count,
            len(open_),
            len(inventory),
            f"{mode}; {len(held) - len(shared)} held exclusively, {len(shared)} shared"
            + (f" (at most {share_limit} sandboxes each)" if mode == SHARED else ""),
        )
    return tuple(open_[:count])


def _related(gpu: GpuDevice, leases: Sequence[Lease]) -> list[Lease]:
    """The leases on ``gpu``, on its MIG instances, or on the GPU it is an instance of."""
    return [
        lease
        for lease in leases
        if lease.gpu_uuid == gpu.uuid
        or lease.parent_uuid == gpu.uuid
        or (gpu.parent_uuid is not None and lease.gpu_uuid == gpu.parent_uuid)
    ]


def _blocked(gpu: GpuDevice, mode: str, leases: Sequence[Lease], share_limit: int) -> str:
    """Why ``gpu`` cannot be granted in ``mode``: the holder, and how it holds it; "" if it can.

    A shared request may join shared leases of the very same device while they are fewer
    than the smallest limit any of them (or it) was taken with.
    """
    related = _related(gpu, leases)
    if not related:
        return ""
    if mode == SHARED and all(x.mode == SHARED and x.gpu_uuid == gpu.uuid for x in related):
        limit = min([share_limit, *(x.share_limit or share_limit for x in related)])
        if len(related) < limit:
            return ""
        return f"shared by {len(related)} sandboxes, its limit: {related[0].describe()}"
    first = related[0]
    how = "shared" if first.mode == SHARED else "held exclusively"
    what = "" if first.gpu_uuid == gpu.uuid else f" through {first.gpu_uuid}"
    return f"{how}{what} by {first.describe()}"
