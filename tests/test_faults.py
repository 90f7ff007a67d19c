"""Faults a call must meet cleanly: a group across hosts, ranks on different GPUs, memory running
out inside a call (CPU: gloo, fakes standing in for CUDA and NCCL; the GPU check is marked)."""

import contextlib
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import yaml

import flashoverlap
from flashoverlap import comm, decision, registry, rules, runtime, state
from flashoverlap.comm import nccl, peer
from flashoverlap.config import OverlapConfig
from flashoverlap.plan import make_plan
from flashoverlap.prepared import Prepared

from .helpers import bf16, rel_err, spawn_ranks

H100 = ("NVIDIA H100 80GB HBM3", 132)


@pytest.fixture(autouse=True)
def _fresh(fresh_state):
    """Every test here starts without the group states of the others."""


def ranks_on(*hosts: str, gpus=(H100,)) -> tuple[peer.Rank, ...]:
    """The ranks' views (comm.peer.every_rank): rank r on ``hosts[r]``, on ``gpus[r]`` (the last for
    the rest), a GPU of its own with peer access."""
    return tuple(peer.Rank(host, f"GPU-{r}", True, *gpus[min(r, len(gpus) - 1)]) for r, host in enumerate(hosts))


# --- a group across hosts ----------------------------------------------------------------------


def test_a_group_across_hosts_is_on_the_network_whatever_the_environment(monkeypatch):
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    assert registry.transport(2) == "net" and registry.transport() == "nvlink"  # (no GPUs here to say otherwise)
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert registry.transport(3) == "net" and registry.transport(1) == "pcie"


def test_peer_memory_names_windows_and_pulls():
    assert rules.peer_memory(OverlapConfig(comm_sms=8)) == []
    assert rules.peer_memory(OverlapConfig(reduction="local")) == []  # (NCCL's all-gather, no window)
    assert rules.peer_memory(OverlapConfig(reduction="local", symmetric=True, comm_sms=0)) == ["symmetric: true"]
    assert rules.peer_memory(OverlapConfig(reduction="pull_scatter", symmetric=False)) == ["reduction: pull_scatter"]


def registry_of_two_transports(tmp_path, monkeypatch, shape) -> None:
    """A registry with an NVLink entry that pulls and a network entry in a window for ``shape``
    (all-reduce) and an all-to-all network entry in a window (the copy engines)."""
    entry = {"collective": "all_reduce", "dtype": "bfloat16", "shape": list(shape)}
    entries = [
        {**entry, "transport": "nvlink", "config": {"reduction": "pull", "comm_sms": 4}},
        {**entry, "transport": "net", "config": {"symmetric": True, "comm_sms": 8}},
        {**entry, "collective": "all_to_all", "transport": "net", "config": {"symmetric": True, "comm_sms": 12}},
    ]
    (tmp_path / "gpus.yaml").write_text(yaml.safe_dump({"gpu": "NVIDIA H100", "world": 2, "entries": entries}))
    monkeypatch.setenv("FLASHOVERLAP_CONFIG_DIRS", str(tmp_path))
    registry.reload()


def decides_on(monkeypatch, views: tuple[peer.Rank, ...], shape, seen: list) -> None:
    """Calls of GEMM ``shape`` on two ranks whose gathered views are ``views``, through NCCL, nothing
    launched: the registry's lookups, the candidates timed and the plans made go to ``seen``."""
    _, n, k = shape
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    monkeypatch.setattr(peer, "every_rank", lambda group, device: views)
    monkeypatch.setattr(decision, "world_size", lambda group: 2)
    monkeypatch.setattr(decision, "check_inputs", lambda a, w, layout: (a.shape[0], n, k))
    monkeypatch.setattr(decision, "_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(comm, "cuda_backend", lambda group: "nccl")
    monkeypatch.setattr(peer, "cuda_backend", lambda group: "nccl")
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(runtime, "side_stream", lambda device, role="comm": role)
    monkeypatch.setattr(decision, "one_wave", lambda *args: False)
    lookup = registry.lookup
    monkeypatch.setattr(registry, "lookup", lambda *key, **kw: seen.append(("lookup", key[3])) or lookup(*key, **kw))

    def prepare(m, n, k, dtype, layout, device, cfg, *args, **kwargs):
        seen.append(("plan", cfg))
        plan = make_plan(m, n, tile_m=128, tile_n=256, cluster_m=1, ctas=116, layout=cfg.layout)
        return Prepared(plan, *(None,) * 5, 116, None, cfg.symmetric)

    monkeypatch.setattr(decision, "prepare", prepare)
    monkeypatch.setattr(decision, "check_agreement", lambda *args: None)
    monkeypatch.setattr(decision, "budget_communicator", lambda cfg, *args: "budget")
    monkeypatch.setattr(comm, "tail_group", lambda *args: "tail")
    monkeypatch.setattr(decision, "trial", lambda cfgs, *args, **kw: seen.append(("timed", list(cfgs))) or 0)


@pytest.mark.parametrize("hosts", [("a", "a"), ("a", "b")])
def test_a_group_across_hosts_looks_up_net_entries_and_never_takes_peer_memory(
    one_rank_group, tmp_path, monkeypatch, hosts
):
    """Ranks on one host keep the host's transport (NVLink here: its entry pulls, and a call without
    a tuned shape times a pull too); ranks on two look up the registry's ``net`` entries, and neither
    the entry's window nor a pull is taken or timed."""
    shape = (4096, 8192, 64)
    registry_of_two_transports(tmp_path, monkeypatch, shape)
    seen = []
    decides_on(monkeypatch, ranks_on(*hosts), shape, seen)
    across = hosts[0] != hosts[1]
    chosen = decision.decide(bf16(4096, 64), bf16(8192, 64), "all_reduce")
    assert ("lookup", "net" if across else "nvlink") in seen
    if across:  # the net entry's comm_sms, without its window
        assert chosen.config == rules.for_collective(OverlapConfig(comm_sms=8), "all_reduce")
    else:
        assert chosen.config.reduction == "pull" and chosen.config.comm_sms == 4
    seen.clear()
    decision.decide(bf16(3000, 64), bf16(8192, 64), "all_reduce")  # another shape: the nearest, timed
    ((timed, candidates),) = [step for step in seen if step[0] == "timed"]
    assert any(c.reduction in comm.PULLS for c in candidates) is not across
    if across:
        assert all(rules.peer_memory(c) == [] for c in candidates)
        assert all(rules.peer_memory(cfg) == [] for what, cfg in seen if what == "plan")
    seen.clear()
    chosen = decision.decide(bf16(4096, 64), bf16(8192, 64), "all_to_all")
    assert chosen.config.symmetric is False and chosen.config.comm_sms == (12 if across else 16)


@pytest.mark.parametrize(
    "collective, config",
    [
        ("all_reduce", {"symmetric": True}),
        ("all_reduce", {"reduction": "pull"}),
        ("all_reduce", {"reduction": "pull_scatter"}),
        ("all_reduce", {"reduction": "local", "symmetric": True}),
        ("reduce_scatter", {"reduction": "pull"}),
        ("all_to_all", {"symmetric": True}),  # the copy engines
    ],
)
def test_a_config_asking_for_peer_memory_across_hosts_is_refused_before_anything_runs(
    one_rank_group, monkeypatch, collective, config
):
    seen = []
    decides_on(monkeypatch, ranks_on("a", "b"), (4096, 8192, 64), seen)
    monkeypatch.setattr(decision, "prepare", lambda *args, **kw: pytest.fail("planned a call it must refuse"))
    with pytest.raises(ValueError, match=r"reach the other GPUs' memory, .* sit on 2 hosts \(a, b\)"):
        decision.decide(bf16(4096, 64), bf16(8192, 64), collective, config=config)
    assert seen == []  # (no lookup either)


def across_hosts_worker(rank: int, world: int, store_path: str, case: str):
    """``case``: "hosts" (each rank on a host of its own, one GPU model) or "gpus" (one host, rank 1
    on another GPU model): a call decided on every rank, CUDA's answers faked per rank."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        name, sms = H100 if case == "hosts" or rank == 0 else ("NVIDIA A100-SXM4-80GB", 108)
        peer.socket.gethostname = lambda: f"node{rank}" if case == "hosts" else "node"
        props = SimpleNamespace(uuid=f"GPU-{rank}", name=name, multi_processor_count=sms)
        torch.cuda.get_device_properties = lambda device: props
        torch.cuda.device_count = lambda: 0
        torch.cuda.get_device_capability = lambda device=None: (9, 0)
        decision.check_inputs = lambda a, w, layout: (a.shape[0], w.shape[0], 64)
        transports = []
        decision.tuned_config = lambda a, world, ex, shape, transport, p2p: transports.append(transport)
        decision.one_wave = lambda *args: True  # (then the plain path: nothing to launch here)
        a, w = bf16(4096, 64), bf16(8192, 64)
        if case == "gpus":
            for _ in range(2):  # every rank refuses alike, every call
                with pytest.raises(RuntimeError, match="ranks of a group run on different GPUs") as refused:
                    decision.decide(a, w, "all_reduce")
            assert "ranks [0] on NVIDIA H100 80GB HBM3 (132 SMs); ranks [1] on NVIDIA A100-SXM4-80GB (108 SMs)" in str(
                refused.value
            )
            # (its traceback's frames hold the process group: a reference past destroy_process_group can
            # abort a gloo process at exit)
            del refused
            assert transports == []  # before any lookup
            assert decision.decide(a, w, "all_reduce", config={"sequential": True}).config is None
        else:
            assert decision.decide(a, w, "all_reduce").config is None and transports == ["net"]
            assert peer.hosts(peer.every_rank(dist.group.WORLD, a.device)) == ["node0", "node1"]
            with pytest.raises(ValueError, match=r"sit on 2 hosts \(node0, node1\)"):
                decision.decide(a, w, "all_reduce", config={"symmetric": True})
        dist.barrier()  # gloo: a rank leaving right after an all-gather can break its peer's last receive
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["hosts", "gpus"])
def test_ranks_gather_their_hosts_and_gpus_and_decide_alike(case):
    """Two processes, each told of another host or GPU model: the hosts make the group's transport
    ``net``; GPUs of two models are refused on both ranks, naming each rank's GPU, before any lookup
    (a call of ``sequential: true`` runs anywhere)."""
    spawn_ranks(2, across_hosts_worker, case, timeout=120)


def test_different_gpus_are_refused_naming_each_rank_s():
    decision.check_gpus(ranks_on("a", "b", "c"))
    with pytest.raises(RuntimeError, match=r"ranks \[0, 2\] on NVIDIA H100 80GB HBM3 \(132 SMs\); ranks \[1\] on"):
        decision.check_gpus(ranks_on("a", "a", "a", gpus=(H100, ("NVIDIA H100 80GB HBM3", 114), H100)))


# --- out of memory inside a call ---------------------------------------------------------------


class Allocations:
    """Counts the allocations of a call (device memory: torch.empty but on the meta device, a
    symmetric-memory region, an NCCL window) and raises torch.OutOfMemoryError at number ``fail``."""

    def __init__(self, monkeypatch):
        self.count, self.fail = 0, None
        empty = torch.empty

        def counted(*shape, **kw):
            if kw.get("device") != "meta":
                self.next()
            return empty(*shape, **kw)

        monkeypatch.setattr(torch, "empty", counted)

    def next(self) -> None:
        self.count += 1
        if self.count == self.fail:
            raise torch.OutOfMemoryError(f"allocation {self.count}: out of memory (a test's)")


class FakeLibrary:
    """libnccl's window calls on CPU memory: ``ncclMemAlloc`` counted (:class:`Allocations`), each
    call recorded; ``ncclCommWindowRegister`` fails (status 1) for the communicators in ``refuse``."""

    def __init__(self, allocations: Allocations):
        self.allocations, self.calls, self.refuse, self.regions = allocations, [], set(), {}

    def ncclMemAlloc(self, ptr, nbytes):
        try:
            self.allocations.next()
        except torch.OutOfMemoryError:
            return 1
        region = torch.zeros(nbytes.value, dtype=torch.uint8)
        ptr._obj.value = region.data_ptr()
        self.regions[region.data_ptr()] = region
        self.calls.append(("alloc", region.data_ptr()))
        return 0

    def ncclCommWindowRegister(self, comm, ptr, nbytes, handle, flags):
        if comm in self.refuse:
            return 1
        handle._obj.value = 0x1000 + len(self.calls)
        self.calls.append(("register", comm, ptr.value))
        return 0

    def ncclCommWindowDeregister(self, comm, handle):
        self.calls.append(("deregister", comm, handle.value))
        return 0

    def ncclMemFree(self, ptr):
        self.calls.append(("free", ptr.value))
        self.regions.pop(ptr.value)
        return 0

    def ncclGetErrorString(self, status):
        return b"unhandled cuda error"


def fake_window(monkeypatch, groups, allocations: Allocations, free: int = 0) -> tuple[nccl.Window, FakeLibrary]:
    """A :class:`comm.nccl.Window` of ``groups`` on the CPU, its NCCL calls on :class:`FakeLibrary`;
    ``free``: the bytes the GPU says it has free."""
    lib = FakeLibrary(allocations)
    monkeypatch.setattr(nccl, "library", lambda: lib)
    monkeypatch.setattr(nccl, "communicator", lambda group, device: group)
    monkeypatch.setattr(nccl, "device_bytes", lambda ptr, nbytes, device: lib.regions[ptr][:nbytes])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 << 30))
    window = nccl.Window.__new__(nccl.Window)
    window.groups, window.device, window.memory, window.regions, window.released = list(groups), None, None, [], None
    return window, lib


def test_a_window_that_fails_to_register_is_deregistered_and_freed(monkeypatch):
    """Registering a region is all-or-nothing: where one communicator refuses it, the others drop it
    and its memory is freed; the window keeps what it had, and grows on the next call."""
    window, lib = fake_window(monkeypatch, ["budget", "tail"], Allocations(monkeypatch))
    lib.refuse = {"tail"}
    with pytest.raises(RuntimeError, match="ncclCommWindowRegister failed"):
        window.allocator(4096, torch.bfloat16)
    (_, ptr), (_, comm_, at), (_, dropped, _), (_, freed) = lib.calls
    assert (comm_, at, dropped, freed) == ("budget", ptr, "budget", ptr)
    assert window.memory is None and window.regions == [] and lib.regions == {}
    lib.refuse, lib.calls = set(), []
    alloc = window.allocator(4096, torch.bfloat16)
    assert [c[0] for c in lib.calls] == ["alloc", "register", "register"] and alloc((2048,)).shape == (2048,)
    assert window.regions == [window.memory] and window.memory.numel() == 4096


@pytest.mark.parametrize("free", [0, 1 << 20])
def test_a_window_s_failed_allocation_is_out_of_memory_where_the_gpu_lacks_the_bytes(monkeypatch, free):
    allocations = Allocations(monkeypatch)
    window, lib = fake_window(monkeypatch, ["budget"], allocations, free)
    allocations.fail = 1
    with pytest.raises(torch.OutOfMemoryError if free < 8192 else RuntimeError, match="ncclMemAlloc failed"):
        window.allocator(8192, torch.bfloat16)
    assert lib.calls == [] and window.memory is None and window.regions == []


def fake_peers(monkeypatch, allocations: Allocations, world: int = 2) -> peer.Peers:
    """Rank 0's :class:`comm.peer.Peers` of ``world`` ranks on the CPU: its regions from a stand-in
    for torch's symmetric memory (counted: :class:`Allocations`), every rank's the same memory."""
    import torch.distributed._symmetric_memory as symm_mem

    def empty(nbytes, dtype, device):
        allocations.next()
        return torch.zeros(nbytes, dtype=dtype)

    def rendezvous(memory, name):
        return SimpleNamespace(get_buffer=lambda r, shape, dtype: memory)

    monkeypatch.setattr(symm_mem, "empty", empty)
    monkeypatch.setattr(symm_mem, "rendezvous", rendezvous)
    monkeypatch.setattr(peer.enqueue, "record", lambda event, stream: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(dist, "barrier", lambda **kwargs: None)
    monkeypatch.setattr(peer, "cuda_backend", lambda group: "gloo")
    p = peer.Peers.__new__(peer.Peers)
    p.group, p.device, p.rank, p.world, p.others = SimpleNamespace(group_name="g"), None, 0, world, [1]
    p.fresh, p.memory, p.regions, p.peers, p._handles = peer.DONE + world, None, [], [], []
    p.flag_bytes, p.claimed, p.targets, p.lanes, p.sum_lanes = (
        nccl.carved_bytes((p.fresh + world,), torch.int32),
        None,
        (),
        (),
        (),
    )
    return p


def as_claimed(p: peer.Peers) -> bool:
    """Whether ``p``'s flags are as a claim leaves them: nothing counted, done clear, fresh set."""
    flags = p.memory[: p.flag_bytes].view(torch.int32)
    return not flags[: p.fresh].any() and bool((flags[p.fresh : p.fresh + p.world] == 1).all())


def overlapped(monkeypatch, path: str):
    """``call()``: an overlapped all-reduce on two ranks through ``path`` ("window": an NCCL window,
    "pull": comm.peer, "nccl": plain buffers) with its device work left out (what would be enqueued
    goes to ``enqueued``); and what it keeps (the window or the Peers, the plan)."""
    allocations = Allocations(monkeypatch)
    m, n = 512, 512
    plan = make_plan(m, n, tile_m=128, tile_n=256, cluster_m=1, ctas=4, layout="rows")
    kernel = SimpleNamespace(spec=SimpleNamespace(dtype="bfloat16"))  # (what run_overlapped asks of it)
    prep = Prepared(plan, kernel, *(None,) * 3, plan.counter_targets(1), 4, None, path == "window")
    ex = comm.exchange("all_reduce", m, 2)
    group, kept = "budget", None
    if path == "pull":
        ex, group = comm.with_reduction(ex, "pull", 2), fake_peers(monkeypatch, allocations)
        kept = group
    elif path == "window":
        kept = fake_window(monkeypatch, [group], allocations)[0]
        state.of(group).windows[group, group] = kept
    enqueued = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=1))
    monkeypatch.setattr(runtime, "replay_key", lambda *args: None)
    monkeypatch.setattr(runtime, "raw_stream", lambda device: 1)
    monkeypatch.setattr(runtime, "_enqueue", lambda *args: enqueued.append(args[7]))  # (its tensors)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(runtime, "side_stream", lambda device, role="comm": role)
    monkeypatch.setattr(runtime.watchdog, "track", lambda stream, *call: enqueued.append(("watched", *call)))
    a, w = bf16(m, 64), bf16(n, 64)
    return (lambda: runtime.run_overlapped(prep, a, w, ex, group)), allocations, enqueued, prep, kept


@pytest.mark.parametrize("path", ["nccl", "window", "pull"])
@pytest.mark.parametrize("fail", [1, 2, 3])
def test_memory_running_out_inside_a_call_leaves_nothing_half_done(monkeypatch, path, fail):
    """An overlapped call whose ``fail``-th allocation runs out of memory (its buffers, an NCCL
    window's or a pull's region) raises torch.OutOfMemoryError having enqueued nothing (no flag of a
    pull set, no claim owed), a window or pull region either kept whole or not at all, no views of
    one cached; the next call runs."""
    # a first call allocates: the rows of C (in place); with a window its region first; with a pull
    # its region first, then every rank's partial sums
    if fail > {"nccl": 1, "window": 2, "pull": 3}[path]:
        pytest.skip("a call of this path allocates less")
    call, allocations, enqueued, prep, kept = overlapped(monkeypatch, path)
    allocations.fail = fail
    with pytest.raises(torch.OutOfMemoryError, match=f"allocation {fail}|ncclMemAlloc failed"):
        call()
    assert enqueued == [] and prep.programs == {}  # (nothing for the watchdog either)
    if kept is not None:
        assert kept.regions == ([] if fail == 1 else [kept.memory])
        for region, _ in prep.window_views.values():
            assert region is kept.memory  # (views of a region kept whole)
    if path == "pull":
        assert kept.targets == () and (kept.memory is None or as_claimed(kept))
    allocations.fail = None
    result = call()
    watched = [e for e in enqueued if e[0] == "watched"]  # its end, and a pull's claim for the next call
    named = {"nccl": "c10d", "window": "an NCCL window", "pull": "pulls"}[path]
    group = kept if path == "pull" else "budget"
    assert [e[1:] for e in watched] == [("all_reduce", (512, 512, 64), named, group)] * (1 + (path == "pull"))
    enqueued = [e for e in enqueued if e[0] != "watched"]
    assert len(enqueued) == 1 and result.shape == (512, 512)
    out, buffer, recv, _ = enqueued[0]
    if path == "pull":
        assert as_claimed(kept) and buffer.data_ptr() == kept.memory.data_ptr() + kept.flag_bytes
    if path == "window":
        assert out.data_ptr() == kept.memory.data_ptr() and len(kept.regions) == 1


def test_a_plan_that_runs_out_of_memory_is_not_kept(monkeypatch):
    """prepare() keeps a plan only once its device tables are all allocated."""
    from flashoverlap import prepared

    allocations = Allocations(monkeypatch)
    monkeypatch.setattr(prepared, "_kernel", lambda *args: (args[-1], fake_kernel(), 4))
    monkeypatch.setattr(prepared, "side_stream", lambda device, role: None)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    zeros = torch.zeros

    def counted_zeros(*shape, **kw):
        allocations.next()
        return zeros(*shape, **{**kw, "device": "cpu"})

    monkeypatch.setattr(torch, "zeros", counted_zeros)
    monkeypatch.setattr(state, "plans", state.Recent(state.MAX_PLANS))
    cfg = rules.for_collective(OverlapConfig(), "all_reduce")
    device = torch.device("cpu")
    for fail in (1, 2, 3):  # the counters, the stream-K workspace, the debug report
        allocations.count, allocations.fail = 0, fail
        with pytest.raises(torch.OutOfMemoryError):
            prepared.prepare(512, 512, 64, torch.bfloat16, "nk", device, cfg)
        assert not state.plans
    allocations.fail = None
    assert prepared.prepare(512, 512, 64, torch.bfloat16, "nk", device, cfg) is next(iter(state.plans.values()))


def fake_kernel():
    return SimpleNamespace(
        num_ctas=lambda *args: 4,
        stream_k_tiles=lambda *args: 0,
        workspace_size=lambda *args: 256,
        signals_per_tile=1,
    )


# --- on GPUs -----------------------------------------------------------------------------------


def out_of_memory_worker(rank: int, world: int, store_path: str):
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world, device_id=device
    )
    try:
        m, n, k = 4096, 8192, 2048
        gen = torch.Generator(device="cuda").manual_seed(rank)
        a = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
        expected = (a.float() @ w.float().t()).contiguous()
        dist.all_reduce(expected)
        configs = [{}, {"symmetric": True}]
        if comm.peer.unavailable(dist.group.WORLD, device) is None:
            configs.append({"reduction": "pull"})
        big = torch.cat([a, a])
        for config in configs:
            for x in (a, big):  # planned, agreed, windows grown: what is left to allocate is the call's own
                flashoverlap.gemm_all_reduce(x, w, config=config)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            filler, chunk = [], 1 << 30
            while chunk >= 1 << 20:  # every rank's GPU full to the last MiB
                try:
                    filler.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
                except torch.OutOfMemoryError:
                    chunk //= 2
            dist.barrier()
            with pytest.raises(torch.OutOfMemoryError):
                flashoverlap.gemm_all_reduce(big, w, config=config)
            del filler
            torch.cuda.empty_cache()
            dist.barrier()
            for _ in range(3):  # the next calls run (the third replayed), and right
                out = flashoverlap.gemm_all_reduce(a, w, config=config)
                assert rel_err(out, expected) < 1e-2, f"{config}: after running out of memory"
            assert rel_err(flashoverlap.gemm_all_reduce(big, w, config=config)[m:], expected) < 1e-2
            torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


@pytest.mark.multigpu
def test_a_call_that_runs_out_of_memory_leaves_the_next_one_running():
    """Every rank's GPU filled to the last MiB: an overlapped call of a new shape (NCCL, a window, a
    pull where the GPUs can) raises torch.OutOfMemoryError on every rank; once memory is back, the
    same config's calls run and are right (no flag, claim or half-grown window left behind)."""
    spawn_ranks(2, out_of_memory_worker, timeout=300)


SPAWN_AND_WAIT = r"""
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from tests.helpers import spawn_ranks

def worker(rank, world, store, folder):
    # a rank hung inside a CUDA or NCCL call: Python's handlers never run, so torch's own
    # parent-death signal (SIGINT) would not end it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(os.path.join(folder, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    spawn_ranks(2, worker, sys.argv[2], timeout=120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_spawned_ranks_end_with_a_test_run_killed_from_outside(tmp_path):
    """helpers.spawn_ranks: when the test process is killed (a timeout around pytest on a GPU machine),
    its ranks end with it, even one hung where no Python handler runs, instead of holding the GPUs
    and communicators the next run waits for."""
    import os
    import signal
    import subprocess
    import time
    from pathlib import Path

    script = tmp_path / "spawn.py"
    script.write_text(SPAWN_AND_WAIT)
    root = str(Path(__file__).resolve().parent.parent)
    parent = subprocess.Popen([sys.executable, str(script), root, str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert time.monotonic() < deadline and parent.poll() is None, "the ranks never started"
            time.sleep(0.2)
        time.sleep(0.5)  # (each rank past writing its pid: in its sleep)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with contextlib.suppress(FileNotFoundError):  # (a zombie until reaped counts as ended)
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
        return False

    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} outlived the killed test process"
