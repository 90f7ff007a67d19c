"""Per-group collectives on contiguous buffer ranges, and the restore to row-major C.

Communication is plain torch.distributed (NCCL on GPUs, gloo in the CPU reference executor) on
one contiguous range per group, so any backend and transport works.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from .. import jit
from ..plan import Plan, slot_view

COLLECTIVES = ("all_reduce",)

_budget_groups: dict[tuple, dist.ProcessGroup] = {}


def agree(group: dist.ProcessGroup | None, description: str, device: torch.device) -> None:
    """Check that every rank of ``group`` describes the same call; raise on all of them if not.

    Ranks that planned different calls (shape, dtype, config, partition) would otherwise issue
    collectives of different sizes and wait for each other forever. One all-gather of a hash,
    with a host sync: meant for the first call of each plan, not every call.
    """
    digest = int.from_bytes(hashlib.sha256(description.encode()).digest()[:8], "little", signed=True)
    if dist.get_backend(group) == "gloo":
        device = torch.device("cpu")
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    hashes = [int(t.item()) for t in gathered]
    if len(set(hashes)) > 1:
        groups = {}
        for rank, h in enumerate(hashes):
            groups.setdefault(h, []).append(rank)
        raise RuntimeError(
            "flashoverlap: ranks planned different calls (ranks grouped by plan: "
            f"{sorted(groups.values())}); this rank ({dist.get_rank(group)}) planned: {description}"
        )


def budget_group(group: dist.ProcessGroup, comm_sms: int) -> dist.ProcessGroup:
    """An NCCL communicator over ``group``'s ranks whose kernels fit in ``comm_sms`` SMs.

    While the GEMM holds the other SMs, NCCL kernels get only the ``comm_sms`` left free. A
    default communicator launches more CTAs than that, in clusters of 4 on Hopper (which need 4
    free SMs in one GPC), and crawls until the GEMM ends. This one is capped at ``comm_sms``
    single CTAs. Created once per (group, comm_sms) by every member rank, on first use;
    ``comm_sms == 0`` or a non-NCCL group keeps ``group`` itself.
    """
    if comm_sms == 0 or dist.get_backend(group) != "nccl":
        return group
    key = (group, comm_sms)
    if key not in _budget_groups:
        options = dist.ProcessGroupNCCL.Options()
        options.config.cga_cluster_size = 1
        options.config.min_ctas = comm_sms
        options.config.max_ctas = comm_sms
        ranks = dist.get_process_group_ranks(group)
        _budget_groups[key] = dist.new_group(ranks, backend="nccl", pg_options=options, use_local_synchronization=True)
    return _budget_groups[key]


def collective(name: str, chunk: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Run collective ``name`` in place on ``chunk`` (one group's buffer range)."""
    if name == "all_reduce":
        dist.all_reduce(chunk, group=group)
    else:
        raise ValueError(f"unknown collective {name!r}; supported: {COLLECTIVES}")


def restore(buffer: torch.Tensor, out: torch.Tensor, plan: Plan, slots: torch.Tensor | None = None) -> None:
    """Copy every tile from its slot in the flat ``buffer`` into row-major ``out`` [m, n].

    On CUDA this is one gather kernel on the current stream (``slots`` is the plan's slot table
    on the device); on the CPU, a loop over tiles.
    """
    if buffer.is_cuda:
        lib = jit.runtime_library()
        status = lib.fo_restore(
            buffer.data_ptr(),
            out.data_ptr(),
            slots.data_ptr(),
            plan.num_tiles,
            plan.m,
            plan.n,
            plan.tile_m,
            plan.tile_n,
            plan.tiles_n,
            buffer.element_size(),
            torch.cuda.current_stream(buffer.device).cuda_stream,
        )
        jit.check(lib, status, "fo_runtime_error")
        return
    for tile in range(plan.num_tiles):
        r0, c0, rows, cols = plan.tile_extent(tile)
        out[r0 : r0 + rows, c0 : c0 + cols] = slot_view(buffer, plan, tile)
