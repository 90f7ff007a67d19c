"""flashoverlap's own streams beside the caller's, and the waits between streams.

An overlapped call runs its collectives on a stream of its own ("comm") and each group's step
after its collective on another ("finish"); the caller's stream waits for both before the call
returns (:func:`join`). Both are kept per device, as the events of each pair of streams.
"""

from __future__ import annotations

import torch

from . import enqueue

SIDE_ROLES = ("comm", "finish")  # the roles whose streams every plan's tables are used on (prepare records them)
_side_streams: dict[tuple[int, str], torch.cuda.Stream] = {}


def side_stream(device: torch.device, role: str = "comm") -> torch.cuda.Stream:
    """flashoverlap's own stream on ``device`` for ``role``: "comm" (the waits and collectives),
    "finish" (each group's own step after its collective, comm.finish_group: apart, so that one
    waiting for SMs the GEMM holds never holds up the next group's collective), "sums" (a
    ``pull_scatter``'s copies of the other ranks' sums, comm.gather_group), or a pull's lane
    (:func:`lanes`)."""
    key = (device.index, role)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(device=device)
    return _side_streams[key]


def lanes(device: torch.device, count: int) -> tuple[torch.cuda.Stream, ...]:
    """``count`` streams of flashoverlap's own on ``device``, one per other rank a pull copies from
    (comm.peer.Peers.lanes): each copy waits for its own rank's counter only, so a rank late with a
    group holds up none of the others' copies. (The copy engine still runs the copies one by one.)"""
    return tuple(side_stream(device, f"pull lane {j}") for j in range(count))


_join_events: dict[tuple[int, int, int], torch.cuda.Event] = {}


def join(waiter: torch.cuda.Stream, waitee: torch.cuda.Stream, device: torch.device) -> None:
    """``waiter.wait_stream(waitee)`` with one event per stream pair, kept (a fresh event per wait
    costs its creation and destruction on every call)."""
    key = (device.index, waiter.cuda_stream, waitee.cuda_stream)
    event = _join_events.get(key)
    if event is None:
        event = _join_events[key] = torch.cuda.Event()
    enqueue.record(event, waitee)
    enqueue.wait(waiter, event)
