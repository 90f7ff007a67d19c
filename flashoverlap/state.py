"""What flashoverlap keeps from call to call, and for how long.

The calls of one process group build up state the next calls reuse: what each kind of call runs
(its decision, and the runner a repeat of it takes without deciding again), first-use trials,
agreements checked across the ranks, where every rank runs (host, GPU), lines logged, the private
NCCL communicators an overlapped call runs on and their C-API handles, symmetric windows, and the
ranks' mapped memory for pulls.
All of it lives in the group's :class:`GroupState`, made on the group's first call (:func:`of`).
Plans (per device, shape and config, with the native replays of their calls) are kept for every
group alike (:data:`plans`), the most recently used.

Much of a group's state holds the group (communicators made from it, replays recorded on them),
so it does not go with the group's last reference: it goes with :func:`release` (before
``destroy_process_group(group)`` in a process that goes on), on its own once c10d has destroyed
the group and another group's state is made, and for every group at exit, while the interpreter
is whole: a gloo group still alive when the interpreter finalizes can abort the process as its
threads go (about one exit in 50 of a two-rank CPU test did).
"""

from __future__ import annotations

import atexit
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import torch.distributed as dist

MAX_PLANS = 64  # plans kept: a stream of new shapes keeps memory flat
MAX_DECISIONS = MAX_PLANS  # (each decision holds its plan: no more decisions than plans)
MAX_CALL_KINDS = 1024  # trials, agreements and logged lines kept per group


class Recent(OrderedDict):
    """A mapping bounded to its ``limit`` most recently used entries."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def recent(self, key: Hashable) -> Any:
        """The entry for ``key``, marked most recently used; None where absent."""
        if key not in self:
            return None
        self.move_to_end(key)
        return self[key]

    def keep(self, key: Hashable, value: Any) -> None:
        """Store ``value``, dropping the least recently used entries beyond the limit."""
        self[key] = value
        while len(self) > self.limit:
            self.popitem(last=False)


class GroupState:
    """What the calls of one process group keep (see the module doc)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.decisions = Recent(MAX_DECISIONS)  # call -> decision.Decision
        # a call's cheap key -> (what it runs, its exchange), read without reordering (every call
        # reads it): the first entries made go first when full
        self.runners = Recent(MAX_DECISIONS)
        self.trials = Recent(MAX_CALL_KINDS)  # decision.trial's answers
        self.agreed = Recent(MAX_CALL_KINDS)  # calls whose ranks agreed (decision.check_agreement)
        self.said = Recent(MAX_CALL_KINDS)  # what FLASHOVERLAP_LOG=1 reported
        self.communicators: dict[Hashable, dist.ProcessGroup] = {}  # private NCCL groups over its ranks
        self.direct: dict[tuple, Any] = {}  # (communicator, device) -> comm.nccl.Direct
        self.peers: dict[int, Any] = {}  # device index -> comm.peer.Peers
        self.ranks: dict[int, tuple] = {}  # device index -> every rank's comm.peer.Rank (host, GPU)
        self.windows: dict[tuple, Any] = {}  # (budget, tail) process groups -> comm.nccl.Window

    def own(self, key: Hashable, communicator: dist.ProcessGroup) -> dist.ProcessGroup:
        """Keep ``communicator``, made over this group's ranks, under ``key``; it goes with this state."""
        self.communicators[key] = communicator
        _owners[communicator] = self
        return communicator


_states: dict[dist.ProcessGroup, GroupState] = {}
_owners: dict[dist.ProcessGroup, GroupState] = {}  # private communicator -> the state that made it
plans = Recent(MAX_PLANS)  # prepared.prepare's plans, by device, shape and config


def of(group: dist.ProcessGroup | None) -> GroupState:
    """``group``'s state (None: the default group's), made on first use."""
    pg = group if group is not None else dist.group.WORLD
    found = _states.get(pg)
    if found is None:
        for gone in [g for g in _states if _destroyed(g)]:
            release(gone)
        found = _states[pg] = GroupState(pg)
    return found


def all_states() -> list[GroupState]:
    """Every group's state (a copy: another thread may read it, the watchdog's)."""
    return list(_states.values())


def kept(group: dist.ProcessGroup | None) -> GroupState | None:
    """``group``'s state where it has one (None: the default group's), else None; makes none."""
    return _states.get(group if group is not None else dist.group.WORLD)


def made(communicator: object) -> GroupState | None:
    """The state that made ``communicator`` (:meth:`GroupState.own`), None for any other."""
    return _owners.get(communicator)


def owner(group: dist.ProcessGroup) -> GroupState:
    """The state ``group`` belongs to: the one that made it, else its own."""
    return made(group) or of(group)


def release(group: dist.ProcessGroup) -> None:
    """Drop what ``group``'s calls keep, and the plans (their replays may hold its communicators)."""
    state = _states.pop(group, None)
    if state is None:
        return
    for communicator in state.communicators.values():
        _owners.pop(communicator, None)
    plans.clear()


@atexit.register  # (after torch's own handlers are registered: it runs before them)
def release_all() -> None:
    """Drop what every group's calls keep, and the plans."""
    _states.clear()
    _owners.clear()
    plans.clear()


def forget_decisions() -> None:
    """Make every call decide afresh (what a decision rests on changed: registry.reload)."""
    for state in _states.values():
        state.decisions.clear()
        state.runners.clear()


def _destroyed(group: dist.ProcessGroup) -> bool:
    """Whether c10d has destroyed ``group`` (it knows it no more)."""
    if not dist.is_initialized():
        return True
    try:
        dist.get_backend(group)
    except (ValueError, RuntimeError):
        return True
    return False
