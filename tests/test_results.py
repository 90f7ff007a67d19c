"""bench/results.py: bench CSVs as tidy rows, appended per machine, the current runs, tables and plots."""

import csv
import importlib.util
import math
import random
from pathlib import Path

import pytest

from flashoverlap import report

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_results", ROOT / "bench" / "results.py")
results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results)


def bench_row(m, config, t_fo, t_seq=1.0, t_gemm=0.8, t_comm=0.3, asynctp=math.nan, world=2, **extra):
    """A row as ``python -m flashoverlap.bench --csv`` writes it (bench_shape's keys, then main's)."""
    row = {
        "m": m,
        "n": 8192,
        "k": 8192,
        "world": world,
        "collective": "all_reduce",
        "dtype": "bfloat16",
        "config": config,
        "waves": 8,
        "groups": 3,
        "t_gemm_ms": t_gemm,
        "t_comm_ms": t_comm,
        "t_seq_ms": t_seq,
        "t_fo_ms": t_fo,
        "t_kernel_ms": 0.82,
        "t_decomp_ms": 1.1,
        "decomp_chunks": 4,
        "t_asynctp_ms": asynctp,
        "speedup": t_seq / t_fo,
        "decomp_speedup": t_seq / 1.1,
        "asynctp_speedup": t_seq / asynctp,
        "ideal_speedup": t_seq / max(t_gemm, t_comm),
        "of_ideal": max(t_gemm, t_comm) / t_fo,
        "efficiency": (t_seq - t_fo) / min(t_gemm, t_comm),
        "kernel_vs_cublas": t_gemm / 0.82,
        "rel_err": 0.0,
        "gpu": "NVIDIA H200",
        "transport": "nvlink",
        "timing": "eager",
    }
    return dict(row, **extra)


def test_machine_names_one_file_per_kind():
    assert results.machine("NVIDIA H200", 2) == "h200x2"
    assert results.machine("NVIDIA H100 80GB HBM3", "4") == "h100x4"
    assert results.machine("NVIDIA GeForce RTX 4090", 2) == "rtx4090x2"
    assert results.machine("NVIDIA A100-SXM4-80GB", 8) == "a100x8"


def test_bench_rows_become_one_row_per_variant():
    rows = [
        bench_row(4096, 'registry:{"comm_sms": 4} nccl=direct', 0.9),
        bench_row(4096, '{"comm_sms": 16} nccl=direct', 0.95),
    ]
    out = results.tidy(rows, "2026-01-02", "abc1234", "run1")
    assert [r["variant"] for r in out] == [
        "gemm",
        "collective",
        "sequential",
        "decomposition",
        "flashoverlap",
        "signal-gemm",
        "flashoverlap",
        "signal-gemm",
    ]  # the baselines once per shape, no async-TP where it was not measured
    assert all(set(r) == set(results.FIELDS) for r in out)
    fo = out[4]
    assert fo["config"].startswith("registry:") and fo["ms"] == "0.9000" and fo["speedup"] == "1.1111"
    assert fo["efficiency"] == "0.333"  # (1.0 - 0.9) / min(0.8, 0.3)
    assert out[3]["config"] == "chunks=4" and out[2]["speedup"] == "1.0000" and out[0]["speedup"] == ""
    assert {r["mode"] for r in out} == {"eager"} and {r["shape"] for r in out} == {"4096x8192x8192"}


def test_the_plain_paths_variants_and_inputs_are_kept():
    """The forced fallback and seq timed again become variants of their own, hot inputs' rows keep
    their baselines beside the rotated ones', and the plain path's table reads them per inputs."""
    plain_path = dict(t_fallback_ms=1.02, t_seq_again_ms=0.98)
    rows = [
        bench_row(8, 'registry:{"sequential": true}', 1.0, t_seq=1.0, inputs="rotated", **plain_path),
        bench_row(8, 'registry:{"sequential": true}', 0.9, t_seq=0.9, inputs="hot", **plain_path),
        bench_row(2048, 'registry:{"comm_sms": 4}', 0.8, inputs="rotated", **plain_path),
    ]
    out = results.tidy(rows, "2026-01-02", "abc1234", "small")
    hot = [r for r in out if r["inputs"] == "hot"]
    assert [r["variant"] for r in hot] == [
        "gemm",
        "collective",
        "sequential",
        "decomposition",
        "flashoverlap",
        "fallback",
        "sequential-again",
        "signal-gemm",
    ]
    # the bench's own (paired) speedups, not the ratio of the medians; the efficiency from them
    paired = results.tidy(
        [bench_row(4096, "registry:{}", 0.8, speedup=1.3, noise_speedup=math.nan, **plain_path)], "d", "c", "r"
    )
    fo = next(r for r in paired if r["variant"] == "flashoverlap")
    assert fo["speedup"] == "1.3000" and fo["efficiency"] == "0.769"  # (1.0 - 1.0 / 1.3) / min(0.8, 0.3)
    again = next(r for r in paired if r["variant"] == "sequential-again")
    assert again["speedup"] == "1.0204"  # no column of its own: 1.0 / 0.98
    fallback = next(r for r in hot if r["variant"] == "fallback")
    assert fallback["ms"] == "1.0200" and fallback["speedup"] == "0.8824"  # against the hot seq's 0.9
    assert all(
        r["inputs"] == "rotated" for r in results.current(out)[("h200x2", "nvlink", "all_reduce", "eager", "bfloat16")]
    )
    text = results.plain(out, ["small"]).splitlines()
    assert text[2] == (
        "| small | 2x H200 | all-reduce | eager | rotated | 1.125 (1.000) | 0.980 (0.980) | 1.020 (1.020) "
        "| 1 of 2: 1.250 |"
    )
    assert text[3].startswith("| small | 2x H200 | all-reduce | eager | hot | 1.000 (1.000) | 0.882 (0.882) |")
    with pytest.raises(ValueError, match="no rows of run"):
        results.plain(out, ["elsewhere"])


def test_the_plain_table_of_an_unknown_run_is_a_clear_error(tmp_path, capsys):
    store = tmp_path / "results"
    store.mkdir()
    with pytest.raises(SystemExit):
        results.main(["--results", str(store), "plain", "nowhere"])
    assert "no rows of run 'nowhere'" in capsys.readouterr().err


def write_bench(path: Path, rows: list[dict]) -> Path:
    report.write_csv(str(path), rows)
    return path


def test_appended_runs_and_which_are_current(tmp_path, capsys):
    store = tmp_path / "results"
    store.mkdir()
    old = write_bench(tmp_path / "old.csv", [bench_row(m, "registry:{}", 0.9) for m in (1024, 4096)])
    branch = write_bench(tmp_path / "branch.csv", [bench_row(m, "registry:{}", 0.5) for m in (1024, 4096)])
    new = [
        write_bench(tmp_path / f"new{i}.csv", [bench_row(m, "registry:{}", t) for m in (1024, 4096)])
        for i, t in enumerate((0.8, 0.7))
    ]
    four = write_bench(tmp_path / "four.csv", [bench_row(4096, "registry:{}", 0.85, world=4)])
    fp8 = write_bench(tmp_path / "fp8.csv", [bench_row(4096, "registry:{}", 0.95, dtype="float8_e4m3fn")])
    base = ["--results", str(store), "append"]
    assert results.main([*base, str(old), "--commit", "c1", "--date", "2026-01-01"]) == 0
    assert results.main([*base, str(branch), "--commit", "c2", "--date", "2026-01-02", "--note", "a branch"]) == 0
    assert results.main([*base, *map(str, new), str(four), "--commit", "c2", "--date", "2026-01-02"]) == 0
    assert results.main([*base, str(fp8), "--commit", "c3", "--date", "2026-01-03"]) == 0  # no newer bf16 run
    assert sorted(p.name for p in store.glob("*.csv")) == ["h200x2.csv", "h200x4.csv"]
    rows = results.load(store)
    with open(store / "h200x2.csv", newline="") as handle:
        assert csv.DictReader(handle).fieldnames == results.FIELDS
    now = results.current(rows)
    setups = [(f"h200x{w}", "nvlink", "all_reduce", "eager", "bfloat16") for w in (2, 4)]
    assert set(now) == {*setups, ("h200x2", "nvlink", "all_reduce", "eager", "float8_e4m3fn")}
    two = now[setups[0]]
    assert {r["run"] for r in two} == {"new0", "new1"}  # the latest commit's, without the noted branch
    shapes = results.per_shape(two)
    assert list(shapes) == ["1024x8192x8192", "4096x8192x8192"]
    assert shapes["4096x8192x8192"]["flashoverlap"] == pytest.approx((1 / 0.8 + 1 / 0.7) / 2, abs=1e-4)  # a median
    assert shapes["4096x8192x8192"]["ideal"] == pytest.approx(1.25)
    capsys.readouterr()
    assert results.main(["--results", str(store), "table"]) == 0
    text = capsys.readouterr().out
    assert "| 2x H200 | NVLink | all-reduce | eager | 1.339 (1.339) |" in text and "2026-01-02 c2" in text
    assert "| 2x H200 | NVLink | all-reduce (FP8 e4m3fn) | eager | 1.053 (1.053) |" in text
    assert results.main(["--results", str(store), "table", "--shapes"]) == 0
    assert "median of 2 runs" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    assert results.main(["--results", str(store)]) == 0
    drawn = sorted(p.name for p in (store / "plots").glob("*.png"))
    assert drawn == [
        "h200x2_nvlink_all_reduce_eager.png",
        "h200x2_nvlink_all_reduce_eager_float8_e4m3fn.png",
        "h200x4_nvlink_all_reduce_eager.png",
        "summary.png",
    ]


def _rounds_csv(path, shapes):
    """A ``--rounds-csv`` of 30 rounds on two ranks: per shape, (variant, config, ratio per round
    against ``seq``) each; the host's speed drifts between rounds, every variant of a round alike."""
    rng = random.Random(0)
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["shape", "inputs", "variant", "config", "rank", "round", "ms"])
        for shape, variants in shapes.items():
            for rank in (0, 1):
                for r in range(30):
                    host = rng.uniform(1.0, 2.0)
                    for variant, config, ratio in variants:
                        out.writerow([shape, "hot", variant, config, rank, r, host / ratio(r)])


def test_rounds_tell_a_loss_from_the_noise_of_one_run(tmp_path, capsys):
    """``rounds``: per input mode and variant, the worst shape's paired speedup over seq with its
    interval; a shape counts as below the floor (or outside seq's band) only where its whole
    interval is: a steady 5 % loss and a steady 20 % win do, a noisy tie whose median lies below the
    floor does not; the registry's calls decided plain and overlapped apart; a shape without seq
    left out; the parts never compared; a table per file."""
    plain = 'registry:{"layout": "auto", "sequential": true} nccl=direct'
    pull = 'registry:{"reduction": "pull"} nccl=direct'
    tie = [0.86 + 0.0075 * i for i in range(16)] + [1.0 + 0.011 * i for i in range(14)]  # median 0.969
    seq = ("seq", "", lambda r: 1.0)
    shapes = {
        "8x8192x2048": [seq, ("fallback", "", lambda r: tie[(7 * r) % 30]), ("fo0direct", plain, lambda r: 0.95)],
        "2048x8192x2048": [seq, ("fallback", "", lambda r: 1.0), ("fo0direct", pull, lambda r: 1.2)],
        "64x8192x2048": [("fallback", "", lambda r: 0.5), ("gemm", "", lambda r: 2.0)],  # (no seq)
    }
    _rounds_csv(tmp_path / "a.csv", shapes)
    _rounds_csv(tmp_path / "b.csv", {"8x8192x2048": shapes["8x8192x2048"][:2]})
    assert results.main(["rounds", str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]) == 0
    printed = capsys.readouterr().out
    first, second = (part.splitlines() for part in printed.split("b.csv:"))
    rows = {line.split(" | ")[1]: line.split(" | ") for line in first if line.startswith("| hot")}
    assert set(rows) == {"fallback", "fo0direct: registry, plain", "fo0direct: registry, overlapped"}
    assert rows["fallback"][2] == "2" and rows["fallback"][4].startswith("0.969 (")
    assert rows["fallback"][5:] == ["0", "0 |"]  # (the tie's interval reaches past the floor and 1)
    assert rows["fo0direct: registry, plain"][4].startswith("0.950 (0.950-0.950, 8x8192x2048)")
    assert rows["fo0direct: registry, plain"][5:] == ["1: 8x8192x2048", "1: 8x8192x2048 |"]
    assert rows["fo0direct: registry, overlapped"][5:] == ["0", "1: 2048x8192x2048 |"]
    assert [line.split(" | ")[1] for line in second if line.startswith("| hot")] == ["fallback"]
    assert "gemm" not in printed and "64x8192x2048" not in printed


def test_committed_results_are_tidy():
    """The committed CSVs (what the README's and docs' numbers are read from) keep the columns and
    variants the tools read, and every setup with the registry's picks has current runs."""
    store = ROOT / "bench" / "results"
    paths = results.machine_csvs(store)
    assert paths, "bench/results holds a CSV per machine kind"
    for path in paths:
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            assert reader.fieldnames == results.FIELDS, path
            for row in reader:
                assert row["variant"] in results.VARIANTS and float(row["ms"]) > 0, (path, row)
                assert row["inputs"] in ("rotated", "hot"), (path, row)
                assert results.machine(row["gpu"], row["world"]) == path.stem, (path, row)
    now = results.current(results.load(store))
    assert ("h200x2", "nvlink", "all_reduce", "eager", "bfloat16") in now
    with open(store / results.E2E, newline="") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == results.E2E_FIELDS
        models = list(reader)
    assert models and all(float(r["speedup"]) > 0 and float(r["bound_speedup"]) > 0 for r in models)
    assert {p.name for p in store.glob("*.csv")} == {results.E2E, *(p.name for p in paths)}


def _model_csv(path, rows):
    """A ``python -m flashoverlap.bench_model --csv`` output of ``rows`` (model, tp, transport, tokens,
    speedup, bound_speedup) on H200s."""
    fields = ["model", "tp", "tokens", "layers", "transport", "plain_ms", "flashoverlap_ms", "bound_ms"]
    fields += ["plain_tok_s", "flashoverlap_tok_s", "bound_tok_s", "speedup", "bound_speedup", "hidden"]
    fields += ["rel_err", "patched", "gpu"]
    with path.open("w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=fields)
        out.writeheader()
        for model, tp, transport, tokens, speedup, bound in rows:
            plain = tokens / 200_000 * 1e3
            out.writerow(
                dict(zip(fields, [model, tp, tokens, 2, transport, plain, plain / speedup, plain / bound]))
                | {"plain_tok_s": 200_000, "flashoverlap_tok_s": 200_000 * speedup, "bound_tok_s": 200_000 * bound}
                | {"speedup": speedup, "bound_speedup": bound, "hidden": (1 - 1 / speedup) / (1 - 1 / bound)}
                | {"rel_err": 0.0, "patched": 2 * 2, "gpu": "NVIDIA H200"}
            )
    return path


def test_end_to_end_runs_go_to_their_own_file(tmp_path, capsys):
    """``append`` sends bench_model's CSVs to e2e.csv (the machines' CSVs and their tools never see
    them); ``models`` prints, per machine, TP size and transport, the latest commit's un-noted runs,
    the median of each case over them, ordered by setup, model and prefill length (as numbers); the
    plots gain e2e.png."""
    store = tmp_path / "results"
    store.mkdir()
    bench = write_bench(tmp_path / "bench.csv", [bench_row(4096, "registry:{}", 0.8)])
    old = _model_csv(tmp_path / "old.csv", [("llama3-70b", 4, "nvlink", 8192, 1.01, 1.2)])
    pcie = _model_csv(tmp_path / "pcie.csv", [("qwen2.5-72b", 2, "pcie", 8192, 1.2, 1.6)])  # (only c1 has it)
    new = [
        _model_csv(tmp_path / f"new{i}.csv", [("llama3-70b", 4, "nvlink", t, s, 1.2) for t in (32768, 8192, 2048)])
        for i, s in enumerate((1.04, 1.05, 1.09))
    ]
    noted = _model_csv(tmp_path / "noted.csv", [("llama3-70b", 4, "nvlink", 8192, 1.5, 1.6)])
    base = ["--results", str(store), "append"]
    assert results.main([*base, str(bench), str(old), str(pcie), "--commit", "c1", "--date", "2026-01-01"]) == 0
    assert results.main([*base, *map(str, new), "--commit", "c2", "--date", "2026-01-02"]) == 0
    assert results.main([*base, str(noted), "--commit", "c3", "--date", "2026-01-03", "--note", "a branch"]) == 0
    assert sorted(p.name for p in store.glob("*.csv")) == ["e2e.csv", "h200x2.csv"]
    assert [p.name for p in results.machine_csvs(store)] == ["h200x2.csv"]
    assert {r["variant"] for r in results.load(store)} >= {"flashoverlap", "sequential"}  # (no model rows)
    with open(store / "e2e.csv", newline="") as handle:
        assert csv.DictReader(handle).fieldnames == results.E2E_FIELDS
    capsys.readouterr()
    assert results.main(["--results", str(store), "models"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "llama" in line or "qwen" in line]
    assert lines == [
        "| qwen2.5-72b | 2x H200 | P2P off | 8192 | 200,000 | 1.200x | 1.600x | 44% | 1: 2026-01-01 c1 |",
        "| llama3-70b | 4x H200 | NVLink | 2048 | 200,000 | 1.050x | 1.200x | 29% | 3: 2026-01-02 c2 |",
        "| llama3-70b | 4x H200 | NVLink | 8192 | 200,000 | 1.050x | 1.200x | 29% | 3: 2026-01-02 c2 |",
        "| llama3-70b | 4x H200 | NVLink | 32768 | 200,000 | 1.050x | 1.200x | 29% | 3: 2026-01-02 c2 |",
    ]
    pytest.importorskip("matplotlib")
    assert results.main(["--results", str(store)]) == 0
    assert (store / "plots" / "e2e.png").exists()


def test_end_to_end_table_without_runs_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        results.main(["--results", str(tmp_path), "models"])
    assert "no end-to-end runs" in capsys.readouterr().err
