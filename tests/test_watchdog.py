import ctypes
import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from flashoverlap import comm, decision, state, watchdog

from .helpers import bf16


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Event:
    """A CUDA event stand-in: complete once ``done``."""

    def __init__(self, done: bool = False, device: int = 0) -> None:
        self.done, self.device = done, torch.device("cuda", device)

    def query(self) -> bool:
        return self.done


def call(clock: Clock, event: Event, path: str = "NCCL's C API", group=None) -> watchdog.Call:
    return watchdog.Call(clock(), event, "all_reduce", (4096, 8192, 8192), path, group)


@pytest.fixture
def no_communicators(monkeypatch):
    monkeypatch.setattr(state, "all_states", lambda: [])


def test_completed_calls_are_retired_and_their_events_reused(no_communicators):
    clock = Clock()
    dog = watchdog.Watchdog(5.0, clock)
    first, second, third = Event(True), Event(True, device=1), Event()
    dog.pending.extend(call(clock, e) for e in (first, second, third))
    clock.now += 1
    assert dog.poll() is None
    assert [c.event for c in dog.pending] == [third]
    assert dog.free == {0: [first], 1: [second]}


def test_a_call_pending_past_the_timeout_is_named(no_communicators):
    clock = Clock()
    dog = watchdog.Watchdog(5.0, clock)
    dog.pending.append(call(clock, Event(), path="pulls"))
    dog.pending.append(call(clock, Event()))
    clock.now += 4.9
    assert dog.poll() is None
    clock.now += 0.2
    message = dog.poll()
    assert message is not None
    for part in ("all_reduce call (4096x8192x8192, pulls", "limit 5 s, FLASHOVERLAP_TIMEOUT_S", "2 call(s) pending"):
        assert part in message
    assert "the other ranks' group counters" in message


def test_the_clock_of_a_queued_call_starts_when_the_one_before_completes(no_communicators):
    """A host running ahead queues calls behind a busy GPU: each has ``timeout`` from the moment the
    call before it completed, not from when it was issued."""
    clock = Clock()
    dog = watchdog.Watchdog(5.0, clock)
    slow, queued = Event(), Event()
    dog.pending.extend([call(clock, slow), call(clock, queued)])
    clock.now += 4.0
    slow.done = True
    assert dog.poll() is None
    clock.now += 4.0  # 8 s after it was issued, 4 since the one before completed
    assert dog.poll() is None
    clock.now += 1.5
    assert "has not completed 6 s after" in dog.poll()  # (5.5 s, rounded)


def test_without_flashoverlap_timeout_s_the_call_s_group_timeout_applies(no_communicators, monkeypatch):
    clock = Clock()
    dog = watchdog.Watchdog(None, clock)
    group = comm.Direct.__new__(comm.Direct)  # (no communicator made: only its process group read)
    group.group = "a process group"
    monkeypatch.setattr(watchdog, "group_timeout", lambda pg: {"a process group": 30.0}[pg])
    dog.pending.append(call(clock, Event(), group=group))
    clock.now += 29
    assert dog.poll() is None
    clock.now += 2
    assert "limit 30 s, the process group's timeout" in dog.poll()


def test_the_watchdog_is_off_with_flashoverlap_watchdog_0(monkeypatch):
    monkeypatch.setattr(watchdog, "_watchdog", None)
    monkeypatch.setenv("FLASHOVERLAP_WATCHDOG", "0")
    assert watchdog.get() is None
    watchdog.track(None, "all_reduce", (1, 1, 1), "c10d", None)  # (nothing to do: no CUDA touched)
    monkeypatch.setenv("FLASHOVERLAP_WATCHDOG", "1")
    monkeypatch.setenv("FLASHOVERLAP_TIMEOUT_S", "3")
    assert watchdog.get().timeout == 3.0


class Lib:
    """NCCL's functions the watchdog asks, on fake communicators (an int: the async error to report)."""

    def ncclCommGetAsyncError(self, comm, result):
        ctypes.cast(result, ctypes.POINTER(ctypes.c_int)).contents.value = comm
        return 0

    def ncclGetErrorString(self, code):
        return b"remote process exited or there was a network error"


def test_an_nccl_error_on_a_communicator_it_made_is_reported_at_once(monkeypatch, tmp_path):
    errors = {"ok": 0, "in progress": 7, "remote": 6}
    direct = {name: SimpleNamespace(lib=Lib(), comm=code, group=None) for name, code in errors.items()}
    group_state = SimpleNamespace(direct={"ok": direct["ok"], "busy": direct["in progress"]})
    monkeypatch.setattr(state, "all_states", lambda: [group_state])
    dog = watchdog.Watchdog(600.0, Clock())
    assert dog.poll() is None
    group_state.direct["remote"] = direct["remote"]
    message = dog.poll()
    assert "NCCL reports an error" in message and "remote process exited" in message and "(6)" in message


def test_firing_logs_aborts_the_communicators_and_ends_the_process(monkeypatch, caplog):
    aborted, ended, alarms = [], [], []
    communicators = {"budget": SimpleNamespace(abort=lambda: aborted.append("budget"))}

    def broken():
        raise RuntimeError("already aborted")

    communicators["tail"] = SimpleNamespace(abort=broken)
    communicators["other"] = SimpleNamespace(abort=lambda: aborted.append("other"))
    monkeypatch.setattr(state, "all_states", lambda: [SimpleNamespace(communicators=communicators)])
    monkeypatch.setattr(watchdog.os, "abort", lambda: ended.append(True))
    monkeypatch.setattr(watchdog.signal, "alarm", alarms.append)
    dog = watchdog.Watchdog(5.0, Clock())
    with caplog.at_level(logging.ERROR, logger="flashoverlap"):
        dog.fire("a call never completed")
    assert "flashoverlap watchdog: a call never completed" in caplog.text
    assert aborted == ["budget", "other"] and ended == [True] and alarms and dog.fired


def test_the_thread_fires_within_a_poll_of_the_timeout(monkeypatch, no_communicators):
    fired = threading.Event()
    dog = watchdog.Watchdog(0.2)
    monkeypatch.setattr(dog, "fire", lambda message: (setattr(dog, "fired", True), fired.set()))
    monkeypatch.setattr(watchdog, "relax_capture_mode", lambda: None)
    dog.pending.append(watchdog.Call(dog.clock(), Event(), "reduce_scatter", (8, 8, 8), "c10d", None))
    dog._start()
    assert fired.wait(5.0)
    dog.thread.join(5.0)
    assert not dog.thread.is_alive()


def test_the_aborts_run_inside_one_nccl_group(monkeypatch):
    """Aborted one by one, a communicator's abort can wait on another's hung kernel: NCCL's group
    semantics abort them together."""
    said = []
    backend = SimpleNamespace(_group_start=lambda: said.append("start"), _group_end=lambda: said.append("end"))

    def communicator(name):
        return SimpleNamespace(_get_backend=lambda device: backend, abort=lambda: said.append(name))

    communicators = {"budget": communicator("budget"), "tail": communicator("tail")}
    monkeypatch.setattr(state, "all_states", lambda: [SimpleNamespace(communicators=communicators)])
    watchdog.abort_communicators()
    assert said == ["start", "budget", "tail", "end"]


def test_a_poll_that_fails_is_said_not_swallowed(monkeypatch, caplog):
    """An exception would end the daemon thread silently: it is logged, with what it costs."""
    dog = watchdog.Watchdog(0.1)
    monkeypatch.setattr(watchdog, "relax_capture_mode", lambda: None)

    def broken():
        raise RuntimeError("driver gone")

    monkeypatch.setattr(dog, "poll", broken)
    with caplog.at_level(logging.WARNING, logger="flashoverlap"):
        dog._start()
        dog.thread.join(5.0)
    assert not dog.thread.is_alive()
    assert "polling failed (driver gone); hung calls are no longer detected" in caplog.text


@pytest.mark.parametrize("name, value", [("FLASHOVERLAP_TIMEOUT_S", "soon"), ("FLASHOVERLAP_WATCHDOG", "off")])
def test_bad_watchdog_settings_are_refused_before_an_overlapped_call_runs(
    one_rank_group, monkeypatch, fresh_state, name, value
):
    """Read where a call is decided overlapped, not at its end (once its work is enqueued)."""
    from .test_faults import decides_on, ranks_on

    monkeypatch.setattr(watchdog, "_watchdog", None)
    decides_on(monkeypatch, ranks_on("a", "a"), (4096, 8192, 64), [])
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        decision.decide(bf16(4096, 64), bf16(8192, 64), "all_reduce", config={"comm_sms": 8})
    monkeypatch.delenv(name)
    assert decision.decide(bf16(4096, 64), bf16(8192, 64), "all_reduce", config={"comm_sms": 8}).prep is not None
    assert watchdog._watchdog is not None
