"""Which path a call takes, and with which config (CPU: gloo, CPU tensors standing in for CUDA ones)."""

import contextlib
import logging
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import flashoverlap
from flashoverlap import comm, decision, registry, rules, runtime, state, timing
from flashoverlap.config import OverlapConfig
from flashoverlap.inputs import Fp8
from flashoverlap.prepared import Prepared
from flashoverlap.registry import Found

from .helpers import ENTRY_POINTS, bf16, spawn_ranks


@pytest.fixture(autouse=True)
def _fresh(fresh_state, one_host):
    """Every test here starts without decisions, trials or logged lines of the others, its ranks on
    one host."""


def plain_records(monkeypatch, record) -> None:
    """Calls decided plain run ``record(a, weight, weight_layout, ex, group)`` (runtime.sequential's
    arguments) instead."""

    def plain(ex, group, layout, world, fp8=None):
        return lambda a, w, scales=None: record(a, w, layout, ex, group)

    monkeypatch.setattr(runtime, "plain", plain)


def timings(monkeypatch, time_variants) -> None:
    """The trial's timings from ``time_variants(variants, rounds, block, warmup, group=, graphs=)``
    ({variant: ms per call}) as four equal rounds of one rank, on the call's own operands only (the
    trial asking for rounds no faster than the host enqueued them)."""

    def time_samples(variants, rounds, block, warmup, group=None, graphs=False, host_floor=False):
        assert host_floor, "the trial times the host's pace too"
        times = time_variants(variants, rounds, block, warmup, group=group, graphs=graphs)
        return {name: [[t] * 4] for name, t in times.items()}

    monkeypatch.setattr(timing, "time_samples", time_samples)
    monkeypatch.setattr(decision, "_operands", lambda a, weight: {"hot": ([a], [weight])})


def test_a_config_without_a_kernel_on_this_gpu_fails_before_any_communication(monkeypatch):

    monkeypatch.setattr(decision, "check_inputs", lambda a, w, layout: (64, 64, 64))
    monkeypatch.setattr(decision, "world_size", lambda group: 2)
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
    from flashoverlap.plan import make_plan

    plan = make_plan(128 * waves, 256, tile_m=128, tile_n=256, cluster_m=1, ctas=1, partition=None, layout="rows")
    prep = Prepared(plan, *(None,) * 5, 132, None)
    taken, trials = [], []

    def time_variants(variants, rounds, block, warmup, group=None, graphs=False):
        trials.append(sorted(variants))
        return {name: 1.0 if name == "sequential" else trial for name in variants}

    if env is not None:
        monkeypatch.setenv("FLASHOVERLAP_TRIAL", env)
    monkeypatch.setenv("FLASHOVERLAP_LOG", "1")
    monkeypatch.setattr(decision, "check_inputs", lambda a, w, layout: (plan.m, plan.n, 64))
    monkeypatch.setattr(decision, "world_size", lambda group: 2)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # CPU tensors stand in
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(
        decision,
        "tuned_config",
        lambda *args: None if tuned is None else Found(OverlapConfig(**tuned[0]), tuned[1]),
    )
    monkeypatch.setattr(decision, "prepare", lambda *args, **kw: taken.append("planned") or prep)
    monkeypatch.setattr(decision, "one_wave", lambda cfg, m, n, device: m <= 128)  # the plan's one CTA
    monkeypatch.setattr(decision, "check_agreement", lambda *args: None)
    monkeypatch.setattr(decision, "budget_communicator", lambda *args: None)
    plain_records(monkeypatch, lambda *args: taken.append("sequential"))
    monkeypatch.setattr(runtime, "run_overlapped", lambda *args, **kwargs: taken.append("overlapped"))
    timings(monkeypatch, time_variants)
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


def untuned_all_reduce(monkeypatch, m: int, n: int) -> dict:
    """An all-reduce of [m, 64] x [n, 64] on two ranks without a tuned config, planned on 132 SMs in
    128 x 256 tiles, nothing checked with the other rank: the plans made, by (late_budget, reduction)."""
    from flashoverlap.plan import make_plan

    preps = {}

    def prepare(m, n, k, dtype, layout, device, cfg, *args, **kwargs):
        sms = 132 if cfg.late_budget else 132 - cfg.comm_sms
        plan = make_plan(m, n, tile_m=128, tile_n=256, cluster_m=1, ctas=sms, layout="rows", keep=132 - cfg.comm_sms)
        return preps.setdefault((cfg.late_budget, cfg.reduction), Prepared(plan, *(None,) * 5, sms, None))

    monkeypatch.setattr(decision, "world_size", lambda group: 2)
    monkeypatch.setattr(decision, "check_inputs", lambda a, w, layout: (m, n, 64))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(decision, "tuned_config", lambda *args: None)
    monkeypatch.setattr(decision, "one_wave", lambda *args: False)
    monkeypatch.setattr(decision, "prepare", prepare)
    monkeypatch.setattr(decision, "check_agreement", lambda *args: None)
    return preps


def test_a_timed_call_runs_the_fastest_candidate(one_rank_group, monkeypatch, caplog):
    """A call without a tuned config times the defaults, the same with its SM budget late
    (rules.alternative) and sequential once; the fastest runs, with its own plan and communicator.
    At DEBUG the trial's rounds are logged, variant by variant (rank by rank, round by round)."""

    m, n = 4096, 8192
    ran = []
    preps = untuned_all_reduce(monkeypatch, m, n)
    monkeypatch.setattr(decision, "budget_communicator", lambda cfg, *args: f"budget {cfg.comm_sms}")
    monkeypatch.setattr(runtime, "run_overlapped", lambda prep, a, w, ex, budget, **kw: ran.append((prep, budget)))
    times = {"sequential": 1.0, "overlapped, comm_sms 16": 0.95, "overlapped, comm_sms 16 late": 0.9}
    timings(monkeypatch, lambda variants, *args, **kwargs: {v: times[v] for v in variants})
    with caplog.at_level(logging.DEBUG, logger="flashoverlap"):
        for _ in range(2):
            flashoverlap.gemm_all_reduce(bf16(m, 64), bf16(n, 64))
    late = preps[True, "nccl"]
    assert ran == [(late, "budget 16")] * 2 and len(state.of(None).trials) == 1
    rounds = [line for line in caplog.messages if line.startswith("trial of all_reduce 4096x8192, hot, ")]
    assert sorted(rounds) == sorted(
        f"trial of all_reduce 4096x8192, hot, {name}: {' '.join([f'{t:.3f}'] * 4)} ms per call"
        for name, t in times.items()
    )
    assert (late.plan.after, late.plan.partition) == (6, (6, 1, 1))
    chosen = decision.decide(bf16(m, 64), bf16(n, 64), "all_reduce")
    assert chosen.config.late_budget and chosen.prep is late


def fp8_operands(m: int, n: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """FP8 operands [m, 64] x [n, 64] (CPU tensors stand in) and their per-tensor scales as keywords."""
    a, w = (torch.randn(rows, 64).to(torch.float8_e4m3fn) for rows in (m, n))
    return a, w, {"scale_a": torch.ones(1), "scale_b": torch.full((1,), 0.5)}


def test_an_fp8_call_is_timed_and_run_with_its_scales(one_rank_group, monkeypatch):
    """An untuned FP8 call on Hopper plans its kernels (FP8's default 256 x 128 tiles, not 16-bit's
    128 x 256, whatever the accumulation) for its result's dtype, times its
    candidates and the plain ``torch._scaled_mm`` with the call's scales, and runs with each call's
    own scales; a call of another result dtype or accumulation is another kind (decided apart)."""
    m, n = 4096, 8192
    planned, timed, ran = [], [], []
    untuned_all_reduce(monkeypatch, m, n)
    inner = decision.prepare

    def prepare(*args, **kw):
        planned.append((args[3], (args[6].tile_m, args[6].tile_n), kw["fp8"]))
        return inner(*args, **kw)

    monkeypatch.setattr(decision, "prepare", prepare)
    monkeypatch.setattr(decision, "budget_communicator", lambda *args: "budget")
    monkeypatch.setattr(runtime, "run_overlapped", lambda prep, a, w, ex, b, **kw: ran.append(kw["scales"]))
    made = []  # the plain runner, made once per trial as a call decided plain makes it (not per timed call)

    def plain(ex, group, layout, world, fp8):
        made.append(fp8)
        return lambda a, w, s: timed.append((s, fp8))

    monkeypatch.setattr(runtime, "plain", plain)

    def time_variants(variants, *args, **kwargs):
        for run in variants.values():
            run(0)
            run(1)
        return {name: 1.0 if name == "sequential" else 0.9 for name in variants}

    timings(monkeypatch, time_variants)
    a, w, scales = fp8_operands(m, n)
    flashoverlap.gemm_all_reduce(a, w, **scales)
    again = {"scale_a": torch.ones(1), "scale_b": torch.ones(1)}
    flashoverlap.gemm_all_reduce(a, w, **again)
    assert set(planned) == {(torch.float8_e4m3fn, (256, 128), Fp8(torch.bfloat16))}
    assert [(s.a, s.b) for s in ran[-2:]] == [tuple(scales.values()), tuple(again.values())]
    assert [(s.a, s.b, kind) for s, kind in timed] == [(*scales.values(), Fp8(torch.bfloat16))] * 2
    assert made == [Fp8(torch.bfloat16)]
    flashoverlap.gemm_all_reduce(a, w, **scales, out_dtype=torch.float16)
    assert planned[-1] == (torch.float8_e4m3fn, (256, 128), Fp8(torch.float16))
    assert timed[-1][1] == Fp8(torch.float16)
    flashoverlap.gemm_all_reduce(a, w, **scales, use_fast_accum=True)
    fast = Fp8(torch.bfloat16, fast_accum=True)
    assert planned[-1] == (torch.float8_e4m3fn, (256, 128), fast) and timed[-1][1] == fast


def test_fp8_calls_are_refused_before_communicating_where_no_fp8_kernel_runs(one_rank_group, monkeypatch):
    """FP8 needs FP8 tensor cores (Ada, sm_89, on); an explicit config's K tile must be one an FP8
    kernel there takes (Hopper's may run the sm80 family when asked, as Ada's do): refused before
    anything is communicated."""
    capability = [(8, 0)]
    monkeypatch.setattr(decision, "world_size", lambda group: 2)
    monkeypatch.setattr(decision, "check_inputs", lambda a, w, layout: (4096, 8192, 64))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(comm, "exchange", lambda *args, **kwargs: pytest.fail("communicated before refusing"))
    a, w, scales = fp8_operands(4096, 8192)
    with pytest.raises(ValueError, match="FP8 tensor cores .* is sm_80"):
        flashoverlap.gemm_all_to_all(a, w, **scales)
    for capability[0], config in [((8, 9), {"tile_k": 32}), ((9, 0), {"kernel": "sm80", "tile_k": 32})]:
        with pytest.raises(ValueError, match=r"tile_k 32 not in \(64,\) \(sm80 kernels\)"):  # (8 bits: K >= 64)
            flashoverlap.gemm_all_reduce(a, w, **scales, config=config)
    with pytest.raises(ValueError, match=r"tile_k 64 not in \(128,\)"):  # (Hopper's FP8 K tile)
        flashoverlap.gemm_all_reduce(a, w, **scales, config={"tile_k": 64})
    # rowwise scales: the sm90 kernels' direct epilogue only
    rowwise = {"scale_a": torch.ones(4096, 1), "scale_b": torch.ones(1, 8192)}
    for capability[0], config, message in [
        ((9, 0), {"epilogue": "tma"}, "need epilogue 'direct'"),
        ((9, 0), {"kernel": "sm80"}, "need the sm90 kernels"),
        ((8, 9), {}, "need the sm90 kernels"),
    ]:
        with pytest.raises(ValueError, match=message):
            flashoverlap.gemm_all_reduce(a, w, **rowwise, config=config)


def test_fp8_tiles_that_spill_with_promoted_sums_are_warned_of(one_rank_group, monkeypatch, caplog):
    """Hopper's FP8 128x256 tiles spill registers with promoted sums (rules.spills_promoted): a config
    asking for them runs, warned once (not with fast accumulation, nor in FP8's own 256x128)."""

    class Planned(Exception):
        pass

    monkeypatch.setattr(decision, "world_size", lambda group: 2)
    monkeypatch.setattr(decision, "check_inputs", lambda a, w, layout: (4096, 8192, 256))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(comm, "exchange", lambda *args, **kwargs: (_ for _ in ()).throw(Planned()))
    a, w, scales = fp8_operands(4096, 8192)
    warned = []
    decision._warn_spills.cache_clear()
    for config, fast in [({"tile_n": 256}, False), ({"tile_n": 256}, False), ({"tile_n": 256}, True), ({}, False)]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="flashoverlap.decision"), pytest.raises(Planned):
            flashoverlap.gemm_all_reduce(a, w, **scales, config={"reduction": "pull", **config}, use_fast_accum=fast)
        warned.append(any("128x256 tiles with promoted sums" in r.message for r in caplog.records))
    assert warned == [True, False, False, False]


def test_ada_fp8_calls_run_plain_unless_a_config_asks_for_the_sm80_family(one_rank_group, monkeypatch):
    """Ada's FP8 overlap is opt-in (its kernels unmeasured there): without config= the plain
    torch._scaled_mm and collective, with one the sm80 family's FP8 kernel, in FP8's tiles where the
    config names none."""

    class Planned(Exception):
        pass

    def prepare(*args, **kw):
        planned.append(args[6])
        raise Planned

    planned, taken = [], []
    a, w, scales = fp8_operands(4096, 8192)
    untuned_all_reduce(monkeypatch, 4096, 8192)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    monkeypatch.setattr(decision, "prepare", prepare)
    monkeypatch.setattr(decision, "budget_communicator", lambda *args: "budget")
    monkeypatch.setattr(runtime, "plain", lambda *args: lambda a, w, scales: taken.append(scales))
    flashoverlap.gemm_all_reduce(a, w, **scales)
    assert len(taken) == 1 and not planned
    with pytest.raises(Planned):
        flashoverlap.gemm_all_reduce(a, w, **scales, config={})
    assert planned[0].kernel == "auto" and rules.for_device(planned[0], (8, 9))[0].kernel == "sm80"
    # a config naming no tile takes FP8's (config.FP8_TILES); an OverlapConfig is taken as it is
    assert (planned[0].tile_m, planned[0].tile_n) == (256, 128)
    with pytest.raises(Planned):
        flashoverlap.gemm_all_reduce(a, w, **scales, config=flashoverlap.OverlapConfig(comm_sms=8))
    assert (planned[1].tile_m, planned[1].tile_n, planned[1].comm_sms) == (128, 256, 8)


def test_fp8_calls_have_no_backward(one_rank_group, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    a, w, scales = fp8_operands(64, 64)
    with pytest.raises(ValueError, match="FP8 calls have no backward"):
        flashoverlap.gemm_all_reduce(a, w.requires_grad_(), **scales)


def pulls_possible(monkeypatch) -> list:
    """The ranks may pull (comm.peer.unavailable says nothing against it); communicators are named
    for their reduction and SM budget, the last group's "tail"; overlapped calls are not run but
    listed, as (exchange, budget communicator, tail communicator), in the list returned."""
    ran = []
    monkeypatch.setattr(decision, "budget_communicator", lambda cfg, *args: f"budget {cfg.reduction} {cfg.comm_sms}")
    monkeypatch.setattr(comm, "tail_group", lambda *args: "tail")
    monkeypatch.setattr(comm.peer, "unavailable", lambda group, device: None)
    monkeypatch.setattr(
        runtime, "run_overlapped", lambda prep, a, w, ex, b, tail_group, **kw: ran.append((ex, b, tail_group))
    )
    return ran


def test_where_the_ranks_can_pull_a_timed_all_reduce_times_the_pull_too(one_rank_group, monkeypatch):
    """A call without a tuned config also times its config as a pull all-reduce (rules.pulled)
    where comm.peer.unavailable allows; a winning pull runs with its own exchange, its copies and
    no NCCL communicator for the last group."""

    m, n = 4096, 8192
    untuned_all_reduce(monkeypatch, m, n)
    ran = pulls_possible(monkeypatch)
    times = {
        "sequential": 1.0,
        "overlapped, comm_sms 16": 0.95,
        "overlapped, comm_sms 16 late": 0.9,
        "overlapped, comm_sms 4 pull": 0.85,  # 1024 tiles: 8 waves on 128 SMs as on 132
    }
    seen = []
    timings(monkeypatch, lambda variants, *args, **kw: seen.append(sorted(variants)) or {v: times[v] for v in variants})
    flashoverlap.gemm_all_reduce(bf16(m, 64), bf16(n, 64))
    assert seen == [sorted(times)]
    ((ex, budget, tail),) = ran
    assert ex.reduction == "pull" and ex.recv == (m, m) and budget == "budget pull 4" and tail is None
    # where they cannot pull, not timed
    monkeypatch.setattr(state, "_states", {})
    monkeypatch.setattr(comm.peer, "unavailable", lambda group, device: "no peer access")
    flashoverlap.gemm_all_reduce(bf16(m, 64), bf16(n, 64))
    assert seen[-1] == ["overlapped, comm_sms 16", "overlapped, comm_sms 16 late", "sequential"]


def test_a_reduce_scatter_tuned_for_another_shape_times_its_pull_whatever_the_entry_s_layout(
    one_rank_group, monkeypatch
):
    """The nearest entry of a reduce-scatter may be NCCL in the ``rows`` layout (late, in a window):
    its pull is then timed in the pulls' ``segments`` layout (rules.pulled), planned as that layout
    is (interleaved over the ranks, not rotated as the hint's rows are), and may win; on Hopper also
    with its sums in the epilogue (rules.fused_pull: rotated rows, groups split at the segments)."""
    m, n = 4096, 8192
    untuned_all_reduce(monkeypatch, m, n)
    stub, plans = decision.prepare, []

    def prepare(*args, **kwargs):  # (m, n, k, dtype, layout, device, cfg, rotate, interleave, columns)
        plans.append((args[6].layout, args[6].reduction, args[7], args[8]))
        return stub(*args, **kwargs)

    monkeypatch.setattr(decision, "prepare", prepare)
    hint = OverlapConfig(layout="rows", late_budget=True, symmetric=True)
    monkeypatch.setattr(decision, "tuned_config", lambda *args: Found(hint, False))
    ran = pulls_possible(monkeypatch)
    seen = []
    timings(
        monkeypatch,
        lambda variants, *args, **kw: (
            seen.append(sorted(variants)) or {v: 0.9 if "fused" in v else 0.8 if "pull" in v else 1.0 for v in variants}
        ),
    )
    flashoverlap.gemm_reduce_scatter(bf16(m, 64), bf16(n, 64))
    timed = ["overlapped, comm_sms 0 pull_fused", "overlapped, comm_sms 16 late", "overlapped, comm_sms 4 pull"]
    assert seen == [[*timed, "sequential"]]
    # (rank 0 of 2)
    assert plans == [("rows", "nccl", m // 2, 1), ("segments", "pull", 0, 2), ("rows", "pull_fused", m // 2, 2)]
    ((ex, budget, tail),) = ran
    assert (ex.collective, ex.reduction, budget, tail) == ("reduce_scatter", "pull", "budget pull 4", None)


def test_on_four_ranks_a_timed_all_reduce_times_its_pull_with_more_sms_for_the_sums(one_rank_group, monkeypatch):
    """On more than two ranks the pull candidate is a pull_scatter, whose sums read the other ranks'
    memory in place: it is also timed with rules.READ_SMS SMs for them, and may win."""
    from flashoverlap.rules import READ_SMS

    m, n = 4096, 8192
    untuned_all_reduce(monkeypatch, m, n)
    monkeypatch.setattr(decision, "world_size", lambda group: 4)
    four = rules.pulled  # (the pull candidate as four ranks' group would make it)
    monkeypatch.setattr(
        decision, "pulled", lambda cfg, collective, shape, total, world: four(cfg, collective, shape, total, 4)
    )
    ran = pulls_possible(monkeypatch)
    times = {
        "sequential": 1.0,
        "overlapped, comm_sms 16": 0.95,
        "overlapped, comm_sms 16 late": 0.9,
        "overlapped, comm_sms 4 pull_scatter": 0.88,
        f"overlapped, comm_sms {READ_SMS} pull_scatter": 0.8,
    }
    seen = []
    timings(monkeypatch, lambda variants, *args, **kw: seen.append(sorted(variants)) or {v: times[v] for v in variants})
    flashoverlap.gemm_all_reduce(bf16(m, 64), bf16(n, 64))
    assert seen == [sorted(times)]
    ((ex, budget, tail),) = ran
    assert ex.reduction == "pull_scatter" and budget == f"budget pull_scatter {READ_SMS}" and tail is None


@pytest.mark.parametrize("p2p_disabled", [False, True])
def test_no_window_where_p2p_is_disabled(one_rank_group, monkeypatch, p2p_disabled):
    """NCCL's symmetric kernels reach peers through CUDA IPC whatever NCCL_P2P_DISABLE says: with
    P2P disabled a call runs without a window, as where ranks lack peer access."""
    from flashoverlap.plan import make_plan

    plan = make_plan(4096, 8192, tile_m=128, tile_n=256, cluster_m=1, ctas=116, layout="rows")
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1" if p2p_disabled else "0")
    monkeypatch.setattr(decision, "world_size", lambda group: 2)
    monkeypatch.setattr(decision, "check_inputs", lambda a, w, layout: (4096, 8192, 64))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(decision, "prepare", lambda *args, **kw: Prepared(plan, *(None,) * 5, 116, None))
    monkeypatch.setattr(decision, "check_agreement", lambda *args: None)
    monkeypatch.setattr(decision, "budget_communicator", lambda *args: None)
    chosen = decision.decide(bf16(4096, 64), bf16(8192, 64), "all_reduce", config={"symmetric": True})
    assert chosen.config.symmetric is not p2p_disabled
    # a pull all-reduce copies between the GPUs' memories: refused, not run over NVLink behind the transport's back
    if p2p_disabled:
        with pytest.raises(ValueError, match="reduction 'pull' copies between the GPUs' memories: NCCL_P2P_DISABLE"):
            decision.decide(bf16(4096, 64), bf16(8192, 64), "all_reduce", config={"reduction": "pull"})
    else:
        monkeypatch.setattr(comm.peer, "unavailable", lambda group, device: None)  # (the test's group is gloo's)
        chosen = decision.decide(bf16(4096, 64), bf16(8192, 64), "all_reduce", config={"reduction": "pull"})
        assert chosen.config.reduction == "pull" and chosen.tail is None  # (no NCCL communicator)


@pytest.mark.parametrize("config", [None, {}])
def test_a_group_of_one_rank_runs_the_plain_gemm_before_any_lookup(one_rank_group, monkeypatch, caplog, config):
    """The same model run without tensor parallelism pays only the input checks: no registry
    lookup, no config resolution for the collective, no device switch."""

    monkeypatch.setenv("FLASHOVERLAP_LOG", "1")

    def unexpected(*args, **kwargs):
        raise AssertionError("a one-rank call went past the plain GEMM's checks")

    taken = []
    monkeypatch.setattr(decision, "check_inputs", lambda a, w, layout: (256, 256, 64))
    monkeypatch.setattr(decision, "tuned_config", unexpected)
    monkeypatch.setattr(decision, "for_call", unexpected)
    monkeypatch.setattr(torch.cuda, "device", unexpected)
    plain_records(monkeypatch, lambda *args: taken.append(args[3].collective))
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

    def unexpected(*args, **kwargs):
        raise AssertionError("a call with a rank without rows went past the plain path")

    taken = []
    ex = comm.Exchange("all_to_all", (m // 2, m - m // 2), (0, 0), 0, uniform=False, sources=sources)
    monkeypatch.setattr(decision, "world_size", lambda group: 2)
    monkeypatch.setattr(decision, "check_inputs", lambda a, w, layout: (m, 256, 64))
    monkeypatch.setattr(comm, "exchange", lambda *args, **kwargs: ex)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(decision, "tuned_config", unexpected)
    monkeypatch.setattr(decision, "prepare", unexpected)
    plain_records(monkeypatch, lambda *args: taken.append(args[3]))
    monkeypatch.setenv("FLASHOVERLAP_LOG", "1")
    for config in (None, {"layout": "cols"}):
        flashoverlap.gemm_all_to_all(bf16(max(m, 1), 64), bf16(256, 64), splits=list(ex.send), config=config)
    assert taken == [ex, ex]
    assert "sequential: a rank has no rows" in caplog.text


@pytest.mark.parametrize("given", [False, True], ids=["exchanged", "rows_per_rank"])
def test_ranks_with_different_m_decide_on_the_largest_and_share_its_columns(one_rank_group, monkeypatch, given):
    """Ranks whose M differ (known to all where the counts were exchanged, or given as
    ``rows_per_rank``: then nothing is exchanged) make every choice on the largest M, and plan their
    own groups on that M's tile columns; only layouts of whole columns."""
    from flashoverlap.plan import make_plan

    # the largest M's grid takes as many waves with the defaults' budget as without (no late
    # candidate), this rank's own would not: every rank must time the same candidates
    m, n, k, largest = 1000, 4096, 64, 2500
    ex = comm.Exchange("all_to_all", (500, 500), (500, 1500), 2000, uniform=False, sources=(m, largest))
    shared = make_plan(largest, n, tile_m=128, tile_n=256, cluster_m=1, ctas=16, layout="cols").column_groups
    seen = []

    def prepare(*args, **kwargs):
        seen.append(("prepare", args[0], args[-1]))
        plan = make_plan(m, n, tile_m=128, tile_n=256, cluster_m=1, ctas=16, layout="cols", column_groups=args[-1])
        return Prepared(plan, *(None,) * 5, 132, None)

    monkeypatch.setattr(decision, "world_size", lambda group: 2)
    monkeypatch.setattr(decision, "check_inputs", lambda a, w, layout: (m, n, k))
    counts = {"splits": [500, 500]}
    if given:
        counts.update(output_splits=[500, 1500], rows_per_rank=[m, largest])
        monkeypatch.setattr(comm, "all_gather_single", lambda *args, **kwargs: pytest.fail("counts exchanged"))
    else:
        monkeypatch.setattr(comm, "exchange", lambda *args, **kwargs: ex)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(comm, "cuda_backend", lambda group: "nccl")
    monkeypatch.setattr(decision, "tuned_config", lambda a, world, ex, shape, *how: seen.append(("tuned", shape)))
    monkeypatch.setattr(decision, "one_wave", lambda cfg, m, n, device: seen.append(("one_wave", m)) and False)
    monkeypatch.setattr(decision, "shared_columns", lambda *args, **kw: seen.append(("columns", args[0])) or shared)
    monkeypatch.setattr(decision, "prepare", prepare)
    monkeypatch.setattr(decision, "check_agreement", lambda *args: None)
    monkeypatch.setattr(decision, "budget_communicator", lambda *args: None)
    monkeypatch.setattr(comm, "tail_group", lambda group, device: group)
    monkeypatch.setattr(decision, "trial", lambda *args, **kw: seen.append(("trial", args[-2], len(args[0]))) or 0)
    monkeypatch.setattr(runtime, "run_overlapped", lambda prep, *args, **kwargs: seen.append(("run", prep.plan)))
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

    monkeypatch.setattr(decision, "world_size", lambda group: 2)
    monkeypatch.setattr(decision, "check_inputs", lambda a, w, layout: (4096, 4096, 512))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for fn in ENTRY_POINTS[1:]:
        with pytest.raises(ValueError, match="layout 'rows' sends .* point to point, which a gloo group cannot"):
            fn(bf16(64, 64), bf16(64, 64), config={"layout": "rows"})


def agreement_worker(rank: int, world: int, store_path: str):
    from flashoverlap.plan import make_plan

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        agreed = []
        real_agree = comm.agree
        comm.agree = lambda *args: agreed.append(args[1]) or real_agree(*args)
        sources = (3000, 1000)
        ex = comm.Exchange("all_to_all", (500, 500), (500, 500), 1000, uniform=False, sources=sources)
        shared = make_plan(3000, 1024, tile_m=128, tile_n=256, cluster_m=1, ctas=8, layout="cols").column_groups
        for m in (sources[rank], sources[rank] // 2 if rank else sources[rank]):  # rank 1's own plan changes
            plan = make_plan(m, 1024, tile_m=128, tile_n=256, cluster_m=1, ctas=8, layout="cols", column_groups=shared)
            prep = Prepared(plan, SimpleNamespace(spec="spec"), None, torch.zeros(1), *(None,) * 4)
            decision.check_agreement(prep, "all_to_all", dist.group.WORLD, ex, ("all_to_all", "ragged", 1024))
        assert len(agreed) == 1, agreed  # once per kind of call, on every rank alike
        dist.barrier()  # gloo: a rank leaving right after an all-gather can break its peer's last receive
    finally:
        dist.destroy_process_group()


def test_ranks_agree_once_per_call_whatever_plans_each_keeps():
    """Whether a call's ranks check their agreement (a collective) must not rest on this rank's own
    plans: ranks whose M differ keep different ones, and one checking alone would hang."""
    spawn_ranks(2, agreement_worker, timeout=120)


def test_a_trial_holds_for_every_m_of_its_power_of_two(one_rank_group, monkeypatch):
    from flashoverlap.plan import make_plan

    trials, ran, warmups, blocks, sized = [], [], [], [], []

    def time_variants(variants, rounds, block, warmup, group=None, graphs=False):
        trials.append((plans[-1].m, graphs))
        warmups.append(warmup)
        blocks.append(block)
        overlapped = math.nan if graphs else 0.5  # NaN: as if a rank could not capture the overlapped calls
        return {name: 1.0 if name == "sequential" else overlapped for name in variants}

    def round_calls(m, n, k):  # (the calls per round it gives the trial, and what it was asked)
        sized.append((m, n, k))
        return 5

    plans = []

    def prepare(m, n, *args, **kwargs):
        plans.append(make_plan(m, n, tile_m=128, tile_n=256, cluster_m=1, ctas=1, partition=None, layout="rows"))
        return Prepared(plans[-1], *(None,) * 5, 132, None)

    monkeypatch.setattr(decision, "world_size", lambda group: 2)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # CPU tensors stand in
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(decision, "tuned_config", lambda *args: None)
    monkeypatch.setattr(decision, "prepare", prepare)
    monkeypatch.setattr(decision, "one_wave", lambda *args: False)
    monkeypatch.setattr(decision, "check_agreement", lambda *args: None)
    monkeypatch.setattr(decision, "budget_communicator", lambda *args: None)
    monkeypatch.setattr(runtime, "run_overlapped", lambda *args, **kwargs: ran.append(args[1].shape[0]))
    timings(monkeypatch, time_variants)
    monkeypatch.setattr(decision, "check_inputs", lambda a, w, layout: (a.shape[0], *w.shape))
    monkeypatch.setattr(timing, "round_calls", round_calls)
    monkeypatch.delenv("FLASHOVERLAP_TIMING", raising=False)
    for m in (512, 700, 1023, 1024, 600, 512):
        flashoverlap.gemm_all_reduce(bf16(m, 64), bf16(256, 64))
    flashoverlap.gemm_all_reduce(bf16(512, 128), bf16(256, 128))  # another K: its own trial
    assert trials == [(512, False), (1024, False), (512, False)] and len(ran) == 7
    # every variant warmed up until its calls replay natively, as a model's repeated calls do: none of
    # its timed calls is one that sets up or records; rounds as long as timing.round_calls says for the call
    assert min(warmups) > runtime.RECORDED_CALLS
    assert blocks == [5, 5, 5] and sized == [(512, 256, 64), (1024, 256, 64), (512, 256, 128)]
    # calls replayed as CUDA graphs are timed so, apart from the eager answer; one no rank could
    # capture is not picked
    monkeypatch.setenv("FLASHOVERLAP_TIMING", "graphs")
    registry.reload()  # (the environment is read as a call is decided)
    flashoverlap.gemm_all_reduce(bf16(700, 64), bf16(256, 64))
    assert trials[-1] == (700, True) and len(ran) == 7


def test_a_repeated_call_reuses_its_decision_until_what_it_rests_on_changes(one_rank_group, monkeypatch):
    """decide() is kept per call kind: a repeated call looks up neither registry nor plans, while
    another shape or config decides afresh, a call whose counts are exchanged decides every time,
    and registry.reload() makes every call decide afresh (the registry files and the environment
    are read as a call is decided)."""
    lookups = []

    def tuned_config(a, world, ex, shape, transport, p2p=True):
        lookups.append(shape)
        return Found(OverlapConfig(sequential=True), True)

    monkeypatch.setattr(decision, "world_size", lambda group: 2)
    monkeypatch.setattr(decision, "check_inputs", lambda a, w, layout: (a.shape[0], *w.shape))
    monkeypatch.setattr(decision, "tuned_config", tuned_config)
    monkeypatch.setattr(comm, "cuda_backend", lambda group: "nccl")
    monkeypatch.delenv("FLASHOVERLAP_NCCL", raising=False)
    a, w = bf16(256, 64), bf16(128, 64)
    exchanged = []
    first = decision.decide(a, w, "all_reduce", exchanged=exchanged)
    assert decision.decide(a, w, "all_reduce", exchanged=exchanged) is first and len(lookups) == 1
    assert exchanged == [first.ex, first.ex]  # (the gradients need it on every call)
    decision.decide(bf16(512, 64), w, "all_reduce")  # another M
    decision.decide(a, w, "all_reduce", config={"sequential": True})  # a config: no lookup, its own decision
    assert decision.decide(a, w, "all_reduce", config={"sequential": True}).config is None and len(lookups) == 2
    monkeypatch.setenv("FLASHOVERLAP_NCCL", "c10d")
    decision.decide(a, w, "all_reduce")
    assert len(lookups) == 2  # the environment is read as a call is decided ...
    registry.reload()
    decision.decide(a, w, "all_reduce")
    decision.decide(a, w, "all_reduce")
    assert len(lookups) == 3  # ... and again once reloaded
    for _ in range(2):  # counts exchanged per call (here: known, not exchanged, but never kept)
        decision.decide(a, w, "all_to_all", splits=[128, 128], output_splits=[128, 128])
    assert len(lookups) == 5


def rounds(sequential: list, **candidates: list) -> dict:
    """One mode's rounds of one rank ({variant: [[ms per call, round by round]]}), sequential's first."""
    return {name: [list(times)] for name, times in {"sequential": sequential, **candidates}.items()}


FLAT = [1.0] * 4


@pytest.mark.parametrize(
    ("modes", "pick"),
    [
        ([rounds(FLAT, a=[0.9] * 4, b=[0.8] * 4)], 1),  # the fastest
        ([rounds(FLAT, a=[0.99] * 4)], None),  # within the margin
        # a large median win from two rounds of four: noise (against sequential's rounds, paired)
        ([rounds(FLAT, a=[0.8, 1.05, 0.8, 1.01])], None),
        ([rounds(FLAT, a=[0.93, 0.95, 0.94, 0.96])], 0),  # a steady 5 % win
        # the host's speed moving both alike between turns: apart the medians lie within the rounds'
        # spread, turn by turn a steady 7 % win
        ([rounds([1.0, 1.3, 1.0, 1.3], a=[0.93, 1.21, 0.93, 1.21])], 0),
        # faster in one turn of four (the host faster in it), slower in the others: none
        ([rounds([1.3, 1.3, 1.0, 1.0], a=[1.0, 1.35, 1.01, 1.02])], None),
        # hot wins, rotated loses: the plain path (a model's calls may run either way)
        ([rounds(FLAT, a=[0.9] * 4), rounds(FLAT, a=[1.01] * 4)], None),
        # the best in its worst mode, not in its best
        ([rounds(FLAT, a=[0.8] * 4, b=[0.85] * 4), rounds(FLAT, a=[0.95] * 4, b=[0.9] * 4)], 1),
        ([rounds(FLAT, a=[math.nan] * 4, b=[0.9] * 4)], 1),  # not timed on some rank: none
        # the rank it wins least on decides (every rank holds every rank's rounds)
        ([{"sequential": [FLAT, FLAT], "a": [[0.9] * 4, [1.0] * 4]}], None),
    ],
)
def test_a_trial_takes_the_plain_path_unless_overlap_wins_by_more_than_margin_and_noise_in_every_mode(modes, pick):
    assert decision.trial_pick([name for name in modes[0] if name != "sequential"], modes) == pick


def test_a_trial_times_operands_that_fit_in_l2_hot_and_rotated_too(monkeypatch):
    """Small operands (hot in L2 every call in a layer, not where they come from far away) are timed
    both ways, on copies that exceed L2 together; larger ones only as they are."""
    l2 = 50 << 20
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(L2_cache_size=l2))
    a, w = torch.zeros(64, 1024, dtype=torch.bfloat16), torch.ones(4096, 1024, dtype=torch.bfloat16)
    modes = decision._operands(a, w)
    (hot_a, hot_w), (cold_a, cold_w) = modes["hot"], modes["rotated"]
    assert hot_a == [a] and hot_w == [w] and cold_a[0] is a and cold_w[0] is w
    per_set = (a.numel() + w.numel()) * 2
    assert len(cold_a) == len(cold_w) and len(cold_a) * per_set >= 3 * l2 and torch.equal(cold_w[-1], w)
    big = torch.empty(8192, 8192, dtype=torch.bfloat16)
    assert list(decision._operands(a, big)) == ["hot"]


def test_a_fused_entry_runs_rowwise_fp8_calls_as_the_copied_pull(one_rank_group, monkeypatch):
    """A registry entry of pull_fused for a call with rowwise FP8 scales, which its epilogue cannot
    take: the call runs the copied pull (``segments``, the SMs the GEMM spares, as rules.pulled
    makes it) instead of failing; with per-tensor scales the entry runs as it is."""
    m, n = 4096, 8192
    untuned_all_reduce(monkeypatch, m, n)
    ran = pulls_possible(monkeypatch)
    fused = OverlapConfig(reduction="pull_fused", comm_sms=0)
    monkeypatch.setattr(decision, "tuned_config", lambda *args: Found(fused, True))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    a, w, scales = fp8_operands(m, n)
    flashoverlap.gemm_reduce_scatter(a, w, scale_a=torch.ones(m, 1), scale_b=torch.ones(1, n))
    flashoverlap.gemm_reduce_scatter(a, w, **scales)
    assert [(ex.reduction, budget) for ex, budget, _ in ran] == [
        ("pull", "budget pull 4"),
        ("pull_fused", "budget pull_fused 0"),
    ]
