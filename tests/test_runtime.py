"""How a call runs: the plain path, and what a native replay may record (CPU)."""

import pytest
import torch

from flashoverlap import comm, runtime

from .helpers import bf16


def test_a_call_is_recorded_for_replay_only_where_its_tensors_do_not_overlap():
    assert runtime._disjoint([(0x1000, 0x100), (0x1100, 0x10), (0x2000, 8)])
    assert not runtime._disjoint([(0x1000, 0x100), (0x10F0, 0x10)])  # (a view into another operand)
    assert not runtime._disjoint([(0x1000, 0x100), (0x1000, 0x100)])  # (a and weight one tensor)
    assert not runtime._disjoint([(0, 0), (0, 0)])  # two empty tensors share address 0


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_the_plain_runner_is_the_matmul_and_nothing_else_on_one_rank(layout):
    """A call decided plain runs the product alone on one rank (the collective of one rank is the
    identity), a @ W.T for "nk" as one operator: the same numbers as the matmul."""
    a, w = bf16(33, 64), bf16(48, 64)
    weight = w if layout == "nk" else w.t().contiguous()
    ex = comm.exchange("all_reduce", 33, 1)
    run = runtime.plain(ex, None, layout, 1)
    assert torch.equal(run(a, weight), a @ w.t())


def test_the_plain_runner_runs_the_collective_on_the_product(monkeypatch):
    ran = []
    monkeypatch.setattr(comm, "collective", lambda ex, out, group: ran.append((ex, out.shape, group)) or out)
    ex = comm.exchange("all_reduce", 16, 2)
    out = runtime.plain(ex, "group", "nk", 2)(bf16(16, 32), bf16(8, 32))
    assert ran == [(ex, (16, 8), "group")] and out.shape == (16, 8)
