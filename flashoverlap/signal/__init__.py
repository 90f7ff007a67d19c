"""Stream-side waits on the GEMM's group counters.

``cuStreamWaitValue32`` (GEQ) makes the communication stream wait in the GPU's front end,
costing no SM. Where stream memory operations are unsupported, a one-thread spin kernel does
the same job. ``FLASHOVERLAP_WAIT=stream|spin`` forces one (default: probe, prefer stream).
Counters are reset on the stream (``zero_``), so a call can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import os

import torch

from .. import jit

WAIT_MODES = ("auto", "stream", "spin")


def _wait_mode() -> str:
    mode = os.environ.get("FLASHOVERLAP_WAIT", "auto")
    if mode not in WAIT_MODES:
        raise ValueError(f"FLASHOVERLAP_WAIT must be one of {WAIT_MODES}, got {mode!r}")
    return mode


def _stream_wait(stream: torch.cuda.Stream, address: int, value: int) -> int:
    from cuda.bindings import driver

    (err,) = driver.cuStreamWaitValue32(
        driver.CUstream(stream.cuda_stream),
        driver.CUdeviceptr(address),
        value,
        driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ,
    )
    return int(err)


@functools.cache
def uses_stream_wait(device: int) -> bool:
    """Whether waits on ``device`` use cuStreamWaitValue32 (else the spin kernel)."""
    mode = _wait_mode()
    if mode != "auto":
        return mode == "stream"
    try:
        probe = torch.zeros(1, dtype=torch.int32, device=device)
        stream = torch.cuda.Stream(device=device)
        ok = _stream_wait(stream, probe.data_ptr(), 0) == 0  # 0 >= 0: passes at once
        stream.synchronize()
        return ok
    except ImportError:
        return False


def wait_geq(stream: torch.cuda.Stream, counters: torch.Tensor, index: int, target: int) -> None:
    """Enqueue on ``stream``: wait until ``counters[index] >= target`` (cyclic, 32-bit)."""
    address = counters.data_ptr() + 4 * index
    if uses_stream_wait(counters.device.index):
        err = _stream_wait(stream, address, target)
        if err != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {err}")
    else:
        lib = jit.runtime_library()
        jit.check(lib, lib.fo_spin_wait(address, target, stream.cuda_stream), "fo_runtime_error")
