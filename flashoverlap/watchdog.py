"""A watchdog for flashoverlap's own GPU work: a call that never completes ends the process with a
message, as torch's NCCL watchdog does for its collectives, instead of hanging it.

torch.distributed watches the collectives it issues (``TORCH_NCCL_ASYNC_ERROR_HANDLING``): one
that has not completed within the process group's timeout aborts its communicators and ends the
process. An overlapped call's work is invisible to it: collectives through NCCL's C API on private
communicators, stream waits on counters (this rank's or, for pulls, another rank's), copies out of
peer memory. Where another rank died or stopped calling, that work waits forever, and so does
anything that synchronises with it.

So every overlapped call (eager or replayed natively; not inside a CUDA graph capture, whose replays
the graph's owner synchronises) records an event on the caller's stream at its end, and a daemon
thread polls the oldest pending events, a few times per timeout. One that has not completed
``timeout`` seconds after its call was issued -- ``FLASHOVERLAP_TIMEOUT_S`` where set, else the call's
process-group timeout, as for torch's own collectives -- makes the thread log what the call was and
what it waited for, abort the NCCL communicators flashoverlap made, and end the process with
SIGABRT (torch's watchdog does the same). An error NCCL reports on one of those communicators
(``ncclCommGetAsyncError``: a peer vanished, a network failure) ends it at once, the same way.
The cost per call is one event record and a deque append (no host synchronisation);
``FLASHOVERLAP_WATCHDOG=0`` turns it off.

A process cannot raise into a main thread blocked in a CUDA synchronisation, and its streams stay
blocked after any error, so ending the process is the only clean outcome (a launcher such as
torchrun then ends the other ranks).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import comm, jit, state
from .comm import group_timeout
from .signal import env_timeout

log = logging.getLogger(__name__)

POLLS_PER_TIMEOUT = 4  # how often the oldest call is looked at, per timeout
MAX_POLL_S = 2.0  # ... and at least this often (async NCCL errors end the process this soon)
ABORT_WAIT_S = 5.0  # how long the communicators' abort may take before the process ends anyway


class Call(NamedTuple):
    """What a pending call was, for the message (formatted only where it fires)."""

    issued: float  # time.monotonic() when enqueued
    event: torch.cuda.Event
    collective: str
    shape: tuple[int, int, int]
    path: str  # how its groups move: "NCCL's C API", "c10d", "pulls", ...
    group: Any  # the process group (or comm.Direct / comm.Peers) the call ran on


def enabled() -> bool:
    """``FLASHOVERLAP_WATCHDOG`` (1, the default, or 0), checked."""
    value = os.environ.get("FLASHOVERLAP_WATCHDOG", "1")
    if value not in ("0", "1"):
        raise ValueError(f"FLASHOVERLAP_WATCHDOG must be 1 (on) or 0 (off), got {value!r}")
    return value == "1"


class Watchdog:
    """The pending calls of this process and the thread that watches them."""

    def __init__(self, timeout: float | None, clock=time.monotonic) -> None:
        self.timeout = timeout  # None: each call's group's
        self.clock = clock
        self.pending: deque[Call] = deque()  # appended by callers, popped by the thread
        self.free: dict[int, list[torch.cuda.Event]] = {}  # device -> completed events to reuse
        self.timeouts: dict[int, float] = {}  # id(group) -> seconds (the thread's cache)
        self.progress = clock()  # when a call was last seen completed
        self.pid = os.getpid()
        self.thread: threading.Thread | None = None
        self.fired = False

    def track(self, stream: torch.cuda.Stream, collective: str, shape, path: str, group) -> None:
        """Watch the work enqueued on ``stream`` so far (a call's end)."""
        free = self.free.get(stream.device_index)
        event = free.pop() if free else torch.cuda.Event()
        event.record(stream)
        self.pending.append(Call(self.clock(), event, collective, shape, path, group))
        if self.thread is None or self.pid != os.getpid():  # (a forked child has no thread)
            self._start()

    def _start(self) -> None:
        self.pid = os.getpid()
        self.thread = threading.Thread(target=self._run, name="flashoverlap-watchdog", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # A thread that dies on an exception dies silently: say so, once, and what is lost
        try:
            relax_capture_mode()
        except Exception as exc:
            log.warning("flashoverlap watchdog: its polls may break a global-mode CUDA graph capture (%s)", exc)
        while not self.fired:
            time.sleep(self.poll_interval())
            try:
                overdue = self.poll()
            except Exception as exc:
                log.warning("flashoverlap watchdog: polling failed (%s); hung calls are no longer detected", exc)
                return
            if overdue is not None:
                self.fire(overdue)

    def poll_interval(self) -> float:
        return min(MAX_POLL_S, (self.timeout or MAX_POLL_S * POLLS_PER_TIMEOUT) / POLLS_PER_TIMEOUT)

    def poll(self) -> str | None:
        """Retire the completed calls (oldest first: a stream completes in order, and calls from other
        streams wait behind one pending call at most one timeout); the message of one overdue, or of an
        NCCL error on a communicator flashoverlap made, else None. A call is overdue once ``timeout``
        has passed since it was issued and since the call before it completed: a host running far
        ahead of a busy GPU queues calls whose wait is long but moving."""
        pending = self.pending
        while pending and pending[0].event.query():
            call = pending.popleft()
            self.free.setdefault(call.event.device.index, []).append(call.event)
            self.progress = self.clock()
        error = nccl_error()
        if error is not None:
            return error
        if not pending:
            return None
        oldest = pending[0]
        age = self.clock() - max(oldest.issued, self.progress)
        limit = self.timeout if self.timeout is not None else self._group_timeout(oldest.group)
        if age <= limit:
            return None
        return overdue_message(oldest, age, limit, self.timeout is not None, len(pending))

    def _group_timeout(self, group) -> float:
        key = id(group)
        if key not in self.timeouts:
            self.timeouts[key] = group_timeout(comm.process_group(group))
        return self.timeouts[key]

    def fire(self, message: str) -> None:
        """Say ``message``, abort the communicators, end the process."""
        self.fired = True
        log.error("flashoverlap watchdog: %s", message)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        # an abort that blocks (holding the interpreter) must not keep the process alive: SIGALRM's
        # default action ends it
        signal.alarm(int(ABORT_WAIT_S) + 1)
        aborting = threading.Thread(target=abort_communicators, daemon=True)
        aborting.start()
        aborting.join(ABORT_WAIT_S)
        os.abort()


def relax_capture_mode() -> None:
    """Let this thread query events while another captures a CUDA graph in the global mode (an
    event query there would otherwise invalidate the capture)."""
    jit.check(jit.runtime_library(), jit.runtime_library().fo_relaxed_capture_mode(), "fo_runtime_error")


def overdue_message(call: Call, age: float, limit: float, from_env: bool, pending: int) -> str:
    m, n, k = call.shape
    ranks = _ranks(comm.process_group(call.group))
    where = "FLASHOVERLAP_TIMEOUT_S" if from_env else "the process group's timeout"
    return (
        f"a {call.collective} call ({m}x{n}x{k}, {call.path}, ranks {ranks}) has not completed "
        f"{age:.0f} s after it was issued (limit {limit:g} s, {where}); {pending} call(s) pending. "
        f"It waits for {waits_for(call.path)}: another rank died, stopped calling, or called something "
        "else. Aborting flashoverlap's NCCL communicators and ending the process."
    )


def waits_for(path: str) -> str:
    if path == "pulls":
        return "the other ranks' group counters and flags in their memory (pulls)"
    return f"its tile groups' NCCL collectives ({path})"


def nccl_error() -> str | None:
    """An asynchronous error NCCL reports on a communicator flashoverlap made, else None."""
    for group_state in state.all_states():
        for direct in list(group_state.direct.values()):
            code = _async_error(direct)
            if code is not None:
                name = direct.lib.ncclGetErrorString(code).decode()
                return f"NCCL reports an error on a communicator of ranks {_ranks(direct.group)}: {name} ({code})"
    return None


_IN_PROGRESS = 7  # ncclInProgress: a non-blocking communicator still initialising, not an error


def _async_error(direct) -> int | None:
    result = ctypes.c_int(0)
    if direct.lib.ncclCommGetAsyncError(direct.comm, ctypes.byref(result)) != 0:
        return None  # (a communicator already destroyed: nothing to say)
    return result.value if result.value not in (0, _IN_PROGRESS) else None


def _ranks(group: dist.ProcessGroup) -> object:
    """``group``'s global ranks, for a message that must not fail."""
    try:
        return dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError, KeyError, AttributeError):
        return "unknown"


def abort_communicators() -> None:
    """Abort every NCCL communicator flashoverlap made (their kernels stop waiting for peers), as
    torch's watchdog aborts its own before it ends the process: together, inside one NCCL group,
    since one abort's device synchronisation could otherwise wait on another's hung kernel."""
    communicators = [c for group_state in state.all_states() for c in group_state.communicators.values()]
    backend = _nccl_backend(communicators)
    if backend is not None:
        backend._group_start()
    for communicator in communicators:
        try:
            communicator.abort()
        except Exception as exc:  # (already aborted or destroyed: the others still go)
            log.debug("abort of a communicator failed: %s", exc)
    if backend is not None:
        backend._group_end()


def _nccl_backend(communicators: list) -> object | None:
    """An NCCL backend among ``communicators`` whose group calls frame the aborts, None if none."""
    for communicator in communicators:
        try:
            backend = communicator._get_backend(torch.device("cuda"))
        except (AttributeError, RuntimeError):
            continue
        if hasattr(backend, "_group_start") and hasattr(backend, "_group_end"):
            return backend
    return None


_watchdog: Watchdog | None = None
_lock = threading.Lock()


def get() -> Watchdog | None:
    """This process's watchdog (made on first use, its settings checked: decision asks for it before
    a call that it would watch runs), None where ``FLASHOVERLAP_WATCHDOG=0``."""
    global _watchdog
    if _watchdog is None and enabled():
        with _lock:
            if _watchdog is None:
                _watchdog = Watchdog(env_timeout())
    return _watchdog


def track(stream: torch.cuda.Stream, collective: str, shape, path: str, group) -> None:
    """Watch an overlapped call whose work ends on ``stream`` (see the module doc); ``path`` names how
    its groups move, ``group`` the communicator (or comm.Peers) it ran on."""
    watchdog = _watchdog or get()
    if watchdog is not None:
        watchdog.track(stream, collective, shape, path, group)
