"""The tuner on the CPU: what it writes from measured finalists, its summaries and command line."""

import json
import math

import pytest

from flashoverlap.registry import entry, incumbent, read_entries, write_registry
from flashoverlap.tune import brute_summary, format_summary
from flashoverlap.tune_model import fit_comm


def test_a_retune_measures_the_registry_s_entry_and_keeps_it_where_it_wins(tmp_path):
    """registry.incumbent: the entry --output holds for the call (its timing too; none where sequential)
    is measured beside the finalists; written again where it measures fastest, with or without a
    partition of its own; read_entries refuses another GPU's file before anything is measured."""
    from flashoverlap.tune import config_to_write

    path = tmp_path / "tuned.yaml"
    assert read_entries(str(path), "NVIDIA H200", 2) == []
    pull = {"comm_sms": 4, "reduction": "pull", "partition": [1, 2, 1]}
    written = [
        entry("all_reduce", "nvlink", "bfloat16", (4096, 8192, 8192), pull, {"speedup": 1.2}),
        entry("all_reduce", "nvlink", "bfloat16", (4096, 8192, 8192), {"symmetric": True}, {}, "graphs"),
        entry("all_reduce", "nvlink", "bfloat16", (1024, 8192, 8192), {"sequential": True}, {}),
    ]
    write_registry(str(path), "NVIDIA H200", 2, written)
    existing = read_entries(str(path), "NVIDIA H200", 2)
    with pytest.raises(ValueError, match="holds configs for 'NVIDIA H200' x2, not 'NVIDIA H100' x2"):
        read_entries(str(path), "NVIDIA H100", 2)
    assert incumbent(existing, "all_reduce", "nvlink", "bfloat16", (4096, 8192, 8192), "eager") == written[0]
    assert incumbent(existing, "all_reduce", "nvlink", "bfloat16", (4096, 8192, 8192), "graphs") == written[1]
    assert incumbent(existing, "all_reduce", "nvlink", "bfloat16", (1024, 8192, 8192), "eager") is None  # sequential
    assert incumbent(existing, "all_reduce", "pcie", "bfloat16", (4096, 8192, 8192), "eager") is None
    assert incumbent(existing, "reduce_scatter", "nvlink", "bfloat16", (4096, 8192, 8192), "eager") is None

    def row(config, partition, measured_ms, predicted_ms=1.0):
        return {"config": config, "partition": partition, "measured_ms": measured_ms, "seq_ms": 1.2,
                "speedup": 1.2 / measured_ms, "predicted_ms": predicted_ms, "shape": "4096x8192x8192"}  # fmt: skip

    finalists = [row("{}", [2, 2], 1.05), row('{"comm_sms": 8}', [3, 1], 1.02)]
    registry_s = row('{"comm_sms": 4, "reduction": "pull"}', [1, 2, 1], 1.0, None)
    assert config_to_write([*finalists, registry_s], 0.02)[0] == pull
    assert config_to_write([*finalists, {**registry_s, "config": '{"symmetric": true}', "partition": None}], 0.02)[
        0
    ] == {"symmetric": True}
    assert config_to_write([*finalists, {**registry_s, "measured_ms": 1.1, "speedup": 1.2 / 1.1}], 0.02)[0] == {
        "comm_sms": 8,
        "partition": [3, 1],
    }
    text = format_summary([*finalists, registry_s])
    assert text.splitlines()[-1].split()[1:3] == ["-", "1.000"]  # no prediction for the registry's entry


def test_a_retune_that_replaces_an_entry_it_measured_far_below_its_recorded_speedup_warns():
    """tune.slow_incumbent: the registry's entry measured below SLOW_INCUMBENT of the speedup it was
    written with and replaced: a warning naming both speedups (a process whose pulls run slow swaps
    good entries); none where it held up, is written again, was a finalist that held, or has no
    recorded speedup."""
    from flashoverlap.tune import SLOW_INCUMBENT, slow_incumbent

    pull = {"comm_sms": 8, "reduction": "pull_scatter", "partition": [3, 2, 1]}
    held = entry("all_reduce", "nvlink", "bfloat16", (8192, 8192, 8192), pull, {"speedup": 1.246})
    new = entry("all_reduce", "nvlink", "bfloat16", (8192, 8192, 8192), {"symmetric": True, "partition": [4, 2]}, {})

    def rows(speedup):
        return [
            {"config": '{"symmetric": true}', "partition": [4, 2], "speedup": 1.232},
            {"config": '{"comm_sms": 8, "reduction": "pull_scatter"}', "partition": [3, 2, 1], "speedup": speedup},
        ]

    warning = slow_incumbent(held, new, rows(0.469))
    assert warning is not None and "8192x8192x8192" in warning and "0.469x" in warning and "1.246x" in warning
    assert slow_incumbent(held, new, rows(1.246 * SLOW_INCUMBENT * 1.01)) is None  # held up: a fair swap
    assert slow_incumbent(held, new, rows(1.246 * SLOW_INCUMBENT * 0.99)) is not None
    assert slow_incumbent(held, {**new, "config": pull}, rows(0.469)) is None  # written again
    for free_form in ({}, None, "by hand", {"speedup": "1.2x"}):  # (measured is free-form: no number, no warning)
        assert slow_incumbent({**held, "measured": free_form}, new, rows(0.469)) is None
    other = {**rows(0.469)[1], "partition": [1, 2, 3]}  # the same config with another partition is not it
    assert slow_incumbent(held, new, [rows(0.469)[0], other]) is None


def test_a_retune_warns_on_rank_0_and_still_writes_the_new_entry(tmp_path, monkeypatch, caplog):
    """tune._tune_shapes hands slow_incumbent the registry's whole entry for the shape and logs its
    warning on rank 0 only, then writes the file as it would without it."""
    import argparse
    import logging

    from flashoverlap import tune

    pull = {"comm_sms": 8, "reduction": "pull_scatter", "partition": [3, 2, 1]}
    shape = (8192, 8192, 8192)
    existing = [entry("all_reduce", "nvlink", "bfloat16", shape, pull, {"speedup": 1.246})]
    new = entry("all_reduce", "nvlink", "bfloat16", shape, {"symmetric": True, "partition": [4, 2]}, {"speedup": 1.232})
    summary = [
        {"config": '{"symmetric": true}', "partition": [4, 2], "speedup": 1.232, "shape": "8192x8192x8192"},
        {"config": '{"comm_sms": 8, "reduction": "pull_scatter"}', "partition": [3, 2, 1], "speedup": 0.469,
         "shape": "8192x8192x8192"},
    ]  # fmt: skip
    seen = {}

    def tune_shape(*args):
        seen["current"] = args[10]
        return new, summary

    written = []
    monkeypatch.setattr(tune, "tune_shape", tune_shape)
    monkeypatch.setattr(tune, "write_registry", lambda path, gpu, world, entries: written.append(list(entries)))
    monkeypatch.setattr(tune.dist, "broadcast_object_list", lambda objects, src: None)
    args = argparse.Namespace(
        collective="all_reduce", transport="nvlink", dtype="bfloat16", graphs=False, rounds=10, top=4, margin=0.02,
        brute_force=0, fast_accum=False, output=str(tmp_path / "tuned.yaml"), csv=None,
    )  # fmt: skip
    for rank, warned in ((0, True), (1, False)):
        monkeypatch.setattr(tune.dist, "get_rank", lambda rank=rank: rank)
        caplog.clear()
        written.clear()
        with caplog.at_level(logging.WARNING, logger="flashoverlap.tune"):
            entries, _ = tune._tune_shapes(args, [shape], [{}], existing, False, "NVIDIA H200", 4)
        assert seen["current"] == pull and entries == [new]
        assert any("0.469x" in r.getMessage() and "1.246x" in r.getMessage() for r in caplog.records) is warned
        assert written == ([[new]] if rank == 0 else [])


def test_the_tuner_writes_what_wins_against_sequential_round_by_round():
    """The paired speedup decides (timing.paired_speedup), not two medians taken apart, which the
    host's drift between turns moves: a finalist whose median looks 5 % faster but that lost in
    its turns is not written, and of two winners the one that won more in its turns is; a finalist
    some rank could not time (NaN) is none."""
    from flashoverlap.tune import config_to_write

    def row(config, measured_ms, speedup):
        return {"config": config, "partition": [1, 1], "measured_ms": measured_ms, "seq_ms": 1.0, "speedup": speedup}

    assert config_to_write([row("{}", 0.95, 0.99)], 0.02) == ({"sequential": True}, 0.99)
    written, speedup = config_to_write([row("{}", 0.9, 1.05), row('{"comm_sms": 8}', 0.92, 1.08)], 0.02)
    assert written == {"comm_sms": 8, "partition": [1, 1]} and speedup == 1.08
    assert config_to_write([row("{}", 0.9, math.nan), row('{"comm_sms": 8}', 0.92, 1.08)], 0.02)[0]["comm_sms"] == 8


def test_an_entry_that_cannot_carry_every_call_gets_the_best_finalist_that_can_as_its_fallback():
    from flashoverlap.tune import measured_entry

    def row(config, measured_ms, partition=(1, 2)):
        return {"config": config, "partition": list(partition), "measured_ms": measured_ms, "seq_ms": 1.0,
                "speedup": 1 / measured_ms}  # fmt: skip

    rows = [row('{"layout": "rows"}', 0.85), row("{}", 0.95, (2, 1)), row('{"comm_sms": 24}', 0.9)]
    written = measured_entry("all_to_all", "nvlink", "bfloat16", (8, 8, 8), rows, 0.02)
    assert written["config"] == {"layout": "rows", "partition": [1, 2]}
    assert written["fallback"] == {"comm_sms": 24, "partition": [1, 2]}
    assert written["measured"] == {"speedup": round(1 / 0.85, 3)}
    # the others lose to sequential: so does the fallback
    slow = [row('{"layout": "rows"}', 0.85), row("{}", 1.05)]
    assert measured_entry("reduce_scatter", "pcie", "bfloat16", (8, 8, 8), slow, 0.02)["fallback"] == {
        "sequential": True
    }
    # a symmetric all-to-all (equal splits only) falls back to a finalist without windows; a
    # symmetric reduce-scatter carries every call
    windows = [row('{"symmetric": true}', 0.8), row('{"layout": "rows"}', 0.85), row('{"comm_sms": 24}', 0.9)]
    assert measured_entry("all_to_all", "nvlink", "bfloat16", (8, 8, 8), windows, 0.02)["fallback"] == {
        "comm_sms": 24,
        "partition": [1, 2],
    }
    assert "fallback" not in measured_entry("reduce_scatter", "nvlink", "bfloat16", (8, 8, 8), windows, 0.02)
    # nothing to fall back from
    assert "fallback" not in measured_entry("reduce_scatter", "pcie", "bfloat16", (8, 8, 8), rows[1:], 0.02)
    assert measured_entry("all_to_all", "pcie", "bfloat16", (8, 8, 8), [row("{}", 0.99)], 0.02)["config"] == {
        "sequential": True
    }


def test_summary_and_cli_errors(capsys, monkeypatch):
    from flashoverlap import tune

    rows = [
        dict(shape="8x8x8", config="{}", partition=[1], predicted_ms=1.1, measured_ms=1.0, seq_ms=1.2, speedup=1.19)
    ]
    text = format_summary(rows)
    assert "+10.0%" in text and "8x8x8" in text and "1.190" in text  # (the paired speedup, not 1.2 / 1.0)
    with pytest.raises(SystemExit):
        tune.main(["--output", "x.yaml"])  # no shapes
    assert "give --shapes" in capsys.readouterr().err
    monkeypatch.delenv("RANK", raising=False)
    assert tune.main(["--shapes", "8x8x8", "--output", "x.yaml", "--graphs"]) == 2
    assert "torchrun" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a candidate the collective cannot take, before anything runs
        tune.main(["--collective", "reduce_scatter", "--shapes", "8x8x8", "--output", "x.yaml",
                   "--candidates", '{"layout": "tiles"}'])  # fmt: skip
    assert 'candidate {"layout": "tiles"}: reduce_scatter needs layout' in capsys.readouterr().err
    with pytest.raises(SystemExit):  # P2P disabled: calls run without windows, nothing left to tune
        tune.main(["--shapes", "8x8x8", "--output", "x.yaml", "--transport", "pcie",
                   "--candidates", '{"symmetric": true}', '{"reduction": "pull"}'])  # fmt: skip
    assert "symmetric windows and pulls need peer access" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main(["--shapes", "8x8x8", "--output", "x.yaml", "--fast-accum"])
    assert "--fast-accum is for FP8 operands (--dtype float8_e4m3fn), not bfloat16" in capsys.readouterr().err
    assert tune.main(["--shapes", "8x8x8", "--output", "x.yaml", "--dtype", "float8_e4m3fn", "--fast-accum"]) == 2
    assert "torchrun" in capsys.readouterr().err  # (accepted: then it needs torchrun)


def test_other_gpus_registry_and_a_world_of_one_are_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    import torch

    from flashoverlap import tune

    path = tmp_path / "tuned.yaml"
    write_registry(str(path), "NVIDIA H200", 2, [entry("all_reduce", "nvlink", "bfloat16", (8, 8, 8), {}, {})])
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (a machine of two GPUs)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: pytest.fail("ran past the registry check"))
    with pytest.raises(SystemExit):
        tune.main(["--shapes", "8x8x8", "--output", str(path)])
    assert "holds configs for 'NVIDIA H200' x2, not 'NVIDIA H100 80GB HBM3' x2" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "1")  # one rank communicates nothing: refused before any GPU work
    with pytest.raises(SystemExit):
        tune.main(["--shapes", "8x8x8", "--output", str(tmp_path / "new.yaml")])
    assert "tuning needs two or more ranks" in capsys.readouterr().err


def test_under_torchrun_without_gpus_the_tuner_says_so(tmp_path, capsys, monkeypatch):
    import torch

    from flashoverlap import tune

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune.main(["--shapes", "8x8x8", "--output", str(tmp_path / "new.yaml")]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().err


def test_brute_force_keeps_the_best_paired_ratio_to_sequential(monkeypatch):
    """Every partition of every candidate against sequential in its batch, each ratio paired round by
    round; one some rank could not time (NaN) is none."""
    import types

    from flashoverlap import tune

    samples = {"seq": [[1.0, 2.0, 1.0, 2.0]], "b0": [[1.1, 2.2, 1.1, 2.2]], "b1": [[0.95, 1.9, 0.95, 1.9]],
               "b2": [[math.nan] * 4]}  # fmt: skip
    monkeypatch.setattr(tune, "time_samples", lambda variants, *a, **kw: {name: samples[name] for name in variants})
    monkeypatch.setattr(tune, "_progress", lambda message: None)
    monkeypatch.setattr(tune, "plain", lambda *a: lambda x, w, s: None)
    monkeypatch.setattr(tune.dist, "get_world_size", lambda group=None: 2)
    preps = [types.SimpleNamespace(plan=types.SimpleNamespace(num_waves=3))]  # partitions (3,), (1, 2), (2, 1)
    args = tune.bench.Fp8Arguments(None, None, {})
    ratio, config = tune._brute_force((8, 8, 8), "all_reduce", [{}], preps, 2, [None], [None], 4, None, False, args)
    assert ratio == pytest.approx(0.95) and json.loads(config) == {"partition": [1, 2]}


def test_brute_force_summary_compares_what_was_written(capsys):
    from flashoverlap import tune

    entries = [
        entry("all_reduce", "nvlink", "bfloat16", (8, 8, 8), {"partition": [1]}, {"speedup": 1.2}),
        entry("all_reduce", "nvlink", "bfloat16", (16, 8, 8), {"sequential": True}, {"speedup": 0.9}),
    ]
    rows = [
        {"shape": "8x8x8", "seq_ms": 1.5, "brute_ms": 1.0, "brute_config": '{"partition": [1]}'},
        {"shape": "16x8x8", "seq_ms": 1.0, "brute_ms": 1.0, "brute_config": '{"sequential": true}'},
    ]
    text = brute_summary(entries, rows)
    assert "80.0%" in text and "100.0%" in text and "mean tuned / brute-force speedup: 90.0%" in text
    with pytest.raises(SystemExit):
        tune.main(["--shapes", "8x8x8", "--output", "x.yaml", "--brute-force", "-1"])
    assert "--brute-force takes" in capsys.readouterr().err
    for top in ("0", "-1"):  # (a negative slice would measure all but the last)
        with pytest.raises(SystemExit):
            tune.main(["--shapes", "8x8x8", "--output", "x.yaml", "--top", top])
        assert "--top takes" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # candidates are configs to measure, not "registry"
        tune.main(["--shapes", "8x8x8", "--output", "x.yaml", "--candidates", "registry"])
    assert "expected a JSON object" in capsys.readouterr().err


def test_default_candidates_are_prebuilt_for_hopper():
    """Every default candidate is a valid config whose H100/H200 kernel bench/kernels.yaml lists,
    so a tuning run times kernels, not compiles."""
    from pathlib import Path

    from flashoverlap import precompile
    from flashoverlap.tune import DEFAULT_CANDIDATES

    items = precompile.load_items(str(Path(__file__).resolve().parent.parent / "bench" / "kernels.yaml"))
    prebuilt = set()
    for item in items:
        call, cfgs = precompile.call_and_configs(item)
        prebuilt |= {precompile.spec_for(call, cfg, (9, 0)) for cfg in cfgs}
    for collective, candidates in DEFAULT_CANDIDATES.items():
        for candidate in candidates:
            call, cfgs = precompile.call_and_configs({**candidate, "collective": collective})
            for cfg in cfgs:
                assert precompile.spec_for(call, cfg, (9, 0)) in prebuilt, (collective, candidate, cfg.layout)


def test_sums_that_read_in_place_are_a_kind_per_sm_count():
    """tune.finalist_kinds: a candidate's way of communicating, and for pull_scatter its SM count too,
    so that each count's best predicted is measured (the pull model cannot tell them apart); copies
    (a pull all-reduce, a reduce-scatter's or an all-to-all's pull) and NCCL stay one kind."""
    from flashoverlap.config import OverlapConfig
    from flashoverlap.rules import comm_pattern, for_collective
    from flashoverlap.tune import finalist_kinds

    def kinds(collective, *fields):
        cfgs = [for_collective(OverlapConfig(**f), collective) for f in fields]
        return finalist_kinds(cfgs, [comm_pattern(collective, c.layout, c.reduction) for c in cfgs])

    scatter = [{"reduction": "pull_scatter", "comm_sms": sms} for sms in (4, 8, 16)]
    assert kinds("all_reduce", {}, {"comm_sms": 8}, *scatter) == [
        "all_reduce", "all_reduce", "pull_scatter 4", "pull_scatter 8", "pull_scatter 16"
    ]  # fmt: skip
    assert kinds("all_reduce", {"reduction": "pull", "comm_sms": 4}, {"reduction": "pull", "comm_sms": 0}) == [
        "pull", "pull"
    ]  # fmt: skip
    pulls = [{"layout": "segments", "reduction": "pull", "comm_sms": sms} for sms in (4, 16)]
    assert kinds("reduce_scatter", *pulls) == ["pull", "pull"]  # (copies, summed locally)
    assert kinds("all_to_all", *pulls) == ["pull", "pull"]


def test_a_model_that_cannot_be_fitted_drops_its_candidates_instead_of_the_run(monkeypatch):
    from flashoverlap import tune

    said = []
    monkeypatch.setattr(tune, "_progress", said.append)

    def flat(pattern, comm_sms):  # a one-rank all-reduce in place: no time grows with size
        return fit_comm([1e6, 2e6], [0.01, 0.009])

    assert tune._fitted(flat, "all_reduce", 4) is None
    assert said and "flat('all_reduce', 4): measured times do not grow with size" in said[0]
    assert tune._fitted(lambda p: fit_comm([1e6, 2e6], [0.01, 0.02]), "x").bytes_per_ms == pytest.approx(1e8)


@pytest.mark.multigpu
def test_a_retune_on_two_gpus_measures_the_registry_s_entry_beside_its_finalists(tmp_path):
    """End to end under torchrun on two GPUs (a tiny shape: the steps run, the numbers mean little):
    the entry --output holds for the shape is measured beside the finalists, and the file keeps one
    valid entry for it. (On one rank the collectives move nothing: the tuner refuses it.)"""
    import subprocess
    import sys

    import torch

    from flashoverlap import registry

    path = tmp_path / "tuned.yaml"
    shape = (1024, 1024, 512)  # 32 tiles: one wave
    held = entry("all_reduce", "nvlink", "bfloat16", shape, {"comm_sms": 8, "partition": [1]}, {"speedup": 1.0})
    write_registry(str(path), torch.cuda.get_device_name(0), 2, [held])
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "flashoverlap.tune",
               "--shapes", "1024x1024x512", "--candidates", "{}", "--rounds", "2", "--output", str(path)]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "the registry's" in run.stdout + run.stderr
    assert [e.shape for e in registry.load([path])] == [shape]


def test_fp8_calls_are_tuned_with_their_scales_and_their_result_s_dtype(monkeypatch):
    """--dtype float8_e4m3fn: candidates naming no tile are planned in FP8's 256 x 128 and for FP8
    operands; the GEMM and the kernels are timed with the calls' scales, the collectives modelled on
    the bf16 result they move; the finalists and sequential are measured with the calls' FP8
    arguments (CPU stand-ins for what runs on the GPUs)."""
    import types

    import torch

    from flashoverlap import comm, overlap, tune
    from flashoverlap.bench import Fp8Arguments
    from flashoverlap.config import OverlapConfig
    from flashoverlap.inputs import Fp8, Scales
    from flashoverlap.plan import make_plan
    from flashoverlap.tune_model import HostModel

    fp8 = torch.float8_e4m3fn
    scales, kind = Scales(torch.ones(1), torch.full((1,), 0.5)), Fp8(torch.bfloat16)
    args = Fp8Arguments(scales, kind, {"scale_a": scales.a, "scale_b": scales.b, "use_fast_accum": False})
    shape = (1024, 1024, 256)
    ex = comm.exchange("all_reduce", shape[0], 2)
    planned, used = [], []

    def prepare(m, n, k, dtype, layout, device, cfg, **kw):
        planned.append((dtype, cfg.tile_m, cfg.tile_n, kw.get("fp8")))
        plan = make_plan(m, n, tile_m=cfg.tile_m, tile_n=cfg.tile_n, cluster_m=1, ctas=4, layout="rows")
        return types.SimpleNamespace(plan=plan)

    monkeypatch.setattr(tune, "prepare", prepare)
    monkeypatch.setattr(tune, "widest_budget", lambda plan, total: 0)
    gpu = types.SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpu)
    candidates, cfgs, preps = tune._widened([{}, {"tile_n": 128}], ex, shape, fp8, torch.device("cpu"), kind)
    assert planned == [(fp8, 256, 128, kind), (fp8, 128, 128, kind)]

    def time_variants(variants, *args, **kwargs):
        for run in variants.values():
            run(0)
        return dict.fromkeys(variants, 1.0)

    def time_samples(variants, *args, **kwargs):  # (one rank, one round)
        return {name: [[t]] for name, t in time_variants(variants).items()}

    def model(name):
        def fitted(*args):
            used.append((name, args))
            return fit_comm([1, 2], [1.0, 2.0])

        return fitted

    monkeypatch.setattr(tune, "time_variants", time_variants)
    monkeypatch.setattr(tune, "time_samples", time_samples)
    monkeypatch.setattr(tune, "_progress", lambda message: None)
    monkeypatch.setattr(tune.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(tune, "plain", lambda *a: lambda x, w, s: used.append(("product", s)))
    monkeypatch.setattr(tune, "kernel_alone", lambda prep, a, w, s: lambda i: used.append(("kernel", s)))
    for name in ("tail_model", "comm_model", "local_model"):
        monkeypatch.setattr(tune, name, model(name))
    monkeypatch.setattr(tune, "host_model", lambda *a: used.append(("host", a[-1])) or HostModel())
    a, w = [torch.zeros(1024, 256, dtype=fp8)], [torch.zeros(1024, 256, dtype=fp8)]
    patterns = [comm.comm_pattern("all_reduce", c.layout, c.reduction) for c in cfgs]
    tune._problems(shape, "all_reduce", cfgs, patterns, preps, {}, a, w, ex, fp8, 2, False, args)
    assert ("product", scales) in used and ("kernel", scales) in used and ("host", args.kwargs) in used
    moved = [next(x for x in call if isinstance(x, torch.dtype)) for name, call in used if name.endswith("model")]
    assert moved and set(moved) == {torch.bfloat16}

    calls = []
    monkeypatch.setattr(
        tune, "plain", lambda ex, group, layout, world, kind: lambda x, w, s: calls.append(("seq", (s, kind)))
    )
    monkeypatch.setattr(overlap, "gemm_all_reduce", lambda x, w, config, **kw: calls.append(("fo", kw, config)))
    finalists = [(types.SimpleNamespace(partition=(1, 1), overlap_ms=1.0), 0)]
    tune._confirm(shape, "all_reduce", candidates, finalists, None, a, w, ex, 2, False, args)
    assert ("seq", (scales, kind)) in calls
    # finalists are called as a registry entry's calls are: resolved once (FP8's tiles), so that a
    # repeat takes the call's fast path instead of deciding a mapping again every call
    [(_, kw, config)] = [c for c in calls if c[0] == "fo"]
    assert kw == args.kwargs and isinstance(config, OverlapConfig)
    assert (config.tile_m, config.tile_n, config.partition) == (256, 128, (1, 1))


def test_a_fused_reduce_scatter_is_modelled_from_its_copies_alone(monkeypatch):
    """tune._problems for a pull_fused reduce-scatter: its groups' copies priced as the pull
    all-reduce's copies of 1 / (w - 1) from each rank (one rank's rows from that rank), nothing kept
    to add after them (its epilogue adds its own rows), and a partition found for it."""
    import types

    import torch

    from flashoverlap import comm, tune
    from flashoverlap.bench import Fp8Arguments
    from flashoverlap.config import OverlapConfig
    from flashoverlap.plan import make_plan
    from flashoverlap.rules import for_collective
    from flashoverlap.tune_model import HostModel, choose

    world, shape = 4, (4096, 1024, 256)
    ex = comm.exchange("reduce_scatter", shape[0], world, reduction="pull_fused")
    cfg = for_collective(OverlapConfig(reduction="pull_fused", comm_sms=0, tile_n=128), "reduce_scatter")
    plan = make_plan(*shape[:2], tile_m=128, tile_n=128, cluster_m=1, ctas=8, layout="rows", split=world)
    used = []
    monkeypatch.setattr(tune, "time_variants", lambda variants, *a, **kw: dict.fromkeys(variants, 1.0))
    monkeypatch.setattr(tune, "_progress", lambda message: None)
    monkeypatch.setattr(tune.dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(tune, "plain", lambda *a: lambda x, w, s: None)
    monkeypatch.setattr(tune, "kernel_alone", lambda prep, a, w, s: lambda i: None)
    for name in ("tail_model", "comm_model", "local_model"):
        monkeypatch.setattr(tune, name, lambda *args, name=name: used.append((name, args)) or fit_comm([1, 2], [1, 2]))
    monkeypatch.setattr(tune, "host_model", lambda *a: HostModel())
    args = Fp8Arguments(None, None, {})
    a = w = [torch.zeros(1, 1, dtype=torch.bfloat16)]
    pattern = comm.comm_pattern("reduce_scatter", cfg.layout, cfg.reduction)
    prep = types.SimpleNamespace(plan=plan)
    (problem,), _ = tune._problems(
        shape, "reduce_scatter", [cfg], [pattern], [prep], {}, a, w, ex, torch.bfloat16, 2, True, args
    )
    unrotated = tune.wave_bytes(plan, 2, world)
    assert problem.wave_bytes == tuple(b / (world - 1) for b in unrotated) and sum(problem.wave_bytes) > 0
    assert not any(problem.local_bytes) and len(problem.local_bytes) == plan.num_waves
    assert all(name != "local_model" for name, _ in used)
    assert sum(choose(problem, 10.0).partition) == plan.num_waves
