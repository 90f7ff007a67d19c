"""The copies and adds of a call's own steps, each one native call on the current stream (a replay
can enqueue it, flashoverlap.enqueue): strided copies on the copy engines (:func:`copy_2d`), adds
and sums of partial sums (:func:`add`, :func:`add_rows`), the tiles' restore (:func:`restore`); the
same operations with torch on the CPU (the reference executor)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import enqueue
from ..plan import Plan, slot_view

MAX_SUM = 8  # the most rows csrc/runtime.cu fo_sum adds in one pass
MAX_PITCH = 2**31 - 1  # bytes between rows cudaMemcpy2DAsync takes (cudaDevAttrMaxPitch on current GPUs)
ADD_DTYPES = {torch.bfloat16: 0, torch.float16: 1}  # csrc/runtime.cu fo_sum's dtype codes


def copy_2d(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for 2-D views of one shape with contiguous rows; on CUDA a strided copy on
    the copy engines (cudaMemcpy2DAsync, no SM) on the current stream, where the row pitches fit
    its limit (2 GiB)."""
    size = dst.element_size()
    if not dst.is_cuda or max(dst.stride(0), src.stride(0)) * size > MAX_PITCH:
        dst.copy_(src)
        enqueue.opaque()
        return
    stream = torch.cuda.current_stream(dst.device).cuda_stream
    rows, cols = dst.shape
    pitches = (dst.stride(0) * size, src.stride(0) * size)
    enqueue.runtime_call(
        "fo_copy_2d", dst.data_ptr(), pitches[0], src.data_ptr(), pitches[1], cols * size, rows, stream
    )


def add(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out`` = ``a`` + ``b`` (one shape and dtype; ``out`` may be ``a``), rounded once as torch's add:
    :func:`add_rows` of the two."""
    add_rows([a, b], out)


def add_rows(rows: Sequence[torch.Tensor], out: torch.Tensor, also: torch.Tensor | None = None) -> None:
    """``out`` (and ``also``, where given) = the sum of ``rows`` (each of ``out``'s shape; ``out`` may
    be one of them), summed in float32 in their order and rounded once: the same sum on every rank
    that adds the same rows. On CUDA one pass of csrc/runtime.cu's fo_sum (a native call a replay
    can enqueue) over up to :data:`MAX_SUM` rows: each element read once per row and written once
    (to each output), where chained two-row adds read and write the running sum again per row, on
    the few SMs a GEMM leaves; ``also`` saves a copy (beside a GEMM, a copy engine's copy within
    one GPU ran at ~100 GB/s)."""
    if len(rows) == 1 or len(rows) > MAX_SUM:  # (more ranks than one host's GPUs: the first rows' sum, then the rest)
        if len(rows) == 1:
            copy_2d(out.view(1, -1), rows[0].view(1, -1))
        else:
            add_rows(rows[:MAX_SUM], out)
            add_rows([out, *rows[MAX_SUM:]], out)
        if also is not None:
            copy_2d(also.view(1, -1), out.view(1, -1))
        return
    outputs = (out,) if also is None else (out, also)
    if out.is_cuda and out.dtype in ADD_DTYPES and all(t.is_contiguous() for t in (*outputs, *rows)):
        stream = torch.cuda.current_stream(out.device).cuda_stream
        inputs = [t.data_ptr() for t in rows] + [None] * (MAX_SUM - len(rows))
        second = None if also is None else also.data_ptr()
        dtype = ADD_DTYPES[out.dtype]
        enqueue.runtime_call("fo_sum", out.data_ptr(), second, *inputs, len(rows), out.numel(), dtype, stream)
        return
    total = rows[0].float()
    for row in rows[1:]:
        total = total + row.float()
    for target in outputs:
        target.copy_(total)
    enqueue.opaque()


def restore(buffer: torch.Tensor, out: torch.Tensor, plan: Plan, slots: torch.Tensor | None = None) -> None:
    """Copy every tile from its slot in the flat ``buffer`` into row-major ``out`` [m, n].

    On CUDA this is one gather kernel on the current stream (``slots`` is the plan's slot table
    on the device); on the CPU, a loop over tiles.
    """
    if buffer.is_cuda:
        enqueue.runtime_call(
            "fo_restore",
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
        return
    for tile in range(plan.num_tiles):
        r0, c0, rows, cols = plan.tile_extent(tile)
        out[r0 : r0 + rows, c0 : c0 + cols] = slot_view(buffer, plan, tile)
