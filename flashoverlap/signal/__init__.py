"""Stream-side waits on the GEMM's group counters.

``cuStreamWaitValue32`` (GEQ) makes the communication stream wait in the GPU's front end,
costing no SM. Where stream memory operations are unsupported, a one-thread spin kernel does
the same job. ``FLASHOVERLAP_WAIT=stream|spin`` forces one (default: probe, prefer stream).
Counters are reset on the stream (:func:`reset`), so a call can be captured in a CUDA graph (where
waits are spin kernels).

Debug mode (``FLASHOVERLAP_DEBUG=1``): every wait is a spin kernel that gives up after
``FLASHOVERLAP_TIMEOUT_S`` seconds (default 10) and records which group it waited for and the
counter value it saw; the call then synchronises and raises instead of hanging.
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


def debug_timeout() -> float | None:
    """Seconds a wait may take in debug mode (``FLASHOVERLAP_DEBUG=1``); None outside it."""
    if os.environ.get("FLASHOVERLAP_DEBUG") != "1":
        return None
    text = os.environ.get("FLASHOVERLAP_TIMEOUT_S", "10")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"FLASHOVERLAP_TIMEOUT_S must be a positive number of seconds, got {text!r}")
    return seconds


def wait_geq(
    stream: torch.cuda.Stream,
    counters: torch.Tensor,
    index: int,
    target: int,
    timeout: float | None = None,
    report: torch.Tensor | None = None,
) -> None:
    """Enqueue on ``stream``: wait until ``counters[index] >= target`` (cyclic, 32-bit).

    With ``timeout`` (seconds), a spin kernel gives up after that long and writes
    ``{1, index, value, target}`` into ``report`` (int32[4], zero until then).
    """
    address = counters.data_ptr() + 4 * index
    # The spin kernel (one thread, fits beside a GEMM CTA) without a time limit where stream memory
    # operations are missing, and inside CUDA-graph capture, where it is the wait sure to capture
    # on every driver.
    if timeout is None and (torch.cuda.is_current_stream_capturing() or not uses_stream_wait(counters.device.index)):
        timeout = 0.0
    if timeout is None:
        err = _stream_wait(stream, address, target)
        if err != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {err}")
        return
    lib = jit.runtime_library()
    where = None if report is None else report.data_ptr()
    status = lib.fo_spin_wait(address, target, int(timeout * 1e9), where, index, stream.cuda_stream)
    jit.check(lib, status, "fo_runtime_error")


def reset(counters: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Enqueue on ``stream``: zero ``counters`` for the next call (a memset: cheaper to enqueue
    than a fill kernel)."""
    lib = jit.runtime_library()
    status = lib.fo_zero(counters.data_ptr(), counters.numel() * counters.element_size(), stream.cuda_stream)
    jit.check(lib, status, "fo_runtime_error")


def raise_on_timeout(report: torch.Tensor, groups: int, timeout: float) -> None:
    """Wait for the call that ``report`` belongs to; raise if one of its waits timed out."""
    torch.cuda.current_stream(report.device).synchronize()
    timed_out, group, value, target = report.tolist()
    if timed_out:
        report.zero_()
        raise RuntimeError(
            f"flashoverlap: group {group} of {groups} never completed: its counter reached {value} of {target} "
            f"within {timeout:g} s (FLASHOVERLAP_DEBUG=1). The GEMM did not signal every tile of that group: "
            "a plan that does not match the kernel, or a kernel that failed."
        )
