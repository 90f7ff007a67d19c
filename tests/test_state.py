"""What flashoverlap keeps per process group, and that it lets go of the groups (gloo)."""

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from flashoverlap import comm, decision, state
from flashoverlap.plan import make_plan
from flashoverlap.prepared import Prepared


@pytest.fixture(autouse=True)
def _fresh(fresh_state):
    """Every test here starts without the group states of the others."""


def agree_on(group: dist.ProcessGroup) -> None:
    """A call's agreement checked on ``group``: its state made, holding the group."""
    plan = make_plan(256, 256, tile_m=128, tile_n=256, cluster_m=1, ctas=2)
    prep = Prepared(plan, SimpleNamespace(spec="spec"), None, torch.zeros(1), *(None,) * 4)
    decision.check_agreement(prep, "all_reduce", group, comm.exchange("all_reduce", 256, 1), ("all_reduce", 256))


def released(make_state, drop) -> bool:
    """Whether a destroyed group whose state ``make_state(group)`` made is freed once ``drop()`` ran
    (and not before)."""
    group = dist.new_group([0])
    make_state(group)
    held = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    assert held() is not None  # its state keeps it
    drop()
    gc.collect()
    return held() is None


def test_no_process_group_is_kept_past_exit(one_rank_group):
    """The exit hook (state.release_all) lets go of every group the calls' state holds: one alive as
    the interpreter finalizes aborted two-rank test processes now and then (~1 exit in 50)."""
    assert released(agree_on, state.release_all)


def test_a_group_s_state_goes_with_release_and_with_the_plans(one_rank_group):
    state.plans.keep("a plan", object())
    groups = []
    assert released(lambda g: groups.append(g) or agree_on(g), lambda: state.release(groups.pop()))
    assert not state.plans  # (their replays may have held its communicators)


def test_a_destroyed_group_s_state_goes_when_another_group_s_is_made(one_rank_group):
    assert released(agree_on, lambda: state.of(None))


def test_communicators_made_over_a_group_s_ranks_belong_to_its_state(one_rank_group):
    """What comm makes over a group's ranks (budget and tail communicators) is found from the
    communicator itself (comm.direct, the windows: state.owner) and goes with the group's state."""
    group, made = dist.new_group([0]), dist.new_group([0])
    mine = state.of(group)
    assert mine.own("tail", made) is made and mine.communicators == {"tail": made}
    assert state.made(made) is mine and state.owner(made) is mine and state.owner(group) is mine
    assert state.made(group) is None  # (a group of the user's: c10d runs collectives on it too)
    state.release(group)
    assert state.made(made) is None and state.kept(group) is None
    for g in (made, group):
        dist.destroy_process_group(g)


def test_recent_keeps_the_most_recently_used():
    kept = state.Recent(2)
    kept.keep("a", 1)
    kept.keep("b", 2)
    assert kept.recent("a") == 1 and kept.recent("c") is None
    kept.keep("c", 3)  # "b" was used least recently
    assert list(kept) == ["a", "c"]
