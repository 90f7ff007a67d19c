"""comm on the CPU (gloo): plan agreement across ranks, exchange validation."""

import contextlib
import datetime
import os
import tempfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashoverlap import comm
from flashoverlap.comm import agree, exchange, rows_rotation


def worker(rank: int, world: int, store_path: str):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        agree(None, "all_reduce 128x256 partition=(1, 1)", torch.device("cpu"))  # same everywhere: passes
        expected = r"ranks planned different calls \(ranks grouped by plan: \[\[0, 2\], \[1\]\]"
        with pytest.raises(RuntimeError, match=expected):
            agree(None, f"all_reduce 128x256 partition={(1, 1) if rank != 1 else (2,)}", torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def test_mismatched_plans_fail_on_every_rank():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(3, os.path.join(tmp, "store")), nprocs=3, join=True)


def test_exchange_describes_rows_sent_and_received():
    assert exchange("all_reduce", 10, 2).rows == 10
    rs = exchange("reduce_scatter", 12, 3)
    assert rs.rows == 4 and rs.send == rs.recv == (4, 4, 4)
    even = exchange("all_to_all", 12, 3)
    assert even.rows == 12 and even.send == (4, 4, 4)
    local = exchange("all_reduce", 10, 3, reduction="local")  # every rank's partial sums arrive
    assert local.rows == 10 and local.send == (10,) and local.recv == (10, 10, 10)
    assert rs.even and even.even and local.even
    uneven = exchange("all_to_all", 10, 3, splits=[0, 7, 3], output_splits=[5, 0, 2])
    assert not uneven.even
    assert uneven.send == (0, 7, 3) and uneven.recv == (5, 0, 2) and uneven.rows == 7


# every rank's splits per case: the same M and even everywhere; even on rank 0 only (its sends and
# receives are, the others' are not); different M per rank, one rank with none
EXCHANGED = {
    "uniform": [[2, 2, 2]] * 3,
    "even_here_only": [[2, 2, 2], [2, 4, 0], [2, 0, 4]],
    "ragged": [[1, 2, 3], [0, 0, 0], [4, 4, 4]],
}


@contextlib.contextmanager
def no_collectives():
    """Fail on any all-gather (what an exchange of counts would run)."""
    from flashoverlap import comm

    def refuse(*args, **kwargs):
        raise AssertionError("counts exchanged")

    real, comm.all_gather_single = comm.all_gather_single, refuse
    try:
        yield
    finally:
        comm.all_gather_single = real


def exchange_worker(rank: int, world: int, store_path: str):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        for case, splits in EXCHANGED.items():
            ex = exchange("all_to_all", sum(splits[rank]), world, splits[rank], group=None, device=torch.device("cpu"))
            assert ex.send == tuple(splits[rank]) and ex.recv == tuple(row[rank] for row in splits), case
            assert ex.rows == sum(ex.recv) and ex.sources == tuple(map(sum, splits)), case
            assert ex.uniform == (case == "uniform") and ex.ragged == (case == "ragged"), case
            assert ex.even == (case == "uniform" or case == "even_here_only" and rank == 0), case
            # every rank's M given (a dispatcher knows them): the same, with nothing exchanged
            counts = (splits[rank], list(ex.recv))
            with no_collectives():
                given = exchange("all_to_all", sum(splits[rank]), world, *counts, rows_per_rank=ex.sources)
            assert (given.send, given.recv, given.rows, given.sources) == (ex.send, ex.recv, ex.rows, ex.sources)
            assert given.ragged == ex.ragged and not given.uniform, case  # the others' splits stay unknown
            with pytest.raises(ValueError, match=rf"rows_per_rank\[{rank}\] is {sum(splits[rank]) + 1}, but"):
                wrong = list(ex.sources)
                wrong[rank] += 1
                exchange("all_to_all", sum(splits[rank]), world, *counts, rows_per_rank=wrong)
    finally:
        dist.destroy_process_group()


def test_exchanged_counts_tell_every_rank_every_ranks_rows():
    """Where the counts are exchanged, what every rank must decide alike (equal splits everywhere,
    different M) rests on every rank's splits, not on this rank's view."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(exchange_worker, args=(3, os.path.join(tmp, "store")), nprocs=3, join=True)


def test_what_an_exchange_without_counts_knows_of_the_other_ranks():
    assert exchange("all_to_all", 12, 3).uniform and exchange("reduce_scatter", 12, 3).uniform
    assert exchange("all_to_all", 12, 3, output_splits=[4, 4, 4]).uniform  # every rank splits evenly
    given = exchange("all_to_all", 12, 3, splits=[4, 4, 4], output_splits=[4, 4, 4])
    assert given.even and not given.uniform  # the others' splits are not known here
    assert given.sources is None and not given.ragged
    alone = exchange("all_to_all", 12, 1, splits=[12])  # one rank: no process group needed, nothing exchanged
    assert alone.recv == (12,) and alone.uniform and not alone.ragged


def test_only_a_uniform_all_to_all_takes_the_equal_split_path(monkeypatch):
    """c10d's equal-split all-to-all (ncclAlltoAll) and its split-size one (send/receive) must
    not meet on different ranks: the choice rests on what every rank knows."""
    from flashoverlap import comm

    calls = []
    monkeypatch.setattr(dist, "all_to_all_single", lambda out, data, *sizes, group=None: calls.append(sizes))
    data = torch.zeros(12, 2)
    comm.collective(exchange("all_to_all", 12, 3), data, None)
    comm.collective(exchange("all_to_all", 12, 3, splits=[4, 4, 4], output_splits=[4, 4, 4]), data, None)
    assert calls == [(), ([4, 4, 4], [4, 4, 4])]


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (("broadcast", 8, 2), {}, "unknown collective 'broadcast'"),
        (("reduce_scatter", 10, 3), {}, "M must be a multiple of 3"),
        (("all_to_all", 10, 3), {}, "M must be a multiple of 3"),
        (("all_to_all", 10, 2), {"splits": [3, 3, 4]}, r"splits must be 2 non-negative integers"),
        (("all_to_all", 10, 2), {"splits": [11, -1]}, r"splits must be 2 non-negative integers"),
        (("all_to_all", 10, 2), {"splits": [3, 4]}, r"sum to 7 rows, but a has M=10"),
        (("all_to_all", 10, 2), {"splits": [5, 5], "output_splits": [5]}, "output_splits must be 2"),
        (("all_reduce", 10, 2), {"splits": [5, 5]}, "splits apply to all_to_all only"),
        (("reduce_scatter", 10, 2), {"rows_per_rank": [10, 10]}, "splits apply to all_to_all only"),
        (("all_to_all", 10, 2), {"splits": [5, 5], "rows_per_rank": [10, 4]}, "goes with .* splits and output_splits"),
        (("all_to_all", 10, 2), {"output_splits": [5, 5], "rows_per_rank": [10, 4]}, "goes with"),
        (
            ("all_to_all", 10, 2),
            {"splits": [5, 5], "output_splits": [5, 2], "rows_per_rank": [10]},
            "rows_per_rank must be 2",
        ),
        (("all_to_all", 10, 2), {"reduction": "local"}, "'local' / 'pull' / 'pull_scatter' for all_reduce"),
        (("reduce_scatter", 10, 2), {"reduction": "local"}, "got 'local' for reduce_scatter"),
        (("all_reduce", 10, 2), {"reduction": "tree"}, "reduction must be"),
    ],
)
def test_exchange_rejects_bad_splits(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        exchange(*args, **kwargs)


def test_rows_rotation_starts_at_the_next_ranks_segment():
    ex = exchange("reduce_scatter", 12, 3)
    assert [rows_rotation(ex, "rows", r) for r in range(3)] == [4, 8, 0]
    assert rows_rotation(ex, "cols", 1) == 0
    assert rows_rotation(exchange("all_reduce", 12, 3), "rows", 1) == 0


def test_a_fused_reduce_scatter_s_bands_are_ready_once_every_other_rank_s_copies_are():
    """ready_bands: band b of rank r's rows is ready after the group of the rank that computes it
    latest (its walk's rotation: rank r + 1, world - 2 segments into its walk) holds its last row."""
    from flashoverlap.plan import make_plan

    world, tile_m = 4, 128
    ex = exchange("reduce_scatter", 4096, world, reduction="pull_fused")
    assert [comm.own_rows(ex, 0, q) for q in range(world)] == [3072, 2048, 1024, 0]
    plan = make_plan(4096, 512, tile_m=tile_m, tile_n=256, cluster_m=1, ctas=5, layout="rows", split=world)
    walk = [b // plan.n for b in plan.bounds]
    for rank in range(world):
        bands = comm.ready_bands(ex, plan, rank, 256)
        assert sorted(b for after in bands for b in after) == list(range(1024 // 256))
        for g, after in enumerate(bands):
            for band in after:  # rank + 1 computes this rank's rows at 2048 of its walk, the latest
                last_row = 2048 + (band + 1) * 256 - 1
                assert walk[g] <= last_row < walk[g + 1]
    assert comm.ready_bands(exchange("reduce_scatter", 1024, 1, reduction="pull_fused"), plan, 0, 256) == [
        [] for _ in range(plan.num_groups)
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_partial_sums_add_up_whatever_the_world_size(world):
    """Summed in float32 in rank order, rounded once: the same bits on every rank; ``out`` may be one
    of the rows (a ``pull_scatter`` sums its share in place)."""
    from flashoverlap.comm import add_rows

    parts = torch.randn(world, 1000).to(torch.bfloat16)
    out = torch.full((1000,), float("nan"), dtype=torch.bfloat16)
    add_rows(parts, out)
    assert torch.allclose(out.float(), parts.float().sum(0), rtol=1e-2, atol=1e-2)
    want = parts[0].float()
    for part in parts[1:]:
        want = want + part.float()
    assert torch.equal(out, want.to(torch.bfloat16))
    also = torch.full_like(out, float("nan"))
    add_rows(list(parts), parts[-1], also)
    assert torch.equal(parts[-1], out) and torch.equal(also, out)


def test_where_each_layout_leaves_its_result():
    """Which calls need a step per group after the collective (comm.finish_group) and which find
    their result in the buffers' out (copied out of a symmetric window)."""
    from flashoverlap.comm import finishes, interleave, lands_in_out
    from flashoverlap.plan import make_plan
    from flashoverlap.rules import tail_apart

    def plan(layout, segments=1):
        return make_plan(1024, 256, tile_m=128, tile_n=128, cluster_m=1, ctas=4, layout=layout, interleave=segments)

    ar, local = exchange("all_reduce", 1024, 2), exchange("all_reduce", 1024, 2, reduction="local")
    pull = exchange("all_reduce", 1024, 2, reduction="pull")
    scatter = exchange("all_reduce", 1024, 4, reduction="pull_scatter")
    rs, a2a = exchange("reduce_scatter", 1024, 2), exchange("all_to_all", 1024, 2)
    rs_pull, a2a_pull = (exchange(c, 1024, 2, reduction="pull") for c in ("reduce_scatter", "all_to_all"))
    cases = {  # (exchange, layout): (finishes, lands in out)
        (ar, "rows"): (False, True),
        (ar, "tiles"): (False, False),
        (ar, "cols"): (True, False),
        (local, "rows"): (True, False),
        (local, "tiles"): (True, False),
        (pull, "rows"): (True, False),
        (scatter, "rows"): (True, False),
        (rs, "rows"): (False, True),
        (rs, "cols"): (True, False),
        (rs, "segments"): (False, True),
        (a2a, "segments"): (True, False),
        (rs_pull, "segments"): (True, False),  # this rank's rows of every rank's group, then added
        (a2a_pull, "segments"): (False, True),  # straight into place
    }
    for (ex, layout), expected in cases.items():
        p = plan(layout, interleave(ex, layout))
        assert (finishes(ex, p), lands_in_out(ex, p)) == expected, (ex.collective, ex.reduction, layout)
        # the last group's collective may run beside the others' but where its own-segment step
        # reads what they received (the rows layout's exchange), and where there is no NCCL (pull)
        alone = layout == "rows" and ex.collective != "all_reduce" or ex.reduction in ("pull", "pull_scatter")
        assert tail_apart(ex.collective, layout, ex.reduction) is not alone


def test_only_a_pull_scatter_s_sums_read_in_place():
    """Exchange.in_place: a pull_scatter's sums read the other ranks' memory; a reduce-scatter's pull
    copies its rows and stages them (buffers' recv, [world, rows * n]), an all-to-all's land in place."""
    from flashoverlap.comm import Exchange, buffers
    from flashoverlap.plan import make_plan

    assert Exchange("all_reduce", (8,), (8,) * 4, 8, "pull_scatter").in_place
    pulls = {c: exchange(c, 1024, 4, reduction="pull") for c in ("reduce_scatter", "all_to_all")}
    assert not any(ex.in_place for ex in pulls.values()) and not exchange("reduce_scatter", 1024, 4).in_place
    plan = make_plan(1024, 256, tile_m=128, tile_n=128, cluster_m=1, ctas=4, layout="segments", interleave=4)
    for collective, staged in [("reduce_scatter", (4 * 256 * 256,)), ("all_to_all", None)]:
        _, _, recv = buffers(pulls[collective], plan, torch.empty)
        assert (None if recv is None else tuple(recv.shape)) == staged


def test_a_pull_all_reduce_gathers_into_its_own_buffers():
    """``pull``: every rank's partial sums gathered as ``local`` does, but the GEMM writes a buffer
    of its own (given: memory the ranks map), never the result, which the adds write while the
    other ranks still read the buffer."""
    from flashoverlap.comm import buffers
    from flashoverlap.plan import make_plan
    from flashoverlap.rules import comm_pattern

    plan = make_plan(1024, 256, tile_m=128, tile_n=128, cluster_m=1, ctas=4, layout="rows")
    assert plan.in_place
    ex = exchange("all_reduce", 1024, 3, reduction="pull")
    assert ex.recv == (1024,) * 3 and comm_pattern("all_reduce", "rows", "pull") == "pull"
    shared = torch.empty(plan.numel)
    out, buffer, recv = buffers(ex, plan, torch.empty, shared)
    assert buffer is shared and recv.numel() == 3 * plan.numel
    out, buffer, _ = buffers(ex, plan, torch.empty)
    assert buffer.data_ptr() != out.data_ptr()
    local_out, local_buffer, _ = buffers(exchange("all_reduce", 1024, 3, reduction="local"), plan, torch.empty)
    assert local_buffer.data_ptr() == local_out.data_ptr()  # local: the GEMM writes the result in place


def test_landed_ranges_cover_the_result_once():
    """A window's result is copied out per group where comm.landed gives each group's range: the
    ranges of all groups cover the result exactly once."""
    from flashoverlap.comm import interleave, landed
    from flashoverlap.plan import make_plan

    ar, rs, a2a = exchange("all_reduce", 1024, 2), exchange("reduce_scatter", 1024, 2), exchange("all_to_all", 1024, 2)
    for ex, layout, covered in [
        (ar, "rows", True),
        (rs, "segments", True),
        (rs, "rows", False),
        (ar, "tiles", False),
        (a2a, "cols", False),
        (a2a, "segments", False),
    ]:
        p = make_plan(
            1024, 256, tile_m=128, tile_n=128, cluster_m=1, ctas=3, layout=layout, interleave=interleave(ex, layout)
        )
        out = torch.zeros(ex.rows, p.n)
        parts = [landed(ex, p, g, out) for g in range(p.num_groups)]
        if not covered:
            assert all(part is None for part in parts), (ex.collective, layout)
            continue
        assert p.num_groups > 1
        for part in parts:
            part += 1
        assert (out == 1).all(), (ex.collective, layout)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_pull_all_reduce_adds_its_own_partial_sums_from_its_buffer(world):
    """This rank's row of the gathered partial sums stays empty (copying it beside the GEMM is
    slow); the adds read the buffer instead, in rank order: every rank gets the same sum, bit for
    bit, whichever row is its own."""
    from flashoverlap.comm import buffers, finish_group
    from flashoverlap.plan import make_plan

    plan = make_plan(512, 256, tile_m=128, tile_n=128, cluster_m=1, ctas=2, layout="rows")
    ex = exchange("all_reduce", 512, world, reduction="pull")
    partials = torch.randn(world, plan.numel).to(torch.bfloat16)
    results = []
    for own in range(world):
        out, buffer, recv = buffers(ex, plan, lambda shape: torch.full(shape, float("nan"), dtype=torch.bfloat16))
        buffer.copy_(partials[own])
        for g in range(plan.num_groups):
            lo, hi = plan.bounds[g], plan.bounds[g + 1]
            rows = recv[world * lo : world * hi].view(world, -1)
            for r in range(world):  # the other ranks' rows, pulled
                if r != own:
                    rows[r] = partials[r, lo:hi]
            finish_group(ex, plan, g, buffer, recv, out, SimpleNamespace(rank=own))
        results.append(out.view(-1))
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.allclose(results[0].float(), partials.float().sum(0), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_pull_scatter_shares_tile_every_group_and_need_no_staging(world):
    """``pull_scatter``: the ranks' shares of a group cover it once, each whole 16-byte vectors where
    the group is (fo_sum's loads); the others' partial sums are read where they are, so a call has
    no staging buffer."""
    from flashoverlap.comm import VECTOR, buffers, shares
    from flashoverlap.plan import make_plan

    rng = np.random.default_rng(world)
    for _ in range(20):
        m, n = int(rng.integers(1, 2000)), 8 * int(rng.integers(1, 64))
        plan = make_plan(m, n, tile_m=64, tile_n=64, cluster_m=1, ctas=int(rng.integers(1, 9)), layout="rows")
        ex = exchange("all_reduce", m, world, reduction="pull_scatter")
        assert buffers(ex, plan, torch.empty)[2] is None
        for g in range(plan.num_groups):
            bounds = shares(plan.bounds[g], plan.bounds[g + 1], world)
            assert bounds[0] == plan.bounds[g] and bounds[-1] == plan.bounds[g + 1]
            assert all(lo <= hi and lo % VECTOR == 0 for lo, hi in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("world", [2, 4])
def test_a_pull_scatter_sums_each_share_once_and_gathers_the_others(world):
    """Each rank sums its share of a group from its own buffer and the others' partial sums (read in
    their buffers) into its buffer, where the others copy it from, and into its result; after every
    rank's gather each holds the whole sum."""
    from flashoverlap.comm import buffers, finish_group, gather_group
    from flashoverlap.plan import make_plan

    plan = make_plan(512, 264, tile_m=128, tile_n=128, cluster_m=1, ctas=2, layout="rows")
    ex = exchange("all_reduce", 512, world, reduction="pull_scatter")
    partials = torch.randn(world, plan.numel).to(torch.bfloat16)
    calls = [buffers(ex, plan, lambda shape: torch.full(shape, float("nan"), dtype=torch.bfloat16)) for _ in partials]
    for (_, buffer, _), partial in zip(calls, partials):
        buffer.copy_(partial)

    class Peers(SimpleNamespace):
        def at(self, r, chunk):  # rank r's buffer at the place of chunk in this rank's
            start = chunk.storage_offset() - calls[self.rank][1].storage_offset()
            return calls[r][1][start : start + chunk.numel()]

        def summed(self, g):
            self.said.append(g)

        def sums(self, g, parts):
            for r in range(world):
                if r != self.rank:
                    yield r, self.at(r, parts[r])

    peers = [Peers(rank=r, world=world, said=[]) for r in range(world)]
    for g in range(plan.num_groups):
        for rank, (out, buffer, recv) in enumerate(calls):
            finish_group(ex, plan, g, buffer, recv, out, peers[rank])
        for rank, (out, buffer, _) in enumerate(calls):
            gather_group(ex, plan, g, buffer, out, peers[rank])
    want = partials.float().sum(0)
    for rank, (out, _, _) in enumerate(calls):
        assert peers[rank].said == list(range(plan.num_groups))
        assert torch.equal(out.view(-1), calls[0][0].view(-1))  # the same bits on every rank
        assert torch.allclose(out.view(-1).float(), want, rtol=2e-2, atol=2e-2)


def test_a_group_s_timeout_is_its_backend_s(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=42))
    try:
        assert comm.group_timeout(None) == 42.0
        assert comm.group_timeout(dist.new_group([0], timeout=datetime.timedelta(seconds=7))) == 7.0
    finally:
        dist.destroy_process_group()


def plain_collective_worker(rank: int, world: int, store_path: str):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        uneven = [[1, 2, 3], [3, 0, 3], [2, 2, 2]]  # rank s sends uneven[s][r] rows to rank r
        cases = [
            exchange("all_reduce", 6, world),
            exchange("reduce_scatter", 6, world),
            exchange("all_to_all", 6, world),
            exchange("all_to_all", 6, world, splits=uneven[rank], output_splits=[row[rank] for row in uneven]),
        ]
        for ex in cases:
            data = torch.arange(12.0).reshape(6, 2) * (rank + 1) + 100 * rank
            want = comm.collective(ex, data.clone(), None)
            got = comm.plain_collective(ex, None)(data.clone())
            assert got.shape == (ex.rows, 2) and torch.equal(got, want), (ex, got, want)
        dist.barrier()  # gloo: a rank leaving right after a collective can break its peer's last receive
    finally:
        dist.destroy_process_group()


def test_a_call_decided_plain_runs_torch_distributed_s_collectives():
    """The plain path's collectives, called on the process group directly (without torch.distributed's
    per-call checks), give what torch.distributed's own calls give: every collective, even and
    uneven all-to-all splits, over three ranks."""
    from .helpers import spawn_ranks

    spawn_ranks(3, plain_collective_worker, timeout=120)


def test_the_plain_path_leaves_data_that_asks_for_torch_functions_to_torch_distributed(monkeypatch):
    """A tensor subclass (or a torch function mode) gets torch.distributed's own call, which hands
    it to the subclass: the process group's method would bypass it. So does complex data (the CPU
    path takes any dtype), which torch.distributed views as real first."""

    class Marked(torch.Tensor):
        pass

    ran = []
    monkeypatch.setattr(comm, "collective", lambda ex, data, group: ran.append((ex.collective, group)) or data)
    monkeypatch.setattr(comm, "process_group", lambda group: None)  # (no group is initialised here)
    for name in ("all_reduce", "reduce_scatter", "all_to_all"):
        ex = exchange(name, 4, 2)
        for data in (torch.zeros(4, 2).as_subclass(Marked), torch.zeros(4, 2, dtype=torch.complex64)):
            assert comm.plain_collective(ex, "group")(data) is data
    assert ran == [(name, "group") for name in ("all_reduce", "reduce_scatter", "all_to_all") for _ in range(2)]


def test_the_plain_path_asks_for_a_blocking_collective_which_may_return_no_work(monkeypatch):
    """Asked for a blocking collective (``asyncOp`` false, as torch.distributed's calls ask), NCCL
    runs it on the current stream and returns no work to wait for."""

    class Group:  # the process group's methods, as NCCL answers them
        def __init__(self):
            self.asked = []

        def allreduce(self, tensors, options):
            self.asked.append(("all_reduce", options.asyncOp))

        def _reduce_scatter_base(self, out, data, options):
            self.asked.append(("reduce_scatter", options.asyncOp))

        def alltoall_base(self, out, data, out_splits, in_splits, options):
            self.asked.append(("all_to_all", options.asyncOp, out_splits, in_splits))

    group = Group()
    monkeypatch.setattr(comm, "process_group", lambda _: group)
    for ex in (exchange("all_reduce", 4, 2), exchange("reduce_scatter", 4, 2), exchange("all_to_all", 4, 2)):
        assert comm.plain_collective(ex, None)(torch.zeros(4, 2)).shape == (ex.rows, 2)
    uneven = exchange("all_to_all", 4, 2, splits=[1, 3], output_splits=[1, 1])
    assert comm.plain_collective(uneven, None)(torch.zeros(4, 2)).shape == (2, 2)
    assert group.asked == [
        ("all_reduce", False),
        ("reduce_scatter", False),
        ("all_to_all", False, [], []),
        ("all_to_all", False, [1, 1], [1, 3]),
    ]
