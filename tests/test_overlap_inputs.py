"""Bad input is rejected with a clear message before anything is launched (CPU: gloo, one rank)."""

import contextlib
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import flashoverlap
from flashoverlap import comm, overlap, registry
from flashoverlap.overlap import check_inputs
from flashoverlap.registry import Found

from .helpers import spawn_ranks


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


ENTRY_POINTS = [flashoverlap.gemm_all_reduce, flashoverlap.gemm_reduce_scatter, flashoverlap.gemm_all_to_all]


def bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_uninitialised_process_group_is_reported(monkeypatch, fn):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fn(bf16(64, 64), bf16(64, 64))


@pytest.mark.parametrize(
    "a, w, kwargs, error, message",
    [
        (torch.randn(64, 64), torch.randn(64, 64), {}, ValueError, "dtype torch.float32; supported"),
        (bf16(64, 64), bf16(64, 64).half(), {}, ValueError, "dtypes differ"),
        (bf16(64, 64), bf16(64, 72), {}, ValueError, r"K mismatch: a is \(64, 64\) but weight is \(64, 72\)"),
        (bf16(64, 64), bf16(72, 64), {"weight_layout": "kn"}, ValueError, r"expects \[64, N\]"),
        (bf16(64, 64), bf16(64, 64), {"weight_layout": "t"}, ValueError, "weight_layout must be one of"),
        (bf16(64), bf16(64, 64), {}, ValueError, "a must be 2-D"),
        ([[1.0]], bf16(64, 64), {}, TypeError, "a must be a torch.Tensor"),
        (bf16(64, 60), bf16(64, 60), {}, ValueError, "multiples of 8"),
        (bf16(64, 64), bf16(60, 64), {}, ValueError, "multiples of 8"),
        (bf16(64, 64), bf16(0, 64), {}, ValueError, "empty problem: N=0"),
        (bf16(64, 128)[:, ::2], bf16(64, 64), {}, ValueError, "a must be contiguous"),
        (bf16(64, 64), bf16(64, 128)[:, ::2], {}, ValueError, "weight must be contiguous"),
        (bf16(64, 64), bf16(64, 64), {}, ValueError, "a is on cpu, expected a cuda tensor"),
        (bf16(64, 64), bf16(64, 64), {"config": {"tile_m": 96}}, ValueError, "tile_m 96 not in"),
        (bf16(64, 64), bf16(64, 64), {"config": {"bogus": 1}}, ValueError, "unknown key"),
    ],
)
@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_bad_input_is_rejected(one_rank_group, fn, a, w, kwargs, error, message):
    with pytest.raises(error, match=message):
        fn(a, w, **kwargs)


@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_bad_config_files_are_rejected(one_rank_group, tmp_path, fn):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        fn(bf16(64, 64), bf16(64, 64), config=str(tmp_path / "missing.yaml"))
    broken = tmp_path / "broken.yaml"
    broken.write_text("tile_m: [128\n")
    with pytest.raises(ValueError, match="malformed YAML"):
        fn(bf16(64, 64), bf16(64, 64), config=str(broken))
    typed = tmp_path / "typed.yaml"
    typed.write_text("comm_sms: many\n")
    with pytest.raises(ValueError, match=f"{typed}: .*comm_sms must be an integer"):
        fn(bf16(64, 64), bf16(64, 64), config=str(typed))
    with pytest.raises(TypeError, match="config must be an OverlapConfig"):
        fn(bf16(64, 64), bf16(64, 64), config=42)


def test_reference_inputs_must_be_on_cpu():
    assert check_inputs(bf16(16, 32), bf16(8, 32), "nk", device_type="cpu") == (16, 8, 32)


@pytest.mark.parametrize(
    "fn, kwargs, message",
    [
        (flashoverlap.gemm_reduce_scatter, {"config": {"layout": "tiles"}}, "reduce_scatter needs layout 'cols'"),
        (flashoverlap.gemm_all_to_all, {"config": {"layout": "tiles"}}, "all_to_all needs layout 'cols'"),
        (flashoverlap.gemm_all_to_all, {"config": {"epilogue": "tma", "scheduler": "streamk"}}, "neither takes it"),
        (
            flashoverlap.gemm_all_to_all,
            {"config": {"epilogue": "tma", "layout": "cols"}},
            "layout 'rows' or 'segments'",
        ),
        (flashoverlap.gemm_reduce_scatter, {}, "a is on cpu"),
        (flashoverlap.gemm_all_to_all, {"splits": [64]}, "a is on cpu"),
    ],
)
def test_every_entry_point_validates(one_rank_group, fn, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fn(bf16(64, 64), bf16(64, 64), **kwargs)


def test_a_config_without_a_kernel_on_this_gpu_fails_before_any_communication(monkeypatch):
    from flashoverlap import comm, overlap

    monkeypatch.setattr(overlap, "check_inputs", lambda a, w, layout: (64, 64, 64))
    monkeypatch.setattr(overlap, "world_size", lambda group: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))  # an RTX 4090
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # CPU tensors stand in

    def exchange(*args, **kwargs):
        raise AssertionError("communicated before rejecting the config")

    monkeypatch.setattr(comm, "exchange", exchange)
    with pytest.raises(ValueError, match="the sm90 kernels need a Hopper GPU"):
        flashoverlap.gemm_all_to_all(bf16(64, 64), bf16(64, 64), splits=[10, 54], config={"kernel": "sm90"})
    with pytest.raises(ValueError, match=r"cannot run on sm_89: cluster_m 2 not in \(1,\)"):
        flashoverlap.gemm_all_reduce(bf16(64, 64), bf16(64, 64), config={"cluster_m": 2})


@pytest.mark.parametrize(
    ("config", "tuned", "waves", "trial", "env", "paths", "timed", "said"),
    [
        # one group: nothing to overlap
        (None, None, 1, None, None, ["sequential"] * 2, 0, "sequential: one wave of tiles"),
        # untuned: timed once, kept
        (None, None, 3, 0.9, None, ["overlapped"] * 2, 1, "overlapped, the defaults {'layout': 'rows'"),
        # within the margin: sequential
        (None, None, 3, 0.99, None, ["sequential"] * 2, 1, "sequential: the defaults lost to it when timed"),
        # FLASHOVERLAP_TRIAL=0: the defaults as they are
        (None, None, 3, 1.2, "0", ["overlapped"] * 2, 0, "overlapped, the defaults"),
        # a registry entry for the call's shape is the tuner's word
        (None, ({}, True), 3, 1.2, None, ["overlapped"] * 2, 0, "overlapped, the registry's config"),
        (None, ({"sequential": True}, True), 3, 1.2, None, ["sequential"] * 2, 0, "registry's config says sequential"),
        # one for another shape is a hint, timed like the defaults (which replace a hint of sequential)
        (None, ({}, False), 3, 0.9, None, ["overlapped"] * 2, 1, "overlapped, the nearest tuned shape's config {"),
        (None, ({}, False), 3, 1.2, None, ["sequential"] * 2, 1, "the nearest tuned shape's config lost to it"),
        (None, ({"sequential": True}, False), 3, 0.9, None, ["overlapped"] * 2, 1, "overlapped, the defaults {"),
        # an explicit config runs as given
        ({}, None, 1, 1.2, None, ["overlapped"] * 2, 0, "overlapped, your config {'layout': 'rows'"),
    ],
)
def test_which_path_a_call_takes(
    one_rank_group, monkeypatch, caplog, config, tuned, waves, trial, env, paths, timed, said
):
    """A call without config= skips the overlap where it cannot pay: a GEMM of one group, or an
    untuned call that lost to sequential when first timed (overlap / sequential time ``trial``).
    ``FLASHOVERLAP_LOG=1`` says which path it took and why, once."""
    from flashoverlap import bench, overlap
    from flashoverlap.plan import make_plan

    plan = make_plan(128 * waves, 256, tile_m=128, tile_n=256, cluster_m=1, ctas=1, partition=None, layout="rows")
    prep = overlap.Prepared(plan, *(None,) * 5, 132, None)
    taken, trials = [], []
    monkeypatch.setattr(overlap, "_trials", type(overlap._trials)())

    def time_variants(variants, rounds, block, warmup, group=None, graphs=False):
        trials.append(sorted(variants))
        return {name: 1.0 if name == "sequential" else trial for name in variants}

    if env is not None:
        monkeypatch.setenv("FLASHOVERLAP_TRIAL", env)
    monkeypatch.setenv("FLASHOVERLAP_LOG", "1")
    monkeypatch.setattr(overlap, "_said", type(overlap._said)())
    monkeypatch.setattr(overlap, "check_inputs", lambda a, w, layout: (plan.m, plan.n, 64))
    monkeypatch.setattr(overlap, "world_size", lambda group: 2)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # CPU tensors stand in
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(
        overlap,
        "tuned_config",
        lambda *args: None if tuned is None else Found(overlap.OverlapConfig(**tuned[0]), tuned[1]),
    )
    monkeypatch.setattr(overlap, "prepare", lambda *args: taken.append("planned") or prep)
    monkeypatch.setattr(overlap, "one_wave", lambda cfg, m, n, device: m <= 128)  # the plan's one CTA
    monkeypatch.setattr(overlap, "check_agreement", lambda *args: None)
    monkeypatch.setattr(overlap, "budget_communicator", lambda *args: None)
    monkeypatch.setattr(overlap, "sequential", lambda *args: taken.append("sequential"))
    monkeypatch.setattr(overlap, "run_overlapped", lambda *args, **kwargs: taken.append("overlapped"))
    monkeypatch.setattr(bench, "time_variants", time_variants)
    for _ in range(2):
        flashoverlap.gemm_all_reduce(bf16(plan.m, 64), bf16(plan.n, 64), config=config)
    assert plan.num_groups == waves and [p for p in taken if p != "planned"] == paths
    # one wave without config, or a sequential entry for the shape: not even planned
    assert ("planned" in taken) == ((config is not None or waves > 1) and tuned != ({"sequential": True}, True))
    # (3 tiles: a late budget saves no wave, no second candidate)
    assert trials == [["overlapped, comm_sms 16", "sequential"]] * timed
    what = f"all_reduce {plan.m}x{plan.n}x64 bfloat16, 1 rank: "
    lines = [line for line in caplog.messages if line.startswith(what)]
    assert len(lines) == 1 and said in lines[0], lines  # once, for both calls


@pytest.mark.parametrize(
    ("m", "n", "late"),
    [
        (4096, 8192, True),  # 1024 tiles: 9 waves on the defaults' 116 SMs, 8 on all 132
        (128 * 33, 1024, True),  # 132 tiles: one wave on 132 SMs, 2 on 116
        (128 * 29, 1024, False),  # 116 tiles: one wave either way
        (128 * 60, 1024, True),  # 240 tiles: 3 waves on 116 SMs, 2 on 132
        (128 * 50, 1024, False),  # 200 tiles: 2 waves either way
    ],
)
def test_the_hopper_alternative_is_the_config_with_its_budget_late_where_that_saves_a_wave(m, n, late):
    from flashoverlap import overlap
    from flashoverlap.config import OverlapConfig

    cfg = OverlapConfig(partition=(1,) * 99)  # a partition belongs to its waves: dropped
    assert overlap.alternative(cfg, (m, n, 64), 132, (9, 0)) == (OverlapConfig(late_budget=True) if late else None)
    if not late:
        return
    assert overlap.alternative(OverlapConfig(comm_sms=24), (m, n, 64), 132, (9, 0)).comm_sms == 24
    others = ({"late_budget": True}, {"comm_sms": 0}, {"scheduler": "streamk"}, {"cluster_m": 2})
    for other in others:
        assert overlap.alternative(OverlapConfig(**other), (m, n, 64), 132, (9, 0)) is None


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0)])
def test_the_ampere_ada_alternative_leaves_nccl_fewer_sms(capability):
    """The Ampere/Ada kernels cannot stop CTAs early: an untuned call times NCCL on fewer SMs instead,
    whatever the shape, where the config leaves it more."""
    from flashoverlap import overlap
    from flashoverlap.config import OverlapConfig

    cfg = OverlapConfig(kernel="sm80" if capability == (9, 0) else "auto", partition=(1,) * 99)
    fewer = overlap.alternative(cfg, (4096, 8192, 64), 132, capability)
    assert fewer == OverlapConfig(kernel=cfg.kernel, comm_sms=overlap.FEWEST_COMM_SMS)
    assert overlap.alternative(cfg, (128 * 29, 1024, 64), 132, capability) == fewer  # one wave either way
    for sms in (0, overlap.FEWEST_COMM_SMS):
        assert overlap.alternative(dataclasses.replace(cfg, comm_sms=sms), (4096, 8192, 64), 132, capability) is None


def untuned_all_reduce(monkeypatch, m: int, n: int) -> dict:
    """An all-reduce of [m, 64] x [n, 64] on two ranks without a tuned config, planned on 132 SMs in
    128 x 256 tiles, nothing checked with the other rank: the plans made, by (late_budget, reduction)."""
    from flashoverlap import overlap
    from flashoverlap.plan import make_plan

    preps = {}

    def prepare(m, n, k, dtype, layout, device, cfg, *args):
        sms = 132 if cfg.late_budget else 132 - cfg.comm_sms
        plan = make_plan(m, n, tile_m=128, tile_n=256, cluster_m=1, ctas=sms, layout="rows", keep=132 - cfg.comm_sms)
        return preps.setdefault((cfg.late_budget, cfg.reduction), overlap.Prepared(plan, *(None,) * 5, sms, None))

    monkeypatch.setattr(overlap, "_trials", type(overlap._trials)())
    monkeypatch.setattr(overlap, "_decided", type(overlap._decided)())
    monkeypatch.setattr(overlap, "world_size", lambda group: 2)
    monkeypatch.setattr(overlap, "check_inputs", lambda a, w, layout: (m, n, 64))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(overlap, "tuned_config", lambda *args: None)
    monkeypatch.setattr(overlap, "one_wave", lambda *args: False)
    monkeypatch.setattr(overlap, "prepare", prepare)
    monkeypatch.setattr(overlap, "check_agreement", lambda *args: None)
    return preps


def test_a_timed_call_runs_the_fastest_candidate(one_rank_group, monkeypatch):
    """A call without a tuned config times the defaults, the same with its SM budget late
    (:func:`overlap.alternative`) and sequential once; the fastest runs, with its own plan and communicator."""
    from flashoverlap import bench, overlap

    m, n = 4096, 8192
    ran = []
    preps = untuned_all_reduce(monkeypatch, m, n)
    monkeypatch.setattr(overlap, "budget_communicator", lambda cfg, *args: f"budget {cfg.comm_sms}")
    monkeypatch.setattr(overlap, "run_overlapped", lambda prep, a, w, ex, budget, **kw: ran.append((prep, budget)))
    times = {"sequential": 1.0, "overlapped, comm_sms 16": 0.95, "overlapped, comm_sms 16 late": 0.9}
    monkeypatch.setattr(bench, "time_variants", lambda variants, *args, **kwargs: {v: times[v] for v in variants})
    for _ in range(2):
        flashoverlap.gemm_all_reduce(bf16(m, 64), bf16(n, 64))
    late = preps[True, "nccl"]
    assert ran == [(late, "budget 16")] * 2 and len(overlap._trials) == 1
    assert (late.plan.after, late.plan.partition) == (6, (6, 1, 1))
    chosen = overlap.decide(bf16(m, 64), bf16(n, 64), "all_reduce")
    assert chosen.config.late_budget and chosen.prep is late


def test_where_the_ranks_can_pull_a_timed_all_reduce_times_the_pull_too(one_rank_group, monkeypatch):
    """A call without a tuned config also times its config as a pull all-reduce (overlap.pulled)
    where comm.peer.unavailable allows; a winning pull runs with its own exchange, its copies and
    no NCCL communicator for the last group."""
    from flashoverlap import bench, overlap

    m, n = 4096, 8192
    ran = []
    untuned_all_reduce(monkeypatch, m, n)
    monkeypatch.setattr(overlap, "budget_communicator", lambda cfg, *args: f"budget {cfg.reduction} {cfg.comm_sms}")
    monkeypatch.setattr(comm, "tail_group", lambda *args: "tail")
    monkeypatch.setattr(comm.peer, "unavailable", lambda group, device: None)
    monkeypatch.setattr(
        overlap, "run_overlapped", lambda prep, a, w, ex, b, tail_group: ran.append((ex, b, tail_group))
    )
    times = {
        "sequential": 1.0,
        "overlapped, comm_sms 16": 0.95,
        "overlapped, comm_sms 16 late": 0.9,
        "overlapped, comm_sms 4 pull": 0.85,  # 1024 tiles: 8 waves on 128 SMs as on 132
    }
    timed = []
    monkeypatch.setattr(
        bench,
        "time_variants",
        lambda variants, *args, **kwargs: timed.append(sorted(variants)) or {v: times[v] for v in variants},
    )
    flashoverlap.gemm_all_reduce(bf16(m, 64), bf16(n, 64))
    assert timed == [sorted(times)]
    ((ex, budget, tail),) = ran
    assert ex.reduction == "pull" and ex.recv == (m, m) and budget == "budget pull 4" and tail is None
    # where they cannot pull, not timed
    monkeypatch.setattr(overlap, "_trials", type(overlap._trials)())
    monkeypatch.setattr(overlap, "_decided", type(overlap._decided)())
    monkeypatch.setattr(comm.peer, "unavailable", lambda group, device: "no peer access")
    flashoverlap.gemm_all_reduce(bf16(m, 64), bf16(n, 64))
    assert timed[-1] == ["overlapped, comm_sms 16", "overlapped, comm_sms 16 late", "sequential"]


@pytest.mark.parametrize(
    ("m", "spare"),  # 128 x 256 tiles, N 8192: 32 tiles per tile row
    [(4096, 4), (128 * 33, 0), (128 * 45, 1), (128 * 15, 4), (1024, 4)],  # 1024, 1056, 1440, 480, 256 tiles
)
def test_a_pull_candidate_leaves_the_adds_what_the_grid_spares(m, spare):
    """overlap.pulled: as many SMs as the GEMM spares at its whole grid's wave count, at most 4."""
    from flashoverlap import overlap
    from flashoverlap.config import for_collective

    cfg = for_collective(overlap.OverlapConfig(symmetric=True, late_budget=True), "all_reduce")
    pull = overlap.pulled(cfg, "all_reduce", (m, 8192, 64), 132)
    assert (pull.reduction, pull.comm_sms, pull.symmetric, pull.late_budget) == ("pull", spare, False, False)
    assert overlap.pulled(pull, "all_reduce", (m, 8192, 64), 132) is None  # a pull already
    assert overlap.pulled(cfg, "reduce_scatter", (m, 8192, 64), 132) is None


@pytest.mark.parametrize("p2p_disabled", [False, True])
def test_no_window_where_p2p_is_disabled(one_rank_group, monkeypatch, p2p_disabled):
    """NCCL's symmetric kernels reach peers through CUDA IPC whatever NCCL_P2P_DISABLE says: with
    P2P disabled a call runs without a window, as where ranks lack peer access."""
    from flashoverlap import overlap
    from flashoverlap.plan import make_plan

    plan = make_plan(4096, 8192, tile_m=128, tile_n=256, cluster_m=1, ctas=116, layout="rows")
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1" if p2p_disabled else "0")
    monkeypatch.setattr(overlap, "world_size", lambda group: 2)
    monkeypatch.setattr(overlap, "check_inputs", lambda a, w, layout: (4096, 8192, 64))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(overlap, "prepare", lambda *args: overlap.Prepared(plan, *(None,) * 5, 116, None))
    monkeypatch.setattr(overlap, "check_agreement", lambda *args: None)
    monkeypatch.setattr(overlap, "budget_communicator", lambda *args: None)
    chosen = overlap.decide(bf16(4096, 64), bf16(8192, 64), "all_reduce", config={"symmetric": True})
    assert chosen.config.symmetric is not p2p_disabled
    # a pull all-reduce copies between the GPUs' memories: refused, not run over NVLink behind the transport's back
    if p2p_disabled:
        with pytest.raises(ValueError, match="reduction 'pull' copies between the GPUs' memories: NCCL_P2P_DISABLE"):
            overlap.decide(bf16(4096, 64), bf16(8192, 64), "all_reduce", config={"reduction": "pull"})
    else:
        monkeypatch.setattr(comm.peer, "unavailable", lambda group, device: None)  # (the test's group is gloo's)
        chosen = overlap.decide(bf16(4096, 64), bf16(8192, 64), "all_reduce", config={"reduction": "pull"})
        assert chosen.config.reduction == "pull" and chosen.tail is None  # (no NCCL communicator)


@pytest.mark.parametrize("config", [None, {}])
def test_a_group_of_one_rank_runs_the_plain_gemm_before_any_lookup(one_rank_group, monkeypatch, caplog, config):
    """The same model run without tensor parallelism pays only the input checks: no registry
    lookup, no config resolution for the collective, no device switch."""
    from flashoverlap import overlap

    monkeypatch.setenv("FLASHOVERLAP_LOG", "1")
    monkeypatch.setattr(overlap, "_said", type(overlap._said)())

    def unexpected(*args, **kwargs):
        raise AssertionError("a one-rank call went past the plain GEMM's checks")

    taken = []
    monkeypatch.setattr(overlap, "check_inputs", lambda a, w, layout: (256, 256, 64))
    monkeypatch.setattr(overlap, "tuned_config", unexpected)
    monkeypatch.setattr(overlap, "for_call", unexpected)
    monkeypatch.setattr(torch.cuda, "device", unexpected)
    monkeypatch.setattr(overlap, "sequential", lambda *args: taken.append(args[3].collective))
    for fn in ENTRY_POINTS:
        fn(bf16(256, 64), bf16(256, 64), config=config)
    assert taken == ["all_reduce", "reduce_scatter", "all_to_all"]
    assert caplog.text.count("bfloat16, 1 rank: sequential: one rank") == 3


@pytest.mark.parametrize("m, sources", [(3000, (3000, 0)), (0, (0, 3000)), (0, None)])
def test_a_call_where_a_rank_has_no_rows_runs_the_plain_collective_alike(
    one_rank_group, monkeypatch, caplog, m, sources
):
    """Where this rank, or a rank every rank knows of (counts exchanged), has no rows, the call runs
    matmul + the collective on every rank, before any lookup or planning."""
    from flashoverlap import comm, overlap

    def unexpected(*args, **kwargs):
        raise AssertionError("a call with a rank without rows went past the plain path")

    taken = []
    ex = comm.Exchange("all_to_all", (m // 2, m - m // 2), (0, 0), 0, uniform=False, sources=sources)
    monkeypatch.setattr(overlap, "world_size", lambda group: 2)
    monkeypatch.setattr(overlap, "check_inputs", lambda a, w, layout: (m, 256, 64))
    monkeypatch.setattr(comm, "exchange", lambda *args, **kwargs: ex)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(overlap, "tuned_config", unexpected)
    monkeypatch.setattr(overlap, "prepare", unexpected)
    monkeypatch.setattr(overlap, "sequential", lambda *args: taken.append(args[3]))
    monkeypatch.setenv("FLASHOVERLAP_LOG", "1")
    monkeypatch.setattr(overlap, "_said", type(overlap._said)())
    for config in (None, {"layout": "cols"}):
        flashoverlap.gemm_all_to_all(bf16(max(m, 1), 64), bf16(256, 64), splits=list(ex.send), config=config)
    assert taken == [ex, ex]
    assert "sequential: a rank has no rows" in caplog.text


@pytest.mark.parametrize("given", [False, True], ids=["exchanged", "rows_per_rank"])
def test_ranks_with_different_m_decide_on_the_largest_and_share_its_columns(one_rank_group, monkeypatch, given):
    """Ranks whose M differ (known to all where the counts were exchanged, or given as
    ``rows_per_rank``: then nothing is exchanged) make every choice on the largest M, and plan their
    own groups on that M's tile columns; only layouts of whole columns."""
    from flashoverlap import comm, overlap
    from flashoverlap.plan import make_plan

    # the largest M's grid takes as many waves with the defaults' budget as without (no late
    # candidate), this rank's own would not: every rank must time the same candidates
    m, n, k, largest = 1000, 4096, 64, 2500
    ex = comm.Exchange("all_to_all", (500, 500), (500, 1500), 2000, uniform=False, sources=(m, largest))
    shared = make_plan(largest, n, tile_m=128, tile_n=256, cluster_m=1, ctas=16, layout="cols").column_groups
    seen = []

    def prepare(*args):
        seen.append(("prepare", args[0], args[-1]))
        plan = make_plan(m, n, tile_m=128, tile_n=256, cluster_m=1, ctas=16, layout="cols", column_groups=args[-1])
        return overlap.Prepared(plan, *(None,) * 5, 132, None)

    monkeypatch.setattr(overlap, "_trials", type(overlap._trials)())
    monkeypatch.setattr(overlap, "world_size", lambda group: 2)
    monkeypatch.setattr(overlap, "check_inputs", lambda a, w, layout: (m, n, k))
    counts = {"splits": [500, 500]}
    if given:
        counts.update(output_splits=[500, 1500], rows_per_rank=[m, largest])
        monkeypatch.setattr(comm, "all_gather_single", lambda *args, **kwargs: pytest.fail("counts exchanged"))
    else:
        monkeypatch.setattr(comm, "exchange", lambda *args, **kwargs: ex)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(comm, "cuda_backend", lambda group: "nccl")
    monkeypatch.setattr(overlap, "tuned_config", lambda a, world, ex, shape, p2p: seen.append(("tuned", shape)))
    monkeypatch.setattr(overlap, "one_wave", lambda cfg, m, n, device: seen.append(("one_wave", m)) and False)
    monkeypatch.setattr(overlap, "shared_columns", lambda *args: seen.append(("columns", args[0])) or shared)
    monkeypatch.setattr(overlap, "prepare", prepare)
    monkeypatch.setattr(overlap, "check_agreement", lambda *args: None)
    monkeypatch.setattr(overlap, "budget_communicator", lambda *args: None)
    monkeypatch.setattr(comm, "tail_group", lambda group, device: group)
    monkeypatch.setattr(overlap, "trial", lambda *args: seen.append(("trial", args[-2], len(args[0]))) or 0)
    monkeypatch.setattr(overlap, "run_overlapped", lambda prep, *args, **kwargs: seen.append(("run", prep.plan)))
    flashoverlap.gemm_all_to_all(bf16(m, k), bf16(n, k), **counts)
    plan = seen[-1][1]
    assert seen[:-1] == [
        ("tuned", (largest, n, k)),
        ("one_wave", largest),
        ("columns", largest),
        ("prepare", m, shared),
        ("trial", largest, 1),
    ]
    assert plan.m == m and plan.column_groups == shared
    for config in ({"layout": "rows"}, {"layout": "segments"}, {"symmetric": True}):
        with pytest.raises(ValueError, match=r"different M \(\[1000, 2500\] rows\): their groups are whole tile"):
            flashoverlap.gemm_all_to_all(bf16(m, k), bf16(n, k), **counts, config=config)


def test_a_gloo_group_takes_no_point_to_point_layout(one_rank_group, monkeypatch):
    """gloo carries CUDA tensors in collectives but not point to point: the ``rows`` layout of
    reduce-scatter / all-to-all is refused before anything runs (a registry entry falls back)."""
    from flashoverlap import overlap

    monkeypatch.setattr(overlap, "world_size", lambda group: 2)
    monkeypatch.setattr(overlap, "check_inputs", lambda a, w, layout: (4096, 4096, 512))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for fn in ENTRY_POINTS[1:]:
        with pytest.raises(ValueError, match="layout 'rows' sends .* point to point, which a gloo group cannot"):
            fn(bf16(64, 64), bf16(64, 64), config={"layout": "rows"})


def agreement_worker(rank: int, world: int, store_path: str):
    from flashoverlap import comm, overlap
    from flashoverlap.plan import make_plan

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        agreed = []
        real_agree = comm.agree
        comm.agree = lambda *args: agreed.append(args[1]) or real_agree(*args)
        overlap._agreed.clear()
        sources = (3000, 1000)
        ex = comm.Exchange("all_to_all", (500, 500), (500, 500), 1000, uniform=False, sources=sources)
        shared = make_plan(3000, 1024, tile_m=128, tile_n=256, cluster_m=1, ctas=8, layout="cols").column_groups
        for m in (sources[rank], sources[rank] // 2 if rank else sources[rank]):  # rank 1's own plan changes
            plan = make_plan(m, 1024, tile_m=128, tile_n=256, cluster_m=1, ctas=8, layout="cols", column_groups=shared)
            prep = overlap.Prepared(plan, SimpleNamespace(spec="spec"), None, torch.zeros(1), *(None,) * 4)
            overlap.check_agreement(prep, "all_to_all", dist.group.WORLD, ex, ("all_to_all", "ragged", 1024))
        assert len(agreed) == 1, agreed  # once per kind of call, on every rank alike
        dist.barrier()  # gloo: a rank leaving right after an all-gather can break its peer's last receive
    finally:
        dist.destroy_process_group()


def test_ranks_agree_once_per_call_whatever_plans_each_keeps():
    """Whether a call's ranks check their agreement (a collective) must not rest on this rank's own
    plans: ranks whose M differ keep different ones, and one checking alone would hang."""
    spawn_ranks(2, agreement_worker, timeout=120)


def test_no_process_group_is_kept_past_exit(one_rank_group):
    """The exit hook (overlap._forget) lets go of the groups flashoverlap's caches hold: one alive
    as the interpreter finalizes aborted the test above's ranks now and then (~1 exit in 50)."""
    import gc
    import weakref

    from flashoverlap.plan import make_plan

    group = dist.new_group([0])
    plan = make_plan(256, 256, tile_m=128, tile_n=256, cluster_m=1, ctas=2)
    prep = overlap.Prepared(plan, SimpleNamespace(spec="spec"), None, torch.zeros(1), *(None,) * 4)
    overlap.check_agreement(prep, "all_reduce", group, comm.exchange("all_reduce", 256, 1), ("all_reduce", 256))
    held = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    assert held() is not None  # the agreement kept it
    overlap._forget()
    gc.collect()
    assert held() is None


def test_a_trial_holds_for_every_m_of_its_power_of_two(one_rank_group, monkeypatch):
    from flashoverlap import bench, overlap
    from flashoverlap.plan import make_plan

    trials, ran = [], []

    def time_variants(variants, rounds, block, warmup, group=None, graphs=False):
        trials.append((plans[-1].m, graphs))
        overlapped = math.nan if graphs else 0.5  # NaN: as if a rank could not capture the overlapped calls
        return {name: 1.0 if name == "sequential" else overlapped for name in variants}

    plans = []

    def prepare(m, n, *args):
        plans.append(make_plan(m, n, tile_m=128, tile_n=256, cluster_m=1, ctas=1, partition=None, layout="rows"))
        return overlap.Prepared(plans[-1], *(None,) * 5, 132, None)

    monkeypatch.setattr(overlap, "_trials", type(overlap._trials)())
    monkeypatch.setattr(overlap, "world_size", lambda group: 2)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # CPU tensors stand in
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(overlap, "tuned_config", lambda *args: None)
    monkeypatch.setattr(overlap, "prepare", prepare)
    monkeypatch.setattr(overlap, "one_wave", lambda *args: False)
    monkeypatch.setattr(overlap, "check_agreement", lambda *args: None)
    monkeypatch.setattr(overlap, "budget_communicator", lambda *args: None)
    monkeypatch.setattr(overlap, "run_overlapped", lambda *args, **kwargs: ran.append(args[1].shape[0]))
    monkeypatch.setattr(bench, "time_variants", time_variants)
    monkeypatch.setattr(overlap, "check_inputs", lambda a, w, layout: (a.shape[0], *w.shape))
    monkeypatch.delenv("FLASHOVERLAP_TIMING", raising=False)
    for m in (512, 700, 1023, 1024, 600, 512):
        flashoverlap.gemm_all_reduce(bf16(m, 64), bf16(256, 64))
    flashoverlap.gemm_all_reduce(bf16(512, 128), bf16(256, 128))  # another K: its own trial
    assert trials == [(512, False), (1024, False), (512, False)] and len(ran) == 7
    # calls replayed as CUDA graphs are timed so, apart from the eager answer; one no rank could
    # capture is not picked
    monkeypatch.setenv("FLASHOVERLAP_TIMING", "graphs")
    flashoverlap.gemm_all_reduce(bf16(700, 64), bf16(256, 64))
    assert trials[-1] == (700, True) and len(ran) == 7


def test_an_auto_layout_takes_segments_where_they_carry_the_call():
    """Your config, a registry entry and the defaults alike: ``config={}`` runs what a call without
    config starts from."""
    from flashoverlap import comm
    from flashoverlap.config import OverlapConfig
    from flashoverlap.overlap import for_call, rotation_unit

    auto, shape = OverlapConfig(), (4096, 4096, 1024)
    even = comm.exchange("reduce_scatter", 4096, 2)
    assert for_call(auto, even, shape).layout == "segments"
    assert for_call(OverlapConfig(comm_sms=24, kernel="sm80"), even, shape) == OverlapConfig(
        comm_sms=24, kernel="sm80", layout="segments"
    )
    assert for_call(auto, comm.exchange("all_to_all", 4096, 4), shape).layout == "segments"
    assert for_call(auto, comm.exchange("reduce_scatter", 4000, 2), (4000, 4096, 1024)).layout == "cols"
    uneven = comm.exchange("all_to_all", 4096, 2, splits=[1024, 3072], output_splits=[1024, 1024])
    assert for_call(auto, uneven, shape).layout == "cols"
    assert for_call(auto, comm.exchange("all_reduce", 4096, 2), shape).layout == "rows"
    # even here, but other ranks' splits unknown: what all ranks choose alike cannot rest on it
    given = comm.exchange("all_to_all", 4096, 2, splits=[2048, 2048], output_splits=[2048, 2048])
    assert for_call(auto, given, shape).layout == "cols"
    assert for_call(OverlapConfig(scheduler="streamk"), even, shape).layout == "cols"  # no interleaved schedule
    for layout in ("cols", "rows", "segments"):  # a layout given is kept
        assert for_call(OverlapConfig(layout=layout), even, shape).layout == layout
    # the TMA epilogue stores rows: an auto layout with it runs segments alone, and a call that
    # segments cannot carry is refused before any launch (comm.check_layout) instead of as a config
    tma = OverlapConfig(epilogue="tma")
    assert for_call(tma, even, shape) == OverlapConfig(epilogue="tma", layout="segments")
    assert for_call(tma, uneven, shape).layout == "segments"
    with pytest.raises(ValueError, match="layout 'segments' runs"):
        comm.check_layout(uneven, "segments", rotation_unit(tma, shape))


def test_an_auto_layout_that_no_layout_can_run_names_both():
    from flashoverlap.config import OverlapConfig, resolutions, takes_every_call

    with pytest.raises(
        ValueError, match="neither takes it: as 'segments': .*persistent.*; as 'cols': .*epilogue 'tma'"
    ):
        resolutions(OverlapConfig(epilogue="tma", scheduler="streamk"), "all_to_all")
    # what a registry entry's config must be to stand in for every call
    assert takes_every_call(OverlapConfig(), "all_to_all")  # cols where segments cannot carry
    assert not takes_every_call(OverlapConfig(epilogue="tma"), "all_to_all")  # segments or nothing


def test_one_wave_counts_tiles_against_the_sms_left(monkeypatch):
    from types import SimpleNamespace

    from flashoverlap.overlap import OverlapConfig, one_wave

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    cfg = OverlapConfig()  # 128x256 tiles, 16 SMs for NCCL: 116 tiles a wave
    assert one_wave(cfg, 128, 256 * 116, None) and one_wave(cfg, 1, 1, None)
    assert not one_wave(cfg, 129, 256 * 116, None) and not one_wave(cfg, 128, 256 * 116 + 1, None)
    assert one_wave(OverlapConfig(comm_sms=0), 128, 256 * 132, None)


def compiled(fn, *args, grad: bool = False):
    """``fn(*args)`` compiled with ``fullgraph=True`` (a graph break fails) on fake CUDA tensors (no
    GPU needed: the graph is traced, and run on fake tensors), which require gradients where
    ``grad``; its output and the traced graph."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with FakeTensorMode(shape_env=ShapeEnv()):
        fake = [torch.empty(a.shape, dtype=a.dtype, device="cuda", requires_grad=grad) for a in args]
        out = torch.compile(fn, fullgraph=True, backend=keep)(*fake)
    (graph,) = graphs
    return out, graph


def op_calls(graph) -> list[tuple]:
    """The arguments after the tensors of every flashoverlap operator in ``graph``."""
    op = torch.ops.flashoverlap.gemm_collective
    return [node.args[2:] for node in graph.graph.nodes if node.target in (op, op.default)]


def compile_worker(rank: int, world: int, store_path: str):
    from flashoverlap import OverlapConfig
    from flashoverlap.config import resolve
    from flashoverlap.overlap import _config_of

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        torch._dynamo.config.capture_dynamic_output_shape_ops = True  # the ragged all-to-all's rows
        a, w = bf16(64, 32), bf16(48, 32)
        pair = dist.new_group([0, 1])  # not the default group: its name reaches the operator
        assert world == 2
        yaml_path = registry.SHIPPED / "example.yaml"
        cases = [  # every kind of config: a dict, a YAML path, an OverlapConfig
            (flashoverlap.gemm_all_reduce, {"config": {"comm_sms": 4}}, (64, 48)),
            (flashoverlap.gemm_all_reduce, {"config": yaml_path}, (64, 48)),
            (flashoverlap.gemm_reduce_scatter, {"group": pair, "config": OverlapConfig(layout="cols")}, (32, 48)),
            (flashoverlap.gemm_all_to_all, {}, (64, 48)),
            (flashoverlap.gemm_all_to_all, {"splits": [40, 24], "output_splits": [40, 8]}, (48, 48)),
            (flashoverlap.gemm_all_to_all, {"splits": [40, 24]}, None),  # rows known once exchanged
            (
                flashoverlap.gemm_all_to_all,
                {"splits": [40, 24], "output_splits": [40, 8], "rows_per_rank": [64, 48]},
                (48, 48),
            ),
        ]
        for fn, kwargs, shape in cases:
            out, graph = compiled(lambda a, w, fn=fn, kwargs=kwargs: fn(torch.relu(a), w, **kwargs) * 2, a, w)
            if shape is None:
                assert isinstance(out.shape[0], torch.SymInt) and out.shape[1] == 48, out.shape
            else:
                assert tuple(out.shape) == shape and out.device.type == "cuda", (fn.__name__, out.shape)
            ((collective, group, config, layout, *counts),) = op_calls(graph)
            assert collective == fn.__name__.removeprefix("gemm_") and layout == "nk"
            assert group == (pair if "group" in kwargs else dist.group.WORLD).group_name
            assert counts == [kwargs.get(key) for key in ("splits", "output_splits", "rows_per_rank")]
            wanted = kwargs.get("config")
            assert _config_of(config) == (None if wanted is None else resolve(wanted)), config
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_compiled_calls_are_one_operator_in_the_graph():
    """Under torch.compile every entry point is one ``flashoverlap::gemm_collective`` node (no graph
    break) with its output's shape, and its group and config reach it intact."""
    spawn_ranks(2, compile_worker, timeout=240)


def test_compiled_configs_are_what_the_eager_call_would_use(one_rank_group, tmp_path):
    from flashoverlap import OverlapConfig
    from flashoverlap.config import resolve
    from flashoverlap.overlap import _config_of, _config_text

    path = tmp_path / "c.yaml"
    path.write_text("comm_sms: 8\npartition: [2, 3]\nlayout: cols\n")
    for config in [{}, {"partition": [1, 2], "tile_k": 32}, OverlapConfig(symmetric=True), str(path), path]:
        assert _config_of(_config_text(config)) == resolve(config)
    assert _config_of(_config_text(None)) is None  # the registry's, decided per call


def test_compiled_calls_refuse_bad_input_while_traced(one_rank_group):
    with pytest.raises(RuntimeError, match="tile_m 96 not in"):
        compiled(lambda a, w: flashoverlap.gemm_all_reduce(a, w, config={"tile_m": 96}), bf16(64, 32), bf16(48, 32))
    with pytest.raises(RuntimeError, match="K mismatch"):
        compiled(flashoverlap.gemm_all_reduce, bf16(64, 32), bf16(48, 40))
    with pytest.raises(RuntimeError, match="needs output_splits"):  # its backward must send rows back
        compiled(lambda a, w: flashoverlap.gemm_all_to_all(a, w, splits=[64]), bf16(64, 32), bf16(48, 32), grad=True)
    # run eagerly, the operator checks as the call does
    with pytest.raises(ValueError, match="a is on cpu, expected a cuda tensor"):
        torch.ops.flashoverlap.gemm_collective(bf16(64, 32), bf16(48, 32), "all_reduce", "0", "", "nk", None, None)


def gradient_worker(rank: int, world: int, store_path: str):
    from flashoverlap.overlap import with_gradients

    from .helpers import check_gradients

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        check_gradients(rank, world, with_gradients, "cpu")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_of_every_collective(world):
    """The calls' autograd (the same Function on CUDA; here its CPU path over gloo): every rank's
    gradients of one global loss against those of the unsharded problem, every collective and
    all-to-all's ways of giving its counts."""
    spawn_ranks(world, gradient_worker, timeout=240)


def test_a_call_that_needs_gradients_still_refuses_cpu_tensors(one_rank_group):
    a = bf16(64, 64).requires_grad_()
    with pytest.raises(ValueError, match="a is on cpu, expected a cuda tensor"):
        flashoverlap.gemm_all_reduce(a, bf16(64, 64))


def test_a_repeated_call_reuses_its_decision_until_what_it_rests_on_changes(one_rank_group, monkeypatch):
    """decide() is kept per call kind: a repeated call looks up neither registry nor plans, while
    another shape, config, environment (DECISION_ENV) or registry.reload() decides afresh, and a
    call whose counts are exchanged decides every time."""
    from flashoverlap import overlap, registry
    from flashoverlap.config import OverlapConfig

    lookups = []

    def tuned_config(a, world, ex, shape, p2p=True):
        lookups.append(shape)
        return Found(OverlapConfig(sequential=True), True)

    monkeypatch.setattr(overlap, "world_size", lambda group: 2)
    monkeypatch.setattr(overlap, "check_inputs", lambda a, w, layout: (a.shape[0], *w.shape))
    monkeypatch.setattr(overlap, "tuned_config", tuned_config)
    monkeypatch.setattr(overlap.comm, "cuda_backend", lambda group: "nccl")
    monkeypatch.delenv("FLASHOVERLAP_NCCL", raising=False)
    a, w = bf16(256, 64), bf16(128, 64)
    exchanged = []
    first = overlap.decide(a, w, "all_reduce", exchanged=exchanged)
    assert overlap.decide(a, w, "all_reduce", exchanged=exchanged) is first and len(lookups) == 1
    assert exchanged == [first.ex, first.ex]  # (the gradients need it on every call)
    overlap.decide(bf16(512, 64), w, "all_reduce")  # another M
    overlap.decide(a, w, "all_reduce", config={"sequential": True})  # a config: no lookup, its own decision
    assert overlap.decide(a, w, "all_reduce", config={"sequential": True}).config is None and len(lookups) == 2
    monkeypatch.setenv("FLASHOVERLAP_NCCL", "c10d")
    overlap.decide(a, w, "all_reduce")
    registry.reload()
    overlap.decide(a, w, "all_reduce")
    overlap.decide(a, w, "all_reduce")
    assert len(lookups) == 4
    for _ in range(2):  # counts exchanged per call (here: known, not exchanged, but never kept)
        overlap.decide(a, w, "all_to_all", splits=[128, 128], output_splits=[128, 128])
    assert len(lookups) == 6


def test_a_call_is_recorded_for_replay_only_where_its_tensors_do_not_overlap():
    assert overlap._disjoint([(0x1000, 0x100), (0x1100, 0x10), (0x2000, 8)])
    assert not overlap._disjoint([(0x1000, 0x100), (0x10F0, 0x10)])  # (a view into another operand)
    assert not overlap._disjoint([(0x1000, 0x100), (0x1000, 0x100)])  # (a and weight one tensor)
    assert not overlap._disjoint([(0, 0), (0, 0)])  # two empty tensors share address 0


def test_the_decision_key_follows_the_environment(monkeypatch):
    names = ("FLASHOVERLAP_TEST_A", "FLASHOVERLAP_TEST_B")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    unset = overlap._environment(names)
    monkeypatch.setenv("FLASHOVERLAP_TEST_B", "1")
    one = overlap._environment(names)
    monkeypatch.setenv("FLASHOVERLAP_TEST_B", "2")
    assert unset == (None, None) and len({unset, one, overlap._environment(names)}) == 3
    monkeypatch.setenv("FLASHOVERLAP_TEST_B", "1")
    assert overlap._environment(names) == one


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_a_group_that_is_no_process_group_is_named(fn):
    """(Was: "cannot create weak reference to 'str' object" from deep inside.) Before any check that
    needs torch.distributed set up."""
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup or None, got str 'tp'"):
        fn(bf16(64, 64), bf16(64, 64), group="tp")
