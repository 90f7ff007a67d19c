"""Load a compiled signal-GEMM instance and launch it from Python (ctypes, no torch C++ ABI)."""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from .. import enqueue, jit
from .generator import GemmSpec, generate

# csrc/launcher.cuh fo_run: a, b, out, tiles, counters, workspace, alpha, row and column scales, the
# fused sums' result, sources and ready flags; 17 ints (the problem, grid and schedule, the fused
# sums' rows); the stream
RUN_ARGTYPES = [ctypes.c_void_p] * 12 + [ctypes.c_int] * 17 + [ctypes.c_void_p]


class FusedSums(NamedTuple):
    """A reduce-scatter's sums in the GEMM's epilogue (csrc/tile_slot.cuh FusedSums): C's rows [row0,
    row0 + rows) go to ``result`` [rows, N] with ``sources`` ([count, rows, N]: the other ranks' partial
    sums of them) added, once ``ready`` (int32, one per ``ready_rows`` of those rows) says they landed."""

    result: torch.Tensor
    sources: torch.Tensor
    ready: torch.Tensor
    row0: int
    ready_rows: int


class SignalGemm:
    """One compiled instance; built on first use into the on-disk cache."""

    def __init__(self, spec: GemmSpec) -> None:
        self.spec = spec
        lib = ctypes.CDLL(str(jit.build(spec.name, generate(spec), arch=spec.arch, cutlass=True)))
        lib.fo_last_error.restype = ctypes.c_char_p
        for fn in (lib.fo_num_ctas, lib.fo_stream_k_tiles, lib.fo_workspace_size):
            fn.argtypes = [ctypes.c_int] * 7
        lib.fo_workspace_size.restype = ctypes.c_longlong
        lib.fo_run.argtypes = RUN_ARGTYPES
        self._lib = lib
        self.signals_per_tile: int = lib.fo_signals_per_tile()

    # along_m, swizzle: the tile raster (see flashoverlap.plan.schedule_order); the plan decides it.
    def num_ctas(self, m: int, n: int, k: int, sm_count: int, device: int, along_m: bool, swizzle: int) -> int:
        """Persistent CTAs the kernel launches for this problem: the tiles of one wave."""
        return int(self._lib.fo_num_ctas(m, n, k, sm_count, device, along_m, swizzle))

    def stream_k_tiles(self, m: int, n: int, k: int, sm_count: int, device: int, along_m: bool, swizzle: int) -> int:
        """Leading output tiles a stream-K schedule splits along K (0 otherwise)."""
        return int(self._lib.fo_stream_k_tiles(m, n, k, sm_count, device, along_m, swizzle))

    def workspace_size(self, m: int, n: int, k: int, sm_count: int, device: int, along_m: bool, swizzle: int) -> int:
        return int(self._lib.fo_workspace_size(m, n, k, sm_count, device, along_m, swizzle))

    def run(
        self,
        a: torch.Tensor,
        weight: torch.Tensor,
        out: torch.Tensor,
        slots: torch.Tensor,
        counters: torch.Tensor,
        workspace: torch.Tensor | None,
        tiles: tuple[int, int],
        sm_count: int,
        along_m: bool,
        swizzle: int,
        rotate: int,
        interleave: int,
        late: tuple[int, int],
        stream: torch.cuda.Stream,
        alpha: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        cols: torch.Tensor | None = None,
        fused: FusedSums | None = None,
    ) -> None:
        """C = alpha * a @ B into ``out`` at the tile slots given by ``slots``, bumping ``counters``.

        ``tiles`` is the (tiles_m, tiles_n) grid; ``workspace`` holds :meth:`workspace_size` bytes;
        ``rotate``, ``interleave``: the tile row the schedule starts at and the segments it
        interleaves (plan.schedule_order); ``late``: (keep, after), the CTAs that go on after
        ``after`` waves of the whole grid ((0, 0): all of them; plan.late_after); ``alpha``: a float32
        scalar on the device, read by the kernel (FP8's scale_a * scale_b; None: 1); ``rows``,
        ``cols``: FP8's rowwise scales, M and N contiguous float32 on the device, C[i, j] scaled by
        rows[i] * cols[j] (the direct epilogue's; both or neither); ``fused``: the sums of a
        reduce-scatter in the epilogue (a sums kernel's, GemmSpec.sums).
        """
        m, k = a.shape
        n = weight.shape[0] if self.spec.weight_layout == "nk" else weight.shape[1]
        for name, t, size in (("alpha", alpha, 1), ("rows", rows, m), ("cols", cols, n)):
            if t is not None and (t.dtype != torch.float32 or t.shape != (size,) or t.device != a.device):
                raise ValueError(
                    f"{name} must be {size} float32 on {a.device}, got {t.dtype} {list(t.shape)} on {t.device}"
                )
        if (rows is None) != (cols is None) or alpha is not None and rows is not None:
            raise ValueError("scales: alpha alone, or rows and cols together (rowwise)")
        if rows is not None and not (rows.is_contiguous() and cols.is_contiguous()):
            raise ValueError("rowwise scales must be contiguous")
        sums = (None, None, None, 0, 0, 0, 1)
        if fused is not None:
            result, sources, ready = fused.result, fused.sources, fused.ready
            height = result.shape[0]
            if (
                result.shape != (height, n)
                or sources.shape[1:] != (height, n)
                or not (result.is_contiguous() and sources.is_contiguous() and ready.dtype == torch.int32)
            ):
                raise ValueError("fused sums: result [rows, N], sources [count, rows, N], contiguous; int32 flags")
            count = sources.shape[0]
            sums = (result.data_ptr(), sources.data_ptr() if count else None, ready.data_ptr())
            sums += (fused.row0, height, count, fused.ready_rows)
        args = (
            a.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            slots.data_ptr(),
            counters.data_ptr(),
            None if workspace is None else workspace.data_ptr(),
            None if alpha is None else alpha.data_ptr(),
            None if rows is None else rows.data_ptr(),
            None if cols is None else cols.data_ptr(),
            *sums[:3],
            m,
            n,
            k,
            tiles[0],
            tiles[1],
            sm_count,
            a.device.index,
            along_m,
            swizzle,
            rotate,
            interleave,
            *late,
            *sums[3:],
            stream.cuda_stream,
        )
        jit.check(self._lib, self._lib.fo_run(*args), "fo_last_error")
        if enqueue.noting():
            fo_run = self._lib.fo_run
            enqueue.note(enqueue.signature(fo_run.argtypes), enqueue.address(self._lib, "fo_run"), args, self._error)

    def _error(self, status: int) -> str:
        return self._lib.fo_last_error().decode()


@functools.cache
def get_kernel(spec: GemmSpec) -> SignalGemm:
    return SignalGemm(spec)
