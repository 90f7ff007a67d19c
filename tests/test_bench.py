"""The benchmark's CPU side: CLI parsing, shape files, statistics, table, CSV and plot."""

import argparse
import collections
import csv
import math
import os
import shutil
import subprocess

import pytest

from flashoverlap import bench


def test_shapes_and_configs_parse_with_clear_errors():
    assert bench.parse_shape("4096x8192X1024") == (4096, 8192, 1024)
    for bad in ("4096x8192", "ax1x1", "0x8x8"):
        with pytest.raises(argparse.ArgumentTypeError, match="MxNxK|positive"):
            bench.parse_shape(bad)
    assert bench.parse_config('{"comm_sms": 8}') == {"comm_sms": 8}
    with pytest.raises(argparse.ArgumentTypeError, match="JSON object"):
        bench.parse_config("[1]")
    with pytest.raises(argparse.ArgumentTypeError, match="JSON object"):
        bench.parse_config("{comm_sms: 8}")
    assert bench.parse_config("registry") is None  # the tuned registry's pick, as a call without config=


def test_configs_from_yaml_files(tmp_path, capsys):
    """A config file stands for its fields on every command line that takes configs (the shipped
    consumer config among them); a bad one is refused naming the file and the key."""
    from flashoverlap import precompile, registry, tune
    from flashoverlap.config import OverlapConfig

    shipped = registry.SHIPPED / "consumer_pcie.yaml"
    fields = bench.parse_config(str(shipped))
    assert fields["kernel"] == "sm80" and OverlapConfig(**fields) == OverlapConfig.from_yaml(shipped)
    good = tmp_path / "few.yaml"
    good.write_text("comm_sms: 4\npartition: [1, 2]\n")
    assert bench.parse_config(str(good)) == {"comm_sms": 4, "partition": [1, 2]}
    bad = tmp_path / "bad.yaml"
    bad.write_text("comm_sms: -1\n")
    with pytest.raises(argparse.ArgumentTypeError, match="bad.yaml.*comm_sms"):
        bench.parse_config(str(bad))
    with pytest.raises(argparse.ArgumentTypeError, match="not found"):
        bench.parse_config(str(tmp_path / "missing.yaml"))
    args = bench.build_parser().parse_args(["--configs", str(good), "registry"])
    assert args.configs == [{"comm_sms": 4, "partition": [1, 2]}, None]
    assert precompile.main(["--gpu-arch", "sm_89", str(shipped), "--list"]) == 0  # the family's kernel, listed
    assert "sm_89" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tune.main(["--shapes", "8x8x8", "--output", "x.yaml", "--candidates", str(bad)])
    assert "bad.yaml" in capsys.readouterr().err


def test_config_labels_name_what_ran():
    from flashoverlap.config import OverlapConfig, for_collective

    assert bench.config_label({"comm_sms": 8}, None, "all_reduce") == '{"comm_sms": 8}'
    picked = for_collective(OverlapConfig(comm_sms=8, partition=(2, 3)), "reduce_scatter")
    assert bench.config_label(None, picked, "reduce_scatter") == 'registry:{"comm_sms": 8, "partition": [2, 3]}'
    tiles = for_collective(OverlapConfig(layout="tiles"), "all_reduce")
    assert bench.config_label(None, tiles, "all_reduce") == 'registry:{"layout": "tiles"}'
    # a method per config, whatever the registry picked, and per NCCL path
    assert bench.variant('registry:{"comm_sms": 8}') == "registry"
    assert bench.variant('registry:{"comm_sms": 8} nccl=direct') == "registry nccl=direct"
    assert bench.variant('{"comm_sms": 8} nccl=direct') == '{"comm_sms": 8} nccl=direct'


def test_cli_defaults_and_choices(capsys, monkeypatch):
    monkeypatch.delenv("FLASHOVERLAP_NCCL", raising=False)
    args = bench.build_parser().parse_args(["--collective", "all_to_all", "--transport", "pcie"])
    assert args.collective == "all_to_all" and args.transport == "pcie" and args.configs == [{}]
    assert args.nccl is None  # the path a call would take (comm.uses_direct), once torchrun has started
    assert args.chunks == [2, 4, 8] and args.rounds == 15
    assert bench.build_parser().parse_args(["--nccl", "c10d", "direct"]).nccl == ["c10d", "direct"]
    assert not args.graphs and bench.build_parser().parse_args(["--graphs"]).graphs
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--nccl", "cupy"])
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--collective", "broadcast"])
    assert "invalid choice" in capsys.readouterr().err
    assert bench.TRANSPORTS["pcie"] == {"NCCL_P2P_DISABLE": "1"}
    assert bench.TRANSPORTS["net"] == {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


def test_rounds_rotate_operand_sets_and_graphs_need_a_warm_up():
    seen = []
    run = bench._eager(seen.append, 3)
    run(0), run(2)
    assert seen == [0, 1, 2, 6, 7, 8]  # round r: calls r * block .. r * block + block - 1
    with pytest.raises(ValueError, match="warm-up"):  # before any CUDA call: capture needs plans made
        bench.time_variants({"x": seen.append}, rounds=1, block=1, warmup=0, graphs=True)


@pytest.mark.parametrize("n", range(1, 10))
def test_balanced_orders_put_every_variant_after_every_other_equally_often(n):
    orders = bench.balanced_orders(n)
    assert len(orders) == (n if n % 2 == 0 or n == 1 else 2 * n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    assert collections.Counter(order[0] for order in orders) == dict.fromkeys(range(n), len(orders) // n)
    pairs = collections.Counter((x, y) for order in orders for x, y in zip(order, order[1:]))
    assert set(pairs) == {(x, y) for x in range(n) for y in range(n) if x != y}
    assert len(set(pairs.values())) <= 1  # each pair as often as any other


def test_main_without_torchrun_says_how_to_run(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("FLASHOVERLAP_TIMING", "eager")  # (restored after the test)
    assert bench.main(["--shapes", "128x128x128"]) == 2
    assert "torchrun" in capsys.readouterr().err and os.environ["FLASHOVERLAP_TIMING"] == "eager"
    assert bench.main(["--shapes", "128x128x128", "--graphs"]) == 2
    assert os.environ["FLASHOVERLAP_TIMING"] == "graphs"  # the registry's entries for graph replays


def test_shape_files(tmp_path):
    good = tmp_path / "suite.yaml"
    good.write_text("- 4096x8192x8192\n- [1024, 4096, 2048]\n")
    assert bench.load_shapes(str(good)) == [(4096, 8192, 8192), (1024, 4096, 2048)]
    for text, message in (("{a: 1}", "non-empty YAML list"), ("- 12x3\n", "MxNxK")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            bench.load_shapes(str(bad))


def test_statistics():
    assert bench.median_ms([3.0, 1.0, 2.0, 100.0]) == 2.5
    # seq 1.0 = gemm 0.7 + comm 0.3; an overlap at 0.8 hides 0.2 of the 0.3 that could be hidden
    assert bench.overlap_efficiency(1.0, 0.8, 0.7, 0.3) == pytest.approx(2 / 3)
    assert bench.overlap_efficiency(1.0, 0.7, 0.7, 0.3) == pytest.approx(1.0)
    # enough operand sets that consecutive iterations miss a 50 MB L2
    sets = bench.input_sets(1024, 1024, 1024, __import__("torch").bfloat16, 50 << 20)
    assert sets * 2 * 1024 * 1024 * 2 >= 3 * (50 << 20) and sets >= 2


def row(**overrides):
    base = dict(
        m=4096, n=8192, k=8192, world=2, collective="all_reduce", dtype="bfloat16", config="{}", waves=9, groups=6,
        t_gemm_ms=0.8, t_comm_ms=0.3, t_seq_ms=1.1, t_fo_ms=1.0, t_kernel_ms=0.9, t_decomp_ms=1.05,
        decomp_chunks=4, t_asynctp_ms=float("nan"), speedup=1.1, decomp_speedup=1.0476, asynctp_speedup=float("nan"),
        ideal_speedup=1.375, of_ideal=0.8, efficiency=1 / 3, kernel_vs_cublas=0.89, rel_err=0.0,
    )  # fmt: skip
    return {**base, **overrides}


def test_table_is_aligned_and_marks_missing_values():
    rows = [row(), row(m=16384, config='{"comm_sms": 8}', waves="", groups="")]
    lines = bench.format_table(rows).splitlines()
    assert len(lines) == 3 and len({len(line) for line in lines}) == 1
    header = lines[0].split()
    assert header[:8] == ["M", "N", "K", "gemm", "comm", "seq", "fo", "speedup"]
    assert "async-tp" in header and "of_ideal" in header
    cells = dict(zip(header, lines[1].split()))
    assert cells["async-tp"] == "-" and cells["decomp"] == "1.048" and cells["chunks"] == "4"


def test_csv_round_trip_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.csv"
    rows = [row(transport="nvlink"), row(collective="reduce_scatter", asynctp_speedup=1.02, transport="nvlink")]
    bench.write_csv(str(path), rows)
    with open(path, newline="") as handle:
        back = list(csv.DictReader(handle))
    assert [r["collective"] for r in back] == ["all_reduce", "reduce_scatter"]
    assert math.isclose(float(back[0]["speedup"]), 1.1) and back[0]["t_asynctp_ms"] == "nan"
    png = tmp_path / "p.png"
    assert bench.main(["--plot", str(png), "--from-csv", str(path)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_per_variant(tmp_path, capsys):
    rows = [
        row(),
        row(m=8192, speedup=0.9, efficiency=-0.1, of_ideal=0.6),  # slower than decomposition (1.0476)
        row(config='{"comm_sms": 8}', speedup=1.2, efficiency=0.5, of_ideal=0.9),
    ]
    lines = bench.summarize(rows).splitlines()
    assert lines[0].split()[:4] == ["variant", "shapes", "speedup", "worst"]
    assert lines[1].split() == ["{}", "2", "1.000", "0.900", "0.12", "0.70", "1/2"]
    assert lines[2].split()[-5:] == ["1.200", "1.200", "0.50", "0.90", "1/1"]
    # whatever the registry picked per shape is one method
    picks = [row(config='registry:{"sequential": true}', speedup=0.99), row(config="registry:{}", speedup=1.21)]
    assert bench.summarize(picks).splitlines()[1].split() == ["registry", "2", "1.100", "0.990", "0.33", "0.80", "1/2"]
    assert "of_ideal > 1" not in bench.summarize(rows)
    # beyond the bound (it times one whole collective): said, not hidden
    assert bench.summarize([row(of_ideal=1.03)]).splitlines()[-1].startswith("of_ideal > 1 (1 row)")
    # the same from saved CSVs, no GPUs
    path = tmp_path / "r.csv"
    bench.write_csv(str(path), rows)
    assert bench.main(["--from-csv", str(path)]) == 0
    assert "1/2" in capsys.readouterr().out


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_stream_ops_probe_builds_and_refuses_unknown_cases(tmp_path):
    """bench/stream_ops_probe.cu (the latencies behind comm.peer's flags) compiles for sm_90a, and
    a case it does not have is a usage error before it touches a GPU."""
    from pathlib import Path

    source = Path(__file__).resolve().parent.parent / "bench" / "stream_ops_probe.cu"
    binary = tmp_path / "probe"
    subprocess.run(["nvcc", "-O2", "-arch=sm_90a", "-o", str(binary), str(source)], check=True, capture_output=True)
    refused = subprocess.run([str(binary), "99"], capture_output=True, text=True)
    assert refused.returncode == 2 and "usage" in refused.stdout


def test_every_rank_writes_its_trace_beside_rank_0_s():
    assert bench.rank_trace_path("out/trace.json", 0) == "out/trace.json"
    assert bench.rank_trace_path("out/trace.json", 1) == "out/trace.rank1.json"
    assert bench.rank_trace_path("run.d/trace", 3) == "run.d/trace.rank3"  # a dot in a folder is not an extension
