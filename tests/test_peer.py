"""When a ``pull`` all-reduce can run (comm.peer.unavailable) and what a call does where it cannot."""

import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from flashoverlap import OverlapConfig, comm, rules
from flashoverlap.comm import peer


@pytest.fixture
def gloo_group():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "s"), 1), rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_pulls_need_p2p_and_an_nccl_group(gloo_group, monkeypatch):
    device = torch.device("cuda", 0)
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert "NCCL_P2P_DISABLE=1" in peer.unavailable(gloo_group, device)
    monkeypatch.delenv("NCCL_P2P_DISABLE")
    assert "a gloo group" in peer.unavailable(gloo_group, device)


@pytest.mark.parametrize(
    "views, why",
    [
        ([("a", "GPU-0", True), ("a", "GPU-1", True)], None),
        ([("a", "GPU-0", True), ("b", "GPU-1", True)], "several hosts"),
        ([("a", "GPU-0", True), ("a", "GPU-0", True)], "sharing a GPU"),
        ([("a", "GPU-0", True), ("a", "GPU-1", False)], "without peer access"),
    ],
)
def test_every_rank_s_view_decides_alike(views, why):
    """The ranks' (host, GPU, peer access) views, gathered: one answer for all of them."""
    ranks = tuple(peer.Rank(*view, "NVIDIA H100", 132) for view in views)
    found = peer.why_not(ranks)
    assert found is None if why is None else why in found


def test_a_rank_s_view_is_asked_of_the_host_and_cuda_once_per_group(gloo_group, monkeypatch):
    """This rank's host, GPU, peer access, model and SMs, gathered once per group and kept in its
    state; peer access to every other GPU it sees."""
    asked = []
    props = SimpleNamespace(uuid="GPU-0", name="NVIDIA H100", multi_processor_count=132)
    monkeypatch.setattr(peer.socket, "gethostname", lambda: "a")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: (i, j) != (0, 2))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: asked.append(device) or props)
    device = torch.device("cuda", 0)
    assert peer.this_rank(device) == ("a", "GPU-0", False, "NVIDIA H100", 132)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: True)
    mine = peer.this_rank(device)
    assert mine.peer_access and peer.every_rank(gloo_group, device) == (mine,)
    assert peer.every_rank(gloo_group, device) == (mine,) and len(asked) == 3  # (kept: asked no more)


def test_a_tuned_pull_falls_back_where_it_cannot_run():
    """A registry entry (or the nearest one) that pulls becomes NCCL's all-reduce with its other
    choices kept; a config given by the caller raises instead (decision._start)."""
    cfg = OverlapConfig(reduction="pull", comm_sms=4, partition=(1, 2, 1))
    assert rules.without_pull(cfg) == OverlapConfig(comm_sms=4, partition=(1, 2, 1))
    assert comm.comm_pattern("all_reduce", "rows", rules.without_pull(cfg).reduction) == "all_reduce"
    # a pull that left no SM beside the GEMM (its copies took none) gives NCCL's kernels the default
    copied = OverlapConfig(layout="segments", reduction="pull", comm_sms=0)
    assert rules.without_pull(copied).comm_sms == OverlapConfig().comm_sms > 0


class _Memory:
    """The ranks' flag words (int32 per (rank, index)) and which call's rows each rank's group holds,
    as the simulated streams below read and write them."""

    def __init__(self, regions: list[torch.Tensor]):
        self.regions, self.words, self.rows, self.sums = regions, {}, {}, {}

    def word(self, address: int) -> tuple[int, int]:
        for rank, region in enumerate(self.regions):
            if 0 <= address - region.data_ptr() < region.numel():
                return rank, (address - region.data_ptr()) // 4
        raise AssertionError(f"address {address:#x} is in no rank's memory")


class _Stream(SimpleNamespace):
    """A stream of the model: the ops enqueued on it, in order."""


def _streams(peers: list, calls: int, targets: tuple[int, ...], adds: str = "copied") -> list[list]:
    """Every rank's calls, as ops on its streams, recorded from :class:`peer.Peers`' methods as
    runtime._enqueue orders them, for ``adds`` of copies (``copied``: a ``pull`` all-reduce or
    reduce-scatter) or of shares read where they are and their sums copied (``scatter``:
    ``pull_scatter``): comm (after the caller's previous work,
    each group's pulls -- ``copied``: from each other rank on a lane of its own where there are
    several, joined back; else only their waits -- and, but for the last group, the wait for this
    rank's own rows; then ``copied`` -- but for ``copied`` after finish's reads -- and the next
    call's claim); gemm (the caller's: after the previous call's work and the claim's ``claimed``
    event, each group's rows then its counter, then its end); finish (each group's add of its own
    rows -- and but for ``copied`` the others' --, after the group's pulls -- the last group's also
    after the GEMM's end; with ``scatter`` then ``summed``); with ``scatter`` a lane per other rank
    for its sums (after the first group's pulls), joined into comm before ``copied``."""
    streams, claims, current = [], {}, [None]
    scatter = adds == "scatter"  # (its sums read the others' shares in place)

    def record(event, stream):  # Peers.claim's ``claimed``, numbered per rank
        rank = next(p.rank for p in peers if p.claimed is event)
        claims[rank] = claims.get(rank, 0) + 1
        stream.cuda_stream.ops.append(("event", (rank, claims[rank], "claimed")))

    def on(stream):
        current[0] = stream
        return stream.ops

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(peer.signal, "wait_at", lambda s, address, value: s.cuda_stream.ops.append(("wait", address, value)))
        mp.setattr(peer.enqueue, "runtime_call", lambda name, address, value, s: s.ops.append((name, address, value)))
        mp.setattr(peer.enqueue, "record", record)
        mp.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(cuda_stream=current[0]))
        mp.setattr(torch.cuda, "set_stream", lambda stream: current.__setitem__(0, stream.cuda_stream))
        mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        for p in peers:
            comm, gemm, finish = (_Stream(ops=[]) for _ in range(3))
            several = len(p.others) > 1 and not scatter  # (reads in place: their waits on comm, no copies there)
            lanes = tuple(_Stream(ops=[]) for _ in p.others) if several else ()
            sum_lanes = tuple(_Stream(ops=[]) for _ in p.others) if scatter else ()
            p.lanes = tuple(SimpleNamespace(cuda_stream=lane) for lane in lanes)
            p.sum_lanes = tuple(SimpleNamespace(cuda_stream=lane) for lane in sum_lanes)
            for call in range(calls):
                p.targets = targets
                if call:  # (the caller: after the previous call's work; the GEMM and the finisher: after the claim)
                    done = ("after", (p.rank, call - 1, "finished"))
                    comm.ops.append(done)
                    gemm.ops += [done, ("after", (p.rank, call, "claimed"))]
                comm.ops.append(("event", (p.rank, call, "start")))
                for lane in lanes:
                    lane.ops.append(("after", (p.rank, call, "start")))
                for g, target in enumerate(targets):
                    gemm.ops += [("rows", p.rank, g, call), ("count", p._flag(p.rank, g), target)]
                    on(comm)
                    for r, _ in p.arrivals(g, p.every(p.memory[p.flag_bytes :])):
                        if not scatter:
                            current[0].ops.append(("copy", r, g, call))
                    for j, lane in enumerate(lanes):
                        lane.ops.append(("event", (p.rank, call, g, j)))
                        comm.ops.append(("after", (p.rank, call, g, j)))
                    if g < len(targets) - 1:
                        p.mine(g)
                    else:
                        finish.ops.append(("after", (p.rank, call, "gemm done")))
                    comm.ops.append(("event", (p.rank, call, g)))
                    finish.ops += [("after", (p.rank, call, g)), ("copy", p.rank, g, call)]
                    if scatter:  # the others' rows read where they are by the add
                        finish.ops += [("copy", r, g, call) for r in p.others]
                    if scatter:
                        on(finish).append(("sum", p.rank, g, call))
                        p.summed(g)
                        for lane in sum_lanes if g == 0 else ():
                            lane.ops.append(("after", (p.rank, call, 0)))
                        on(gemm)  # (the caller's: the lanes are switched to and back)
                        for r, _ in p.sums(g, [p.memory[p.flag_bytes :]] * p.world):
                            current[0].ops.append(("copy sum", r, g, call))
                gemm.ops.append(("event", (p.rank, call, "gemm done")))
                finish.ops.append(("event", (p.rank, call, "finished")))
                for j, lane in enumerate(sum_lanes):
                    lane.ops.append(("event", (p.rank, call, "summed", j)))
                    comm.ops.append(("after", (p.rank, call, "summed", j)))
                    gemm.ops.append(("after", (p.rank, call, "summed", j)))
                if scatter:
                    comm.ops.append(("after", (p.rank, call, "finished")))
                on(comm)
                p.copied()
                p.claim()
            streams += [s.ops for s in (comm, gemm, finish, *lanes, *sum_lanes)]
    return streams


def _modelled_peers(world: int) -> tuple[list[torch.Tensor], list]:
    """Every rank's memory (flags first, as Peers lays them out) and its :class:`peer.Peers` over
    it, without GPUs or process groups: for the models of the ranks' streams."""
    regions = [torch.zeros(4096, dtype=torch.uint8) for _ in range(world)]
    peers = []
    for rank in range(world):
        p = peer.Peers.__new__(peer.Peers)
        p.claimed = object()
        p.rank, p.world, p.others = rank, world, peer.ring(rank, world)
        p.fresh, p.device, p.peers, p.memory = peer.DONE + world, None, regions, regions[rank]
        p.flag_bytes = 4 * (p.fresh + world)
        peers.append(p)
    return regions, peers


def _run(streams: list[list], memory: _Memory, seed: int) -> None:
    """Run the streams' ops in a random interleaving (a wait or an event wait blocks its stream;
    some streams, chosen per seed, run 100 times slower than the others); every copy must find the
    rows of its own call."""
    import random

    rng, events, at = random.Random(seed), set(), [0] * len(streams)
    speed = [rng.choice([1.0, 1.0, 0.01]) for _ in streams]
    while True:
        ready = []
        for i, ops in enumerate(streams):
            if at[i] == len(ops):
                continue
            op = ops[at[i]]
            if op[0] == "wait" and memory.words.get(memory.word(op[1]), 0) < op[2]:
                continue
            if op[0] == "after" and op[1] not in events:
                continue
            ready.append(i)
        if not ready:
            assert at == [len(ops) for ops in streams], "a stream waits forever"
            return
        i = rng.choices(ready, [speed[i] for i in ready])[0]
        op = streams[i][at[i]]
        at[i] += 1
        if op[0] == "fo_write_value":
            memory.words[memory.word(op[1])] = op[2]
        elif op[0] == "fo_zero":
            rank, first = memory.word(op[1])
            for index in range(first, first + op[2] // 4):
                memory.words[(rank, index)] = 0
        elif op[0] == "count":
            word = memory.word(op[1])
            memory.words[word] = memory.words.get(word, 0) + op[2]
        elif op[0] == "rows":
            memory.rows[op[1], op[2]] = op[3]
        elif op[0] == "copy":
            assert memory.rows.get((op[1], op[2])) == op[3], f"rank {op[1]}'s group {op[2]} was not call {op[3]}'s"
        elif op[0] == "sum":  # (its own rows, summed in place with the others' pulled)
            memory.sums[op[1], op[2]] = op[3]
        elif op[0] == "copy sum":
            found = memory.rows.get((op[1], op[2])), memory.sums.get((op[1], op[2]))
            assert found == (op[3], op[3]), f"rank {op[1]}'s sum of group {op[2]} was not call {op[3]}'s: {found}"
        elif op[0] == "landed":  # (a copy into rank op[1]'s staging for call op[2])
            memory.sums[op[1], op[2]] = memory.sums.get((op[1], op[2]), 0) + 1
        elif op[0] == "fused":  # its epilogue adds every other rank's copy of this call
            found = memory.sums.get((op[1], op[2]), 0)
            assert found == len(memory.regions) - 1, f"rank {op[1]} added {found} copies of call {op[2]}"
        elif op[0] == "event":
            events.add(op[1])


@pytest.mark.parametrize("adds", ["copied", "scatter"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_pulls_copy_every_group_of_their_own_call_whatever_the_interleaving(world, adds):
    """The flags of comm.peer on a model of the ranks' streams: each rank's copies of another's
    group wait for that rank's counter (in its memory) of the same call, never the previous call's
    counts (zeroed after every rank copied: ``done``; waited on after the zeroing: ``fresh``), and
    no GEMM overwrites rows another rank has yet to copy (or, ``scatter``, to read in place); with
    ``scatter`` (``pull_scatter``) each copy of another rank's sum waits for that rank's ``summed``
    flag of the same call, and no GEMM overwrites a sum another rank has yet to copy."""
    regions, peers = _modelled_peers(world)
    streams = _streams(peers, 3, (2, 1, 3), adds)
    for seed in range(300 if world <= 4 else 60):
        memory = _Memory(regions)
        for rank in range(world):  # as Peers._grow leaves the flags
            for r in range(world):
                memory.words[rank, peers[rank].fresh + r] = 1
        _run(streams, memory, seed)


def _fused_streams(peers: list, calls: int, claim_after_gemm: bool = True) -> list[list]:
    """A ``pull_fused`` reduce-scatter's calls on the model of :func:`_streams`, one group per rank's
    rows: rank p's walk computes the rows of rank (p + 1 + g) % world as its group g, its own last.
    comm: per group, the part of each other rank's group that is this rank's rows (rank q's group
    (p - q - 1) % world: comm.own_rows) copied once q's counter says so; after the last of them this
    rank's ready flag; then ``copied``, (``claim_after_gemm``) the wait for its GEMM's end, the claim.
    gemm: after the claim's ``claimed``, each group's rows and counter, the last (its own rows) first
    waiting for the ready flag and adding the copies, which must be this call's."""
    streams, claims, current = [], {}, [None]
    world = len(peers)

    def record(event, stream):
        rank = next(p.rank for p in peers if p.claimed is event)
        claims[rank] = claims.get(rank, 0) + 1
        stream.cuda_stream.ops.append(("event", (rank, claims[rank], "claimed")))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(peer.signal, "wait_at", lambda s, address, value: s.cuda_stream.ops.append(("wait", address, value)))
        mp.setattr(peer.enqueue, "runtime_call", lambda name, address, value, s: s.ops.append((name, address, value)))
        mp.setattr(peer.enqueue, "record", record)
        mp.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(cuda_stream=current[0]))
        mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        for p in peers:
            comm, gemm = _Stream(ops=[]), _Stream(ops=[])
            p.lanes, p.targets = (), (1,) * world
            current[0] = comm
            for call in range(calls):
                if call:
                    gemm.ops.append(("after", (p.rank, call, "claimed")))
                for g in range(world):
                    if g == world - 1:  # its own rows: the epilogue waits for the copies, then adds them
                        gemm.ops += [("wait", p._flag(p.rank, peer.READY), 1), ("fused", p.rank, call)]
                    gemm.ops += [("rows", p.rank, g, call), ("count", p._flag(p.rank, g), 1)]
                    mine = {q: p.memory[p.flag_bytes :] for q in p.others if (p.rank - q - 1) % world == g}
                    for q, _ in p.arrivals(g, mine):
                        comm.ops += [("copy", q, g, call), ("landed", p.rank, call)]
                    if g == world - 2:
                        p.ready(0)
                gemm.ops.append(("event", (p.rank, call, "gemm done")))
                p.copied()
                if claim_after_gemm:
                    comm.ops.append(("after", (p.rank, call, "gemm done")))
                p.claim()
            streams += [comm.ops, gemm.ops]
    return streams


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_fused_sums_add_this_call_s_copies_and_never_wait_forever(world):
    """``pull_fused`` on the model of the ranks' streams: every rank's epilogue adds the copies of its
    own call (the ready flag is zeroed by the claim only after its GEMM has read it), whatever the
    interleaving; without the claim's wait for the GEMM's end a GEMM can wait forever (no other rank
    waits for a rank's own rows, so its ``done`` flags can come while it still computes them)."""
    regions, peers = _modelled_peers(world)

    def run(streams, seed):
        memory = _Memory(regions)
        for rank in range(world):  # as Peers._grow leaves the flags
            for r in range(world):
                memory.words[rank, peers[rank].fresh + r] = 1
        _run(streams, memory, seed)

    streams = _fused_streams(peers, 3)
    for seed in range(200 if world <= 4 else 40):
        run(streams, seed)
    unordered = _fused_streams(peers, 3, claim_after_gemm=False)
    hung = 0
    for seed in range(200):
        try:
            run(unordered, seed)
        except AssertionError as exc:
            hung += "waits forever" in str(exc)
    assert hung, "the model never hung without the claim's wait for the GEMM"


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ranks_pull_in_ring_order_each_step_reading_every_gpu_once(world):
    """comm.peer.ring: at step s every rank pulls from its s-th next rank, so that no GPU's memory is
    read by several ranks at once (in rank order every rank read rank 0's, or 1's, first)."""
    orders = [peer.ring(rank, world) for rank in range(world)]
    for rank, order in enumerate(orders):
        assert sorted(order) == [r for r in range(world) if r != rank]
    for step in range(world - 1):
        assert sorted(order[step] for order in orders) == list(range(world)), step
