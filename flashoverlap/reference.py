"""CPU reference executor: replays a :class:`Plan` exactly as the GPU path runs it.

Tiles are computed in the plan's execution order (fp32 accumulate, rounded to the output dtype
like the kernel's epilogue) and written into their slots of a NaN-poisoned buffer; each group's
collective runs on its contiguous range as soon as the group and every group before it are
complete (the order the communication stream issues them), through the same per-group code as
the GPU path; C is restored at the end where the layout needs it. With ``window``, the buffers
stand apart from the result as in a symmetric window, and the result is copied out of them as the
GPU path does (group by group where comm.landed gives the range, else at the end). Run it under
gloo with several processes to check every layout decision without a GPU.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from . import comm
from .inputs import FP8_DTYPES, check_inputs
from .plan import Plan, slot_view


def run_plan(
    a: torch.Tensor,
    weight: torch.Tensor,
    plan: Plan,
    ex: comm.Exchange,
    *,
    group: dist.ProcessGroup | None = None,
    weight_layout: str = "nk",
    window: bool = False,
) -> torch.Tensor:
    """The result the GPU path returns for ``plan`` and exchange ``ex`` (see comm.exchange)."""
    m, n, _ = check_inputs(a, weight, weight_layout, device_type="cpu")
    if a.dtype in FP8_DTYPES:
        raise ValueError("the reference executor replays 16-bit calls (FP8's scales are not modelled)")
    if (m, n) != (plan.m, plan.n):
        raise ValueError(f"plan is for a {plan.m}x{plan.n} output, operands give {m}x{n}")
    b = (weight.t() if weight_layout == "nk" else weight).float()
    comm.check_layout(ex, plan.layout, plan.rotation_rows)
    segments = comm.interleave(ex, plan.layout, ex.reduction)
    if (plan.split if plan.layout == "rows" else plan.interleave) != segments:
        raise ValueError(f"a {plan.layout!r} plan for this call knows of {segments} segments (comm.interleave)")
    start = comm.rows_rotation(ex, plan.layout, dist.get_rank(group))
    if plan.rotate * plan.tile_m != start:
        raise ValueError(
            f"this rank's plan must start at row {start} (comm.rows_rotation), not {plan.rotate * plan.tile_m}"
        )

    def poisoned(shape):
        return torch.full(shape, float("nan"), dtype=a.dtype)

    out, buffer, recv = comm.buffers(ex, plan, poisoned)
    # a pull's copies out of the other ranks' memory (the GPU path's steps), as gathers
    peers = comm.peer.Gathered(group or dist.group.WORLD, buffer) if ex.reduction in comm.PULLS else None
    result = poisoned(out.shape) if window else out
    copy_out = window and comm.landed(ex, plan, 0, out) is not None
    fused = _Fused(ex, plan, peers) if ex.reduction == "pull_fused" else None
    remaining = np.array(plan.tiles_per_group)
    issued = 0
    for tile in plan.order:
        r0, c0, rows, cols = plan.tile_extent(int(tile))
        product = a[r0 : r0 + rows].float() @ b[:, c0 : c0 + cols]
        if fused is not None and fused.owns(r0):
            fused.add(product, r0, c0, recv, out)
        else:
            slot_view(buffer, plan, int(tile)).copy_(product)
        remaining[plan.group[tile]] -= 1
        while issued < plan.num_groups and remaining[issued] == 0:
            comm.communicate_group(ex, plan, issued, buffer, recv, out, peers or group)
            if fused is not None:
                fused.ready.update(fused.bands[issued])
            comm.finish_group(ex, plan, issued, buffer, recv, result, peers)
            comm.gather_group(ex, plan, issued, buffer, result, peers)
            if copy_out:
                comm.landed(ex, plan, issued, result).copy_(comm.landed(ex, plan, issued, out))
            issued += 1
    if issued != plan.num_groups:
        raise AssertionError(f"plan left groups {list(range(issued, plan.num_groups))} incomplete")
    if plan.layout == "tiles":
        comm.restore(buffer, result, plan)
    if result is not out and comm.lands_in_out(ex, plan) and not copy_out:
        result.copy_(out)
    return result


class _Fused:
    """A ``pull_fused`` reduce-scatter's epilogue (csrc/tile_slot.cuh FusedSums): a tile of this
    rank's rows, computed once the ready flags of its band are set, goes to the result with the
    other ranks' copied partial sums of it added (in float32, rounded once). Where the GPU would wait
    for a flag that the walk sets only later, it raises: on GPUs that plan would wait forever."""

    def __init__(self, ex: comm.Exchange, plan: Plan, peers: comm.peer.Pulls) -> None:
        self.row0, self.rows, self.n = peers.rank * ex.rows, plan.rotation_rows, plan.n
        self.height, self.count = ex.rows, len(peers.others)
        self.bands = comm.ready_bands(ex, plan, peers.rank, self.rows)
        self.ready = set() if self.count else set(range(ex.rows // self.rows))  # (one rank: none to wait for)

    def owns(self, row: int) -> bool:
        return self.row0 <= row < self.row0 + self.height

    def add(self, product: torch.Tensor, r0: int, c0: int, recv: torch.Tensor, out: torch.Tensor) -> None:
        local, (rows, cols) = r0 - self.row0, product.shape
        if local // self.rows not in self.ready:
            raise AssertionError(f"rows {r0}..{r0 + rows} computed before their band's copies are ready")
        sources = recv.view(self.count, self.height, self.n)[:, local : local + rows, c0 : c0 + cols]
        out[local : local + rows, c0 : c0 + cols] = product + sources.float().sum(0)
