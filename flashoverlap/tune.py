"""Tune configs per shape on GPUs and write them to a registry file: ``python -m flashoverlap.tune``.

For each shape: time the GEMM per wave of every candidate config and the collectives by size
(tune_measure), predict each candidate's best partition (tune_model), measure the best predicted
against sequential, and write the one with the best speedup over it, paired round by round
(sequential where none wins by ``--margin``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from . import bench, comm, overlap, report
from .config import OverlapConfig, cli_config, resolve
from .decision import TRIAL_WARMUP
from .inputs import DTYPES, FP8_DTYPES, OPERAND_DTYPES
from .plan import widest_budget
from .prepared import prepare
from .registry import entry, incumbent, read_entries, write_registry
from .rules import COLLECTIVES, for_call, resolutions, takes_every_call
from .runtime import plain
from .timing import kernel_alone, operand_sets, paired_speedup, round_calls, slowest, time_samples, time_variants
from .tune_measure import comm_model, host_model, local_model, pull_model, tail_model
from .tune_model import CommModel, HostModel, Problem, choose, partitions, pick_finalists, wave_bytes, with_local_adds

# --- measuring on GPUs: python -m flashoverlap.tune (under torchrun) -----------------------------

# Per collective; reduce-scatter / all-to-all also try the row-band layout (equal splits), with
# 4 SMs too: 128 CTAs make whole waves of the 1024-, 2048- and 4096-tile grids of the suite
# (the kernel then runs at cuBLAS speed). All-reduce rings on 4 CTAs are too slow beside a GEMM as
# long as the collective (0.82x) but keep up beside a longer one (1.05x, 4096x8192x28672); there a
# late budget did better still (1.06x; 1.09x on 8192x4096x14336), and with NCCL's symmetric
# kernels (faster per CTA over NVLink) also beside 4096x8192x8192 (1.11x against 1.09x). Where the
# collective is most of the GEMM's length, symmetric kernels from the first wave on
# (16384x8192x4096 on H100x2, 8 SMs: 1.24x against 1.08x for the best plain ring).
DEFAULT_CANDIDATES = {
    "all_reduce": (
        {},
        {"late_budget": True},
        {"late_budget": True, "symmetric": True},
        {"symmetric": True},
        {"symmetric": True, "comm_sms": 8},
        {"comm_sms": 4},
        {"comm_sms": 8},
        {"comm_sms": 24},
        {"tile_n": 128},
        {"swizzle": 4},
        {"scheduler": "streamk"},
        # partial sums copied out of the other GPU's memory (comm.peer): no SM for the copies, a few
        # for the adds (two H100s, 4096x8192x8192: 1.23x against 1.16x for NCCL's best config)
        {"reduction": "pull", "comm_sms": 4},
        {"reduction": "pull", "comm_sms": 0},
        # with a cluster of two along M: the GEMM itself faster (two H200s: chosen on 4 of the 7
        # suite shapes, 1.232-1.244x against 1.214-1.225x without)
        {"reduction": "pull", "comm_sms": 4, "cluster_m": 2},
        # each rank pulls and sums a 1 / w share of each group, then pulls the other shares' sums: as
        # many bytes as NCCL's ring per rank (pull: w - 1 groups), for four ranks and more
        {"reduction": "pull_scatter", "comm_sms": 4},
        {"reduction": "pull_scatter", "comm_sms": 4, "cluster_m": 2},
        # its sums read the others' memory over NVLink: more SMs read faster, at the GEMM's cost
        # (4x H100, 16384x8192x4096: 1.24x with 16 against 0.96x with 4)
        {"reduction": "pull_scatter", "comm_sms": 8},
        {"reduction": "pull_scatter", "comm_sms": 16},
    ),
    "reduce_scatter": (
        {},
        {"comm_sms": 24},
        {"layout": "rows"},
        {"layout": "rows", "comm_sms": 4},
        {"layout": "rows", "comm_sms": 8},
        {"layout": "rows", "comm_sms": 24},
        {"layout": "cols"},  # ({} is segments where they carry the call: rules.for_call)
        {"layout": "segments", "comm_sms": 4},
        # the own segment last: NCCL's late SMs carry only the other ranks' rows, in a window
        # (all-to-all 8192x4096x7168 over NVLink: 1.11-1.13x against 1.08-1.10x)
        {"layout": "rows", "late_budget": True, "symmetric": True},
        # each rank copies its segment's rows of every rank's group out of their memory: the copy
        # engines, no NCCL (comm.peer)
        {"layout": "segments", "reduction": "pull", "comm_sms": 4},
        {"layout": "segments", "reduction": "pull", "comm_sms": 4, "cluster_m": 2},
    ),
}
DEFAULT_CANDIDATES["all_to_all"] = DEFAULT_CANDIDATES["reduce_scatter"]
# a reduce-scatter's pulled rows are summed from their copies: on more SMs, or on none (after the
# GEMM; 4x H200, six shapes: 1.19x with 4, 1.15x with none, 1.13x with 8; an all-to-all has no sums)
DEFAULT_CANDIDATES["reduce_scatter"] += (
    {"layout": "segments", "reduction": "pull", "comm_sms": 8},
    {"layout": "segments", "reduction": "pull", "comm_sms": 0},
    # this rank's rows computed last and the others' partial sums of them added in the epilogue: no SM
    # for the sums, none after the GEMM
    {"reduction": "pull_fused", "comm_sms": 0},
)


log = logging.getLogger("flashoverlap.tune")  # not __name__: "__main__" under python -m


def _progress(message: str) -> None:

    if dist.get_rank() == 0:
        log.info(message)


def _fitted(model, *args) -> CommModel | None:
    """``model(*args)``, or None where its measurements cannot be fitted (said on rank 0)."""
    try:
        return model(*args)
    except ValueError as exc:
        _progress(f"{model.__name__}{args}: {exc}; its candidates are dropped")
        return None


def tune_shape(
    shape,
    collective,
    candidates,
    dtype,
    transport,
    rounds,
    top,
    margin,
    brute_force=0,
    graphs=False,
    current=None,
    fast_accum=False,
) -> tuple[dict, list[dict]]:
    """Measure, predict, confirm for one shape: (registry entry, summary rows). ``brute_force`` > 0
    also measures every partition of up to that many groups for every candidate and adds the best
    of them (``brute_ms``, ``brute_config``) to the rows, to judge the model's pick. ``graphs``:
    for calls replayed as CUDA graphs: no host time in the model, the finalists and sequential
    timed as graph replays, the entry marked ``timing: graphs``. ``current``: the config the
    registry being written has for this call (:func:`incumbent`), measured beside the finalists
    (unless one of them), so that a re-tune replaces it only with what measures a better speedup in
    the same run (the model can rank the registry's entry below the finalists where it measures faster).
    ``dtype`` FP8: calls with per-tensor scales and a bf16 result (bench.fp8_arguments; ``fast_accum``:
    unpromoted sums), candidates naming no tile in FP8's (config.resolve), the entry under ``dtype``."""
    m, n, k = shape
    a, w = operand_sets(m, n, k, dtype)
    ex = comm.exchange(collective, m, dist.get_world_size())
    fp8 = bench.fp8_arguments(dtype, k, fast_accum)
    candidates, cfgs, preps = _widened(candidates, ex, shape, dtype, a[0].device, fp8.fp8)
    patterns = [comm.comm_pattern(collective, c.layout, c.reduction) for c in cfgs]
    measured = (a, w, ex, dtype, rounds, graphs, fp8)
    problems, sequential_ms = _problems(shape, collective, cfgs, patterns, preps, candidates[0], *measured)
    choices = [(choose(p, sequential_ms, margin), j) for j, p in enumerate(problems) if p is not None]
    if not choices:
        raise RuntimeError(f"{m}x{n}x{k}: no candidate could be modelled (see the messages above)")
    plain = candidates.index({}) if {} in candidates and problems[candidates.index({})] is not None else None
    defaults = [prep.plan.partition for prep in preps]
    finalists = pick_finalists(choices, problems, defaults, top, plain, finalist_kinds(cfgs, patterns))
    current = _runnable(current, ex, shape, dtype, a[0].device, fp8.fp8)
    rows = _confirm(shape, collective, candidates, finalists, current, a, w, ex, rounds, graphs, fp8)
    if brute_force:
        brute_ms, brute_config = _brute_force(
            shape, collective, candidates, preps, brute_force, a, w, rounds, ex, graphs, fp8
        )
        for r in rows:
            r["brute_ms"] = brute_ms * r["seq_ms"]  # measured as a ratio to sequential: same scale
            r["brute_config"] = brute_config
    timing = "graphs" if graphs else "eager"
    return measured_entry(collective, transport, OPERAND_DTYPES[dtype], shape, rows, margin, timing), rows


def _widened(candidates, ex, shape, dtype, device, fp8=None) -> tuple[list[dict], list, list]:
    """The candidates (config fields), their configs for the call and their plans, each persistent
    one also with the widest SM budget at the same wave count: NCCL (or a pull's sums) gets more SMs
    for free (16 -> 18 for the suite's grids on 132 SMs). ``fp8``: FP8 operands' kind."""
    m, n, k = shape

    def planned(cfg):
        return prepare(
            m, n, k, dtype, "nk", device, cfg, interleave=comm.interleave(ex, cfg.layout, cfg.reduction), fp8=fp8
        )

    cfgs = [for_call(resolve(c, fp8 is not None), ex, shape) for c in candidates]
    preps = [planned(cfg) for cfg in cfgs]
    candidates, total = list(candidates), torch.cuda.get_device_properties(device).multi_processor_count
    for candidate, cfg, prep in list(zip(candidates, cfgs, preps)):
        wider = {**candidate, "comm_sms": widest_budget(prep.plan, total)}
        # (stream-K's grid is its own; a fused reduce-scatter runs nothing on spare SMs)
        kept = cfg.scheduler != "persistent" or cfg.reduction == "pull_fused"
        if kept or wider["comm_sms"] <= cfg.comm_sms or wider in candidates:
            continue
        cfgs.append(for_call(resolve(wider, fp8 is not None), ex, shape))
        preps.append(planned(cfgs[-1]))
        candidates.append(wider)
    return candidates, cfgs, preps


def finalist_kinds(cfgs: Sequence[OverlapConfig], patterns: Sequence[str]) -> list[str]:
    """Each candidate's kind for tune_model.pick_finalists (the best predicted of every kind is
    measured): its way of communicating (``patterns``: rules.comm_pattern); for sums that read the
    other ranks' memory in place, with its SM count too: they run faster on more SMs, which the pull
    model (measured alone, one for every ``comm_sms``) cannot see, so only the GEMM's lost waves would
    rank them."""
    return [f"{p} {c.comm_sms}" if comm.reads_in_place(c.reduction) else p for c, p in zip(cfgs, patterns)]


def _problems(
    shape, collective, cfgs, patterns, preps, first, a, w, ex, dtype, rounds, graphs, fp8
) -> tuple[list, float]:
    """Each candidate's call as the cost model sees it (None where a model of its communication
    could not be fitted), from its GEMM's time per wave and its communication's time by size as
    measured here, and the sequential call's predicted time; ``first``: the candidate whose calls
    time the host (not for calls replayed as CUDA graphs); ``fp8``: bench.fp8_arguments (the
    collectives move the result, bf16 for FP8 operands)."""
    m, n, k = shape
    sets, world = len(a), dist.get_world_size()
    _progress(f"{m}x{n}x{k}: GEMM per wave for {len(cfgs)} candidates")
    product = plain(ex, None, "nk", 1, fp8.fp8)
    variants = {"gemm": lambda i: product(a[i % sets], w[i % sets], fp8.scales)}
    variants.update({f"kernel{j}": kernel_alone(p, a, w, fp8.scales) for j, p in enumerate(preps)})
    moved = dtype if fp8.fp8 is None else fp8.fp8.out_dtype  # what the collectives move: the result
    times = time_variants(variants, rounds, 4, 3)
    _progress(f"{m}x{n}x{k}: {collective} time by size (measured once per run)")
    # in a fixed order: every rank must measure the same collectives in the same order (a set's
    # order of strings differs between processes, and deadlocked the tuner)
    kinds = [(collective, False)] + [(p, c.symmetric) for c, p in zip(cfgs, patterns)]
    # the last group runs on the full communicator, in the window too where symmetric; a model that
    # cannot be fitted drops its candidates (the times are the ranks' maximum: all drop the same)
    tails = {(p, sym): _fitted(tail_model, p, moved, rounds, sym) for p, sym in dict.fromkeys(kinds)}
    during = {
        (c.comm_sms, p, c.symmetric): _fitted(comm_model, p, c.comm_sms, moved, rounds, c.symmetric)
        for c, p in zip(cfgs, patterns)
    }
    if tails[collective, False] is None:
        raise RuntimeError(f"could not fit a time-by-size model of {collective}: see the message above")
    if graphs:
        host = HostModel()
    else:
        host = host_model(collective, a, w, first, preps[0].plan.num_waves, fp8.kwargs)
        _progress(f"{m}x{n}x{k}: host {host.base_ms:.3f} ms per call + {host.per_group_ms:.3f} ms per group")
    elem = torch.finfo(moved).bits // 8
    problems = []
    for j, (cfg, prep, pattern) in enumerate(zip(cfgs, preps, patterns)):
        per_wave_ms = times[f"kernel{j}"] / prep.plan.num_waves
        ranks = world if collective != "all_reduce" else 1
        sent = wave_bytes(prep.plan, elem, ranks)
        if pattern == "pull" and collective != "all_reduce":  # a rank pulls its own segment's rows only
            sent = tuple(b / world for b in sent)
        if pattern == "pull_fused":  # a group is one rank's rows, all pulled by it from one rank: priced as the
            sent = tuple(b / (world - 1) for b in sent)  # pull all-reduce's copies of 1 / (w - 1) from each
        # (a fused reduce-scatter's own rows are its epilogue's: nothing local after the copies)
        kept = (0.0,) * prep.plan.num_waves if pattern == "pull_fused" else wave_bytes(prep.plan, elem, ranks, own=True)
        local = local_model(collective, moved, rounds) if any(kept) else None
        if comm.finishes(ex, prep.plan) and pattern != "all_gather":  # result rows copied into place per group
            kept, local = tuple(b * ex.rows / m for b in sent), local_model("all_to_all", moved, rounds)
        comm_models = during[cfg.comm_sms, pattern, cfg.symmetric], tails[pattern, cfg.symmetric]
        if None in comm_models:
            problems.append(None)
            continue
        apart = cfg.comm_sms > 0 and comm.tail_apart(collective, cfg.layout, cfg.reduction)  # (0: one communicator)
        problems.append(
            Problem(sent, per_wave_ms, *comm_models, host, kept, local, start_wave=prep.plan.after, tail_apart=apart)
        )
        # the partial sums added (a pull_scatter's share of them: in its time by size)
        if pattern == "all_gather" or pattern == "pull" and collective != "all_to_all":
            problems[-1] = with_local_adds(problems[-1], local_model("all_gather", moved, rounds), cfg.comm_sms)
    sequential_ms = times["gemm"] + tails[collective, False].time_ms(m * n * elem)
    return problems, sequential_ms


def _runnable(current: dict | None, ex, shape, dtype, device, fp8=None) -> dict | None:
    """The registry's config for the call where this version can run it (not a partition of another
    wave count, say), else None."""
    if current is None:
        return None
    m, n, k = shape
    try:
        held = for_call(resolve(current, fp8 is not None), ex, shape)
        prepare(
            m, n, k, dtype, "nk", device, held, interleave=comm.interleave(ex, held.layout, held.reduction), fp8=fp8
        )
    except (TypeError, ValueError) as exc:
        _progress(f"{m}x{n}x{k}: the registry's entry is left out: {exc}")
        return None
    return current


def _sequential(a: list[torch.Tensor], w: list[torch.Tensor], ex: comm.Exchange, fp8) -> Callable[[int], object]:
    """The sequential variant on operand sets ``a`` and ``w``: the plain path made once, as a call
    decided plain runs it (``fp8``: bench.fp8_arguments)."""
    run = plain(ex, None, "nk", dist.get_world_size(), fp8.fp8)
    return lambda i: run(a[i % len(a)], w[i % len(w)], fp8.scales)


def _confirm(shape, collective, candidates, finalists, current, a, w, ex, rounds, graphs, fp8) -> list[dict]:
    """The summary rows of the finalists (and of ``current``, the registry's config, unless among
    them) measured against sequential as a call decided plain runs it, in the bench's way (whose
    ``seq`` is torch's own call; ``fp8``: bench.fp8_arguments) but never faster than the host
    enqueues each call (timing.time_samples' ``host_floor``, as the first-use trial decides): times
    per call and the speedup paired round by round."""
    m, n, k = shape
    overlapped = getattr(overlap, f"gemm_{collective}")
    variants = {"seq": _sequential(a, w, ex, fp8)}
    tuned = [{**candidates[j], "partition": list(choice.partition)} for choice, j in finalists]
    for f, config in enumerate(tuned):  # one candidate may come twice (defaults)
        variants[f"fo{f}"] = _call(overlapped, a, w, config, fp8)
    if current in tuned:
        current = None
    if current is not None:
        variants["current"] = _call(overlapped, a, w, current, fp8)
    what = "best predicted overall and of each kind, defaults" + (", the registry's" if current is not None else "")
    _progress(f"{m}x{n}x{k}: measuring {len(finalists)} finalists ({what}) against sequential")
    block = round_calls(m, n, k, fewest=8)  # (warmed up as the trial: no timed round starts with a first native run)
    samples = time_samples(variants, 2 * rounds, block, TRIAL_WARMUP, graphs=graphs, host_floor=True)
    measured = {name: slowest(ranks) for name, ranks in samples.items()}
    rows = [
        {
            "shape": f"{m}x{n}x{k}",
            "config": json.dumps(candidates[j], sort_keys=True),
            "partition": list(choice.partition),
            "predicted_ms": choice.overlap_ms,
            "measured_ms": measured[f"fo{f}"],
            "seq_ms": measured["seq"],
            "speedup": paired_speedup(samples["seq"], samples[f"fo{f}"]),
        }
        for f, (choice, j) in enumerate(finalists)
    ]
    if current is not None:
        rows.append(
            {
                "shape": f"{m}x{n}x{k}",
                "config": json.dumps({key: v for key, v in current.items() if key != "partition"}, sort_keys=True),
                "partition": current.get("partition"),
                "predicted_ms": None,  # (not modelled: the registry's)
                "measured_ms": measured["current"],
                "seq_ms": measured["seq"],
                "speedup": paired_speedup(samples["seq"], samples["current"]),
            }
        )
    return rows


def measured_entry(
    collective: str, transport: str, dtype: str, shape, rows: list[dict], margin: float, timing: str = "eager"
) -> dict:
    """The registry entry for one shape's measured finalists (summary rows of :func:`tune_shape`):
    :func:`config_to_write`'s config, and next to one that cannot carry every call (``rows`` or ``segments``
    reduce-scatter / all-to-all, symmetric all-to-all: rules.takes_every_call) the best of the
    finalists that can as ``fallback``, for the calls it cannot carry."""

    def every_call(config: dict) -> bool:
        return takes_every_call(OverlapConfig.from_dict(config), collective)

    config, speedup = config_to_write(rows, margin)
    result = entry(collective, transport, dtype, shape, config, {"speedup": round(speedup, 3)}, timing)
    if not every_call(config):
        others = [r for r in rows if every_call(json.loads(r["config"]))]
        result["fallback"] = config_to_write(others, margin)[0] if others else {"sequential": True}
    return result


def config_to_write(rows: list[dict], margin: float) -> tuple[dict, float]:
    """The config to write from measured finalists (summary rows of :func:`tune_shape`) and its
    speedup over sequential: the fastest against sequential round by round (each row's paired
    ``speedup``, timing.paired_speedup: the host's drift between turns, which moves two medians
    taken apart, cancels in a turn), or sequential where it does not win by ``margin``."""
    best = max(rows, key=lambda r: -math.inf if math.isnan(r["speedup"]) else r["speedup"])
    speedup = best["speedup"]
    if speedup > 1.0 + margin:  # (a registry entry measured beside the finalists may have no partition)
        partition = {} if best["partition"] is None else {"partition": best["partition"]}
        return {**json.loads(best["config"]), **partition}, speedup
    return {"sequential": True}, speedup  # overlap does not pay here: never slower than sequential


# well outside the few percent an entry's speedup moves between runs and machine starts (about 4 %)
SLOW_INCUMBENT = 0.85


def slow_incumbent(held: dict, written: dict, rows: list[dict]) -> str | None:
    """A warning where a re-tune replaces the registry's entry (``held``) after measuring it below
    :data:`SLOW_INCUMBENT` of the speedup it was written with (its ``measured``, free-form: no
    number, no warning; ``written``: the new entry, ``rows``: the shape's summary rows), else None.
    A process can run slow as a whole (peer-memory pulls have, for a whole process): its re-tune
    swaps good entries for worse ones, which only another process can tell."""
    recorded = held.get("measured")
    recorded = recorded.get("speedup") if isinstance(recorded, dict) else None
    config = {key: v for key, v in held["config"].items() if key != "partition"}
    partition = held["config"].get("partition")
    measured = next(
        (r["speedup"] for r in rows if json.loads(r["config"]) == config and r["partition"] == partition), None
    )
    if not isinstance(recorded, (int, float)) or measured is None or written["config"] == held["config"]:
        return None
    if not measured < SLOW_INCUMBENT * recorded:
        return None
    return (
        f"{written['shape'][0]}x{written['shape'][1]}x{written['shape'][2]}: the registry's entry "
        f"{json.dumps(held['config'], sort_keys=True)} measured {measured:.3f}x here against {recorded:.3f}x "
        f"when it was written, and is replaced; this process may run slow as a whole (peer-memory pulls "
        f"have): to check, put that entry back in the file and re-tune this shape in a new process"
    )


BRUTE_BATCH = 32  # variants per timing batch: their plans stay cached (state.MAX_PLANS)


def _call(overlapped, a: list, w: list, config: dict, fp8):
    """A timing variant ``i -> overlapped(a[i], w[i])`` (rotated) with ``config``, resolved once as a
    registry entry is: a repeat then takes the call's fast path (keyed on a config object), as a
    user's call without ``config=`` does. (Passed as a mapping, every call would look the mapping and
    its decision up again: host time a user's repeated call does not pay.)"""
    cfg, sets = resolve(config, fp8.fp8 is not None), len(a)
    return lambda i: overlapped(a[i % sets], w[i % sets], config=cfg, **fp8.kwargs)


def _brute_force(shape, collective, candidates, preps, max_groups, a, w, rounds, ex, graphs, fp8) -> tuple[float, str]:
    """Best measured (time / sequential time, config JSON) over every candidate and every partition
    of up to ``max_groups`` groups; sequential runs in every batch, and each ratio is paired round
    by round (timing.paired_speedup), as the finalists' (``graphs``: timed as CUDA graph replays;
    ``fp8``: bench.fp8_arguments)."""
    m, n, k = shape
    overlapped = getattr(overlap, f"gemm_{collective}")
    tried = [
        {**candidates[j], "partition": list(p)}
        for j, prep in enumerate(preps)
        for p in partitions(prep.plan.num_waves, max_groups)
    ]
    best = (1.0, json.dumps({"sequential": True}))
    seq = _sequential(a, w, ex, fp8)  # (one plain runner for every batch, as a call decided plain keeps one)
    for start in range(0, len(tried), BRUTE_BATCH):
        batch = tried[start : start + BRUTE_BATCH]
        _progress(f"{m}x{n}x{k}: brute force {start + len(batch)}/{len(tried)}")
        variants = {"seq": seq}
        for b, cfg in enumerate(batch):
            variants[f"b{b}"] = _call(overlapped, a, w, cfg, fp8)
        samples = time_samples(variants, rounds, 4, TRIAL_WARMUP, graphs=graphs, host_floor=True)
        for b, cfg in enumerate(batch):
            speedup = paired_speedup(samples["seq"], samples[f"b{b}"])
            if not math.isnan(speedup):  # (a partition some rank could not capture is none)
                best = min(best, (1 / speedup, json.dumps(cfg, sort_keys=True)))
    return best


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashoverlap.tune",
        description="Tune configs (GEMM instance, comm_sms, group partition) per shape and write them to a "
        "registry YAML (flashoverlap.registry). Run under torchrun with the world size to tune for.",
    )
    parser.add_argument("--collective", choices=COLLECTIVES, default="all_reduce")
    parser.add_argument("--shapes", nargs="+", type=bench.parse_shape, help="MxNxK ...")
    parser.add_argument("--shapes-file", help="YAML list of shapes (see python -m flashoverlap.bench)")
    parser.add_argument(
        "--candidates",
        nargs="+",
        type=cli_config,
        help="configs to tune from: JSON objects or YAML config files (default: per collective)",
    )
    parser.add_argument("--transport", choices=sorted(bench.TRANSPORTS), default="nvlink")
    # FP8 (e4m3: torch._scaled_mm multiplies no two e5m2 operands): per-tensor scales, a bf16 result
    parser.add_argument("--dtype", choices=[*DTYPES.values(), "float8_e4m3fn"], default="bfloat16")
    parser.add_argument(
        "--fast-accum", action="store_true", help="FP8: tune calls with use_fast_accum=True (sums unpromoted)"
    )
    parser.add_argument("--rounds", type=int, default=10)
    # the model misses what NCCL on more CTAs costs a GEMM beside it (Ampere/Ada kernels, P2P off: 16 SMs
    # predicted 3 % slower than 8, measured 18 %): more finalists, so that the measurements decide
    parser.add_argument(
        "--top",
        type=int,
        default=4,
        help="predicted-best candidates measured for real (each also with its default partition)",
    )
    parser.add_argument("--margin", type=float, default=0.02, help="overlap must beat sequential by this")
    parser.add_argument(
        "--output", required=True, help="registry YAML to write or update (calls read it from FLASHOVERLAP_CONFIG_DIRS)"
    )
    parser.add_argument("--csv", help="also write the predicted-vs-measured rows here")
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="tune for calls replayed as CUDA graphs (no host time; entries marked timing: graphs, read "
        "under FLASHOVERLAP_TIMING=graphs)",
    )
    parser.add_argument(
        "--brute-force",
        type=int,
        default=0,
        metavar="GROUPS",
        help="also measure every partition of up to GROUPS groups per candidate and report how the "
        "tuned pick compares (slow; to validate the model)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    shapes, candidates = _checked(args, parser)
    if "RANK" not in os.environ:
        print("run under torchrun, e.g. torchrun --nproc-per-node 2 -m flashoverlap.tune ...", file=sys.stderr)
        return 2
    os.environ.update(bench.TRANSPORTS[args.transport])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if (why := bench.unrunnable(local_rank)) is not None:
        print(why, file=sys.stderr)
        return 2
    gpu, world = torch.cuda.get_device_name(local_rank), int(os.environ.get("WORLD_SIZE", 1))
    if world < 2:  # (its collectives move nothing: no time by size to model)
        parser.error("tuning needs two or more ranks (torchrun --nproc-per-node 2 or more): one communicates nothing")
    try:  # what --output holds already: a file for other GPUs is refused before anything runs
        existing = read_entries(args.output, gpu, world)
    except ValueError as exc:
        parser.error(str(exc))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    try:
        device = torch.device("cuda", local_rank)
        no_pulls = comm.peer.unavailable(dist.group.WORLD, device)  # (alike on every rank)
        pulls = [c for c in candidates if c.get("reduction") in comm.PULLS]
        if pulls and no_pulls:
            _progress(f"{len(pulls)} pull candidate(s) dropped: {no_pulls}")
            candidates = [c for c in candidates if c not in pulls] or parser.error("no candidate left")
        entries, rows = _tune_shapes(args, shapes, candidates, existing, no_pulls, gpu, world)
        if dist.get_rank() == 0:
            print(format_summary(rows))
            errors = [abs(r["predicted_ms"] / r["measured_ms"] - 1) for r in rows if r["predicted_ms"] is not None]
            print(f"median |predicted / measured - 1|: {statistics.median(errors):.1%}")
            if args.brute_force:
                print(brute_summary(entries, rows))
            print(f"wrote {len(entries)} entries to {args.output}")
    finally:
        for model in (comm_model, pull_model):  # their communicators / mapped memory die with the group
            model.cache_clear()
        dist.destroy_process_group()
    return 0


def _checked(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list, list[dict]]:
    """The shapes and candidates to tune, checked before any process group or GPU work."""
    if args.brute_force < 0:
        parser.error("--brute-force takes a number of groups >= 1 (0: off)")
    if args.top < 1:
        parser.error(f"--top takes a number of finalists >= 1, got {args.top}")
    if args.fast_accum and args.dtype not in FP8_DTYPES.values():
        parser.error(f"--fast-accum is for FP8 operands (--dtype float8_e4m3fn), not {args.dtype}")
    shapes = list(args.shapes or []) + (bench.load_shapes(args.shapes_file) if args.shapes_file else [])
    if not shapes:
        parser.error("give --shapes and/or --shapes-file")
    candidates = args.candidates or list(DEFAULT_CANDIDATES[args.collective])
    if args.transport != "nvlink":  # P2P disabled: calls run without windows nor pulls (decision.decide)
        peerless = [c for c in candidates if not c.get("symmetric") and c.get("reduction") not in comm.PULLS]
        candidates = peerless or parser.error(
            "symmetric windows and pulls need peer access: with P2P disabled some candidate must use neither"
        )
    for candidate in candidates:
        try:
            resolutions(resolve(candidate), args.collective)
        except ValueError as exc:
            parser.error(f"candidate {json.dumps(candidate)}: {exc}")
    return shapes, candidates


def _tune_shapes(args, shapes, candidates, existing, no_pulls, gpu, world) -> tuple[list[dict], list[dict]]:
    """Every shape tuned, the registry file (and CSV) written after each (a run cut short keeps what
    it found): (entries, summary rows). Every rank measures rank 0's ``existing`` entries (the file it
    writes)."""
    existing = [existing]
    dist.broadcast_object_list(existing, src=0)
    dtype = getattr(torch, args.dtype)
    timing = "graphs" if args.graphs else "eager"
    entries, rows = [], []
    for i, shape in enumerate(shapes):
        _progress(f"shape {i + 1}/{len(shapes)}")
        held = incumbent(existing[0], args.collective, args.transport, args.dtype, shape, timing)
        current = None if held is None else held["config"]
        if current is not None and current.get("reduction") in comm.PULLS and no_pulls:
            current = None  # (a pull config raises where the ranks cannot pull)
        found, summary = tune_shape(
            shape,
            args.collective,
            candidates,
            dtype,
            args.transport,
            args.rounds,
            args.top,
            args.margin,
            args.brute_force,
            args.graphs,
            current,
            args.fast_accum,
        )
        entries.append(found)
        rows += summary
        if dist.get_rank() == 0:
            if current is not None and (warning := slow_incumbent(held, found, summary)):
                log.warning(warning)
            write_registry(args.output, gpu, world, entries)
            if args.csv:
                report.write_csv(args.csv, [dict(r, transport=args.transport) for r in rows])
    return entries, rows


def format_summary(rows: list[dict]) -> str:
    """Predicted vs measured per tuned candidate, and the paired speedup that decides what is written."""
    lines = [f"{'shape':>16} {'pred ms':>8} {'meas ms':>8} {'seq ms':>8} {'err':>6} {'speedup':>7}  partition  config"]
    for r in rows:
        if r["predicted_ms"] is None:  # the registry's entry, measured beside the finalists
            predicted, err = f"{'-':>8}", f"{'-':>6}"
        else:
            predicted, err = f"{r['predicted_ms']:>8.3f}", f"{r['predicted_ms'] / r['measured_ms'] - 1:>+6.1%}"
        measured = f"{r['measured_ms']:>8.3f} {r['seq_ms']:>8.3f} {err} {r['speedup']:>7.3f}"
        lines.append(f"{r['shape']:>16} {predicted} {measured}  {r['partition']}  {r['config']}")
    return "\n".join(lines)


def brute_summary(entries: list[dict], rows: list[dict]) -> str:
    """Per shape: the speedup over sequential of what was written (1.0 where sequential) against
    the brute-force best, and the mean ratio of the two."""
    lines = [f"{'shape':>16} {'tuned':>6} {'brute':>6} {'ratio':>6}  brute-force best"]
    ratios = []
    for e in entries:
        shape = "x".join(map(str, e["shape"]))
        row = next(r for r in rows if r["shape"] == shape)
        tuned = 1.0 if e["config"].get("sequential") else e["measured"]["speedup"]
        brute = row["seq_ms"] / row["brute_ms"]
        ratios.append(tuned / brute)
        lines.append(f"{shape:>16} {tuned:>6.3f} {brute:>6.3f} {ratios[-1]:>6.1%}  {row['brute_config']}")
    lines.append(f"mean tuned / brute-force speedup: {statistics.mean(ratios):.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
