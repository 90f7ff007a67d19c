"""Stream-side waits on the GEMM's group counters.

``cuStreamWaitValue32`` (GEQ) makes the communication stream wait in the GPU's front end,
costing no SM. Where stream memory operations are unsupported, a one-thread spin kernel does
the same job. ``FLASHOVERLAP_WAIT=stream|spin`` forces one (default: probe, prefer stream).
Counters are reset on the stream (:func:`reset`), so a call can be captured in a CUDA graph (with
stream waits where the driver captures them, checked once; else spin kernels).

Debug mode (``FLASHOVERLAP_DEBUG=1``): every wait is a spin kernel that gives up after
``FLASHOVERLAP_TIMEOUT_S`` seconds (default 10) and records which group it waited for and the
counter value it saw; the call then synchronises and raises instead of hanging.
"""

from __future__ import annotations

import os

import torch

from .. import enqueue, jit

WAIT_MODES = ("auto", "stream", "spin")


def _wait_mode() -> str:
    mode = os.environ.get("FLASHOVERLAP_WAIT", "auto")
    if mode not in WAIT_MODES:
        raise ValueError(f"FLASHOVERLAP_WAIT must be one of {WAIT_MODES}, got {mode!r}")
    return mode


def _stream_wait(stream: torch.cuda.Stream, address: int, value: int) -> int:
    """cuStreamWaitValue32 (GEQ) through the runtime library; non-zero where it failed."""
    return jit.runtime_library().fo_stream_wait(address, value, stream.cuda_stream)


_support: dict[int, tuple[bool, bool]] = {}  # device -> stream waits work (eagerly, in CUDA graphs)


def stream_waits(device: int, capturing: bool) -> bool:
    """Whether a wait enqueued now on ``device`` is a stream wait (else the spin kernel): where
    stream memory operations work, and, while a CUDA graph is captured, where a captured one was
    seen to replay. Probed on the first call outside a capture (a probe inside one would break it;
    waits spin until then)."""
    if device not in _support:
        if capturing:
            return False
        _support[device] = _probe(device)
    return _support[device][capturing]


def forget_probes() -> None:
    """Probe again on next use (after ``FLASHOVERLAP_WAIT`` changed)."""
    _support.clear()


def _probe(device: int) -> tuple[bool, bool]:
    mode = _wait_mode()
    if mode != "auto":
        return mode == "stream", mode == "stream"
    probe = torch.zeros(1, dtype=torch.int32, device=device)
    stream = torch.cuda.Stream(device=device)
    if _stream_wait(stream, probe.data_ptr(), 0) != 0:  # 0 >= 0: passes at once
        return False, False
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:  # the same wait captured (in this thread only: other threads' CUDA calls go on) and replayed
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                captured = _stream_wait(stream, probe.data_ptr(), 0) == 0
            finally:
                graph.capture_end()
            graph.replay()
        stream.synchronize()
    except RuntimeError:
        return True, False
    return True, captured


def env_timeout() -> float | None:
    """``FLASHOVERLAP_TIMEOUT_S`` in seconds (a debug-mode wait's limit, the watchdog's), None where
    unset."""
    text = os.environ.get("FLASHOVERLAP_TIMEOUT_S")
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"FLASHOVERLAP_TIMEOUT_S must be a positive number of seconds, got {text!r}")
    return seconds


def debug_timeout() -> float | None:
    """Seconds a wait may take in debug mode (``FLASHOVERLAP_DEBUG=1``; ``FLASHOVERLAP_TIMEOUT_S``,
    default 10); None outside it."""
    if os.environ.get("FLASHOVERLAP_DEBUG") != "1":
        return None
    seconds = env_timeout()
    return 10.0 if seconds is None else seconds


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
    wait_at(stream, counters.data_ptr() + 4 * index, target, timeout, report, index)


def wait_at(
    stream: torch.cuda.Stream,
    address: int,
    target: int,
    timeout: float | None = None,
    report: torch.Tensor | None = None,
    index: int = 0,
) -> None:
    """Enqueue on ``stream``: wait until the uint32 at device ``address`` is ``>= target`` (cyclic);
    :func:`wait_geq`'s wait, also for flags outside a counter tensor (comm.peer's)."""
    # The spin kernel (one thread) without a time limit where stream waits do not work. It fits
    # beside the GEMM's CTAs (one H200, every SM to the GEMM: group 0 released at 0.119 ms by both),
    # but holds a thread polling memory for the whole wait: stream waits in CUDA graphs too.
    if timeout is None and not stream_waits(stream.device.index, torch.cuda.is_current_stream_capturing()):
        timeout = 0.0
    if timeout is None:
        enqueue.runtime_call("fo_stream_wait", address, target, stream.cuda_stream)
        return
    where = None if report is None else report.data_ptr()
    enqueue.runtime_call("fo_spin_wait", address, target, int(timeout * 1e9), where, index, stream.cuda_stream)


def reset(counters: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Enqueue on ``stream``: zero ``counters`` for the next call (a memset: cheaper to enqueue
    than a fill kernel)."""
    nbytes = counters.numel() * counters.element_size()
    enqueue.runtime_call("fo_zero", counters.data_ptr(), nbytes, stream.cuda_stream)


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
