"""How a call runs: the plain path, what a native replay may record, and the order a pull's streams keep (CPU)."""

import pytest
import torch

from flashoverlap import comm, runtime
from flashoverlap.inputs import Fp8, Scales

from .helpers import bf16


def test_a_call_is_recorded_for_replay_only_where_its_tensors_do_not_overlap():
    assert runtime._disjoint([(0x1000, 0x100), (0x1100, 0x10), (0x2000, 8)])
    assert not runtime._disjoint([(0x1000, 0x100), (0x10F0, 0x10)])  # (a view into another operand)
    assert not runtime._disjoint([(0x1000, 0x100), (0x1000, 0x100)])  # (a and weight one tensor)
    assert not runtime._disjoint([(0, 0), (0, 0)])  # two empty tensors share address 0


def _replay(monkeypatch, shared):
    """A runtime.Replay on the CPU of a call that allocates [2, 3] then [4] and returns the first,
    its program and the watchdog noting what they are handed."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # (a CPU device's index)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(runtime.signal, "stream_waits", lambda device, capturing: True)
    monkeypatch.delenv("FLASHOVERLAP_REPLAY", raising=False)
    monkeypatch.delenv("FLASHOVERLAP_DEBUG", raising=False)
    replayed, watched = [], []
    monkeypatch.setattr(runtime.watchdog, "track", lambda *call: watched.append(call))
    program = type("Program", (), {"replay": lambda self, values: replayed.append(values)})()
    call = ("caller", "all_reduce", (2, 3, 5), "pulls", "group")
    region = None if shared is None else shared.memory
    shapes = ((2, 3), (4,))
    replay = runtime.Replay(program, shared, region, True, shapes, 0, torch.bfloat16, torch.device("cpu"), (call,))
    return replay, replayed, watched


def test_a_replay_substitutes_the_operands_and_what_it_allocates_and_returns_its_result(monkeypatch):
    replay, replayed, watched = _replay(monkeypatch, None)
    a, w = bf16(2, 5), bf16(3, 5)
    assert replay.current()
    out = replay(a, w)
    assert out.shape == (2, 3) and out.dtype == torch.bfloat16
    assert replayed[0][:3] == [a.data_ptr(), w.data_ptr(), out.data_ptr()] and len(replayed[0]) == 4
    assert watched == [("caller", "all_reduce", (2, 3, 5), "pulls", "group")]
    scales = Scales(torch.ones(1), torch.ones(1))  # FP8's: the scales' product, between the operands and the rest
    out = replay(a, w, scales)
    assert len(replayed[1]) == 5 and replayed[1][:2] == [a.data_ptr(), w.data_ptr()]
    assert replayed[1][3] == out.data_ptr()


@pytest.mark.parametrize("change", ["memory", "capture", "env replay", "env debug", "waits", "device"])
def test_a_replay_is_taken_only_while_a_call_would_be_recorded_the_same(monkeypatch, change):
    shared = type("Shared", (), {"memory": torch.empty(4)})()
    replay, _, _ = _replay(monkeypatch, shared)
    assert replay.current()
    if change == "memory":  # the window (or pulls' memory) grew: its pointers are elsewhere
        shared.memory = torch.empty(8)
    elif change == "capture":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    elif change == "env replay":
        monkeypatch.setenv("FLASHOVERLAP_REPLAY", "0")
    elif change == "env debug":
        monkeypatch.setenv("FLASHOVERLAP_DEBUG", "1")
    elif change == "waits":
        monkeypatch.setattr(runtime.signal, "stream_waits", lambda device, capturing: False)
    else:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert not replay.current()


def test_a_repeat_takes_its_replay_before_anything_else(monkeypatch):
    """run_overlapped finds a kept replay by (exchange, group, tail group, the caller's stream) and
    does nothing else; on another stream it goes on (here into a plan that is not there)."""
    replay, replayed, _ = _replay(monkeypatch, None)
    monkeypatch.setattr(runtime, "raw_stream", lambda device: 7)
    ex = comm.exchange("all_reduce", 2, 2)
    prep = type("Prep", (), {"replays": {(ex, "group", None, 7): replay}})()
    a, w = bf16(2, 5), bf16(3, 5)
    out = runtime.run_overlapped(prep, a, w, ex, "group")
    assert out.shape == (2, 3) and len(replayed) == 1
    monkeypatch.setattr(runtime, "raw_stream", lambda device: 8)
    with pytest.raises(AttributeError, match="plan"):
        runtime.run_overlapped(prep, a, w, ex, "group")
    assert len(replayed) == 1


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
    collect = lambda ex, group: lambda out: ran.append((ex, out.shape, group)) or out  # noqa: E731
    monkeypatch.setattr(comm, "plain_collective", collect)
    ex = comm.exchange("all_reduce", 16, 2)
    out = runtime.plain(ex, "group", "nk", 2)(bf16(16, 32), bf16(8, 32))
    assert ran == [(ex, (16, 8), "group")] and out.shape == (16, 8)


@pytest.mark.parametrize("world", [1, 2])
def test_the_plain_fp8_runner_is_torchs_scaled_mm_then_the_collective(monkeypatch, world):
    """FP8 operands take ``torch._scaled_mm`` with the call's scales (weight [N, K], transposed as it
    asks) into their result dtype, accumulated as asked, then the collective."""
    ran = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum):
        ran.append(("scaled_mm", a.shape, b.shape, b.stride(), scale_a, scale_b, out_dtype, use_fast_accum))
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    collect = lambda ex, group: lambda out: ran.append(("collective", out.dtype)) or out  # noqa: E731
    monkeypatch.setattr(comm, "plain_collective", collect)
    scales = Scales(torch.ones(1), torch.ones(1))
    a, w = (torch.zeros(rows, 32, dtype=torch.float8_e4m3fn) for rows in (16, 8))
    kind = Fp8(torch.float16, fast_accum=True)
    out = runtime.plain(comm.exchange("all_reduce", 16, world), None, "nk", world, kind)(a, w, scales)
    assert ran[0] == ("scaled_mm", (16, 32), (32, 8), (1, 32), scales.a, scales.b, torch.float16, True)
    assert ran[1:] == [("collective", torch.float16)] * (world > 1) and out.dtype == torch.float16


class _Streams:
    """The streams, events and stream operations of one ``runtime._enqueue``, recorded in the order
    enqueued (CPU): ``ops`` as (stream, kind, detail); :meth:`clock` tells which earlier operation
    of each stream an operation comes after (program order, event waits, joins)."""

    def __init__(self, monkeypatch, peers):
        self.ops, self.current = [], None
        self.recorded = {}  # event -> the clock where it was last recorded
        self.clocks = {}  # stream -> its clock: {stream: index of the last op of that stream it follows}

        class Stream:  # (hashable: the runtime keys its side streams)
            def __init__(self, name):
                self.name = self.cuda_stream = name

        stream = Stream

        self.caller = stream("caller")
        made = {}
        monkeypatch.setattr(runtime, "side_stream", lambda device, role="comm": made.setdefault(role, stream(role)))
        monkeypatch.setattr(runtime, "lanes", lambda device, count: tuple(stream(f"lane {j}") for j in range(count)))
        monkeypatch.setattr(runtime, "join", lambda waiter, waitee, device: self.join(waiter, waitee))
        monkeypatch.setattr(runtime.enqueue, "record", lambda event, s: self.record(event, s))
        monkeypatch.setattr(runtime.enqueue, "wait", lambda s, event: self.wait(s, event))
        monkeypatch.setattr(torch.cuda, "Event", lambda *args, **kwargs: object())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "set_stream", lambda s: setattr(self, "current", s))
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        note = self.note
        monkeypatch.setattr(comm.peer.signal, "wait_at", lambda s, address, value: note(s, "wait", address))
        monkeypatch.setattr(comm.peer.enqueue, "runtime_call", lambda name, *args: note(self.current, name, args))
        monkeypatch.setattr(comm.peer.enqueue, "record", lambda event, s: self.record(event, s))
        peer_memory = [(r.data_ptr(), r.data_ptr() + r.numel()) for r in peers.peers]
        mine = peer_memory[peers.rank]

        def reads_peers(*tensors):
            return any(lo <= t.data_ptr() < hi and (lo, hi) != mine for t in tensors for lo, hi in peer_memory)

        monkeypatch.setattr(comm, "copy_2d", lambda dst, src: note(self.current, "copy", reads_peers(src)))
        monkeypatch.setattr(
            comm, "add_rows", lambda rows, out, also=None: note(self.current, "sum", reads_peers(*rows))
        )
        peers.copied = lambda: note(self.current, "copied", None)

    def note(self, s, kind, detail):
        clock = dict(self.clocks.get(s.name, {}))
        clock[s.name] = len(self.ops)
        self.clocks[s.name] = clock
        self.ops.append((s.name, kind, detail, clock))

    def record(self, event, s):
        self.note(s, "record", None)
        self.recorded[id(event)] = dict(self.clocks[s.name])

    def wait(self, s, event):
        clock = dict(self.clocks.get(s.name, {}))
        for name, index in self.recorded.get(id(event), {}).items():
            clock[name] = max(clock.get(name, -1), index)
        self.clocks[s.name] = clock
        self.note(s, "wait event", None)

    def join(self, waiter, waitee):
        event = object()
        self.record(event, waitee)
        self.wait(waiter, event)


def _pull_call(monkeypatch, collective, reduction, world, prep=None):
    """One pull call of ``collective`` through runtime._enqueue on CPU stand-ins of the streams and
    the other ranks' memory (as rank 0 of ``world``), on ``prep`` where given (else a new one):
    (prep, peers, the streams' record of what ran where)."""
    from flashoverlap.plan import make_plan
    from flashoverlap.prepared import Prepared

    m, n = 128 * world * 2, 512
    layout = "rows" if collective == "all_reduce" else "segments"
    plan = make_plan(
        m, n, tile_m=128, tile_n=256, cluster_m=1, ctas=4, layout=layout, interleave=1 if layout == "rows" else world
    )
    prep = prep or Prepared(plan, *(None,) * 4, plan.counter_targets(1), 4, None)
    ex = comm.with_reduction(comm.exchange(collective, m, world), reduction, world)
    peers = comm.Peers.__new__(comm.Peers)
    regions = [torch.zeros(4 * (comm.peer.DONE + 2 * world) + 2 * plan.numel, dtype=torch.uint8) for _ in range(world)]
    peers.rank, peers.world, peers.others = 0, world, list(range(1, world))
    peers.fresh, peers.peers, peers.memory, peers.device = comm.peer.DONE + world, regions, regions[0], None
    peers.flag_bytes = 4 * (peers.fresh + world)
    peers.claimed, peers.lanes, peers.sum_lanes = object(), (), ()
    peers.acquire = peers.release = lambda s: None
    streams = _Streams(monkeypatch, peers)
    prep.launch = lambda *args, **kwargs: streams.note(streams.current, "gemm", None)
    alloc = lambda shape: torch.zeros(shape, dtype=torch.bfloat16)  # noqa: E731
    shared = peers.memory[peers.flag_bytes : peers.flag_bytes + 2 * plan.numel].view(torch.bfloat16)
    out, buffer, recv = comm.buffers(ex, plan, alloc, shared)
    streams.current = streams.caller
    a, w = bf16(m, 64), bf16(n, 64)
    runtime._enqueue(prep, a, w, ex, (peers, None), streams.caller, None, (out, buffer, recv, out), None)
    return prep, peers, streams


def test_calls_of_one_plan_with_and_without_lanes_keep_their_events(monkeypatch):
    """runtime._enqueue: pulls that copy (a lane per rank) and sums that read in place (none) on one
    plan share its lane events; a replay notes their handles, so they are made once and kept (remade
    per kind, the other kind's replays enqueued freed events on 4x H200)."""
    prep, _, _ = _pull_call(monkeypatch, "all_to_all", "pull", 4)
    events, start = [list(done) for done in prep.lane_done], prep.pulls_start
    assert len(events) == 3 and start is not None
    with monkeypatch.context() as reads:  # (a call on this plan whose sums read in place)
        reads.setattr(comm.Exchange, "in_place", property(lambda ex: True))
        _, peers, _ = _pull_call(monkeypatch, "reduce_scatter", "pull", 4, prep)
        assert not peers.lanes
    _pull_call(monkeypatch, "all_to_all", "pull", 4, prep)
    assert prep.lane_done == events and prep.pulls_start is start


@pytest.mark.parametrize(
    ("collective", "reduction", "world"),
    [
        ("all_reduce", "pull", 2),
        ("all_reduce", "pull", 4),
        ("all_reduce", "pull_scatter", 4),
        ("reduce_scatter", "pull", 4),
        ("all_to_all", "pull", 4),
    ],
)
def test_a_pull_says_it_is_done_only_after_everything_that_read_the_other_ranks_memory(
    monkeypatch, collective, reduction, world
):
    """runtime._enqueue: ``copied`` (the other ranks may reuse their buffers once every rank said so)
    comes after every copy out of their memory and every sum reading it in place, on whatever stream
    it ran (a lane, the finisher, the sums' stream), by program order, event waits and joins; sums
    that read in place (pull_scatter) get no lanes, copies one per rank; sums of copies (a pull
    all-reduce's, a reduce-scatter's) come after their group's copies."""
    prep, peers, streams = _pull_call(monkeypatch, collective, reduction, world)
    in_place = comm.reads_in_place(reduction)
    assert (len(peers.lanes) > 0) == (world > 2 and not in_place)
    ((copied,),) = [[i for i, op in enumerate(streams.ops) if op[1] == "copied"]]
    reads = [(i, op) for i, op in enumerate(streams.ops) if op[1] in ("copy", "sum") and op[2]]
    assert reads and any(op[1] == "sum" for _, op in reads) == in_place
    after = streams.ops[copied][3]
    for i, (name, kind, _, _) in reads:
        assert after.get(name, -1) >= i, f"{kind} on {name} (op {i}) may still run when copied is said"
    sums = [op for op in streams.ops if op[1] == "sum"]
    if sums and not in_place:  # each group's copies (one per other rank), then its sum
        copies = [(i, op[0]) for i, op in enumerate(streams.ops) if op[1] == "copy" and op[2]]
        per = world - 1
        assert len(copies) == per * len(sums)
        for g, (name, _, _, clock) in enumerate(sums):
            for i, lane in copies[g * per : (g + 1) * per]:
                assert clock.get(lane, -1) >= i, f"group {g}'s sum on {name} may run before its copy {i} on {lane}"
