"""The benchmark's CPU side: CLI parsing, shape files, statistics, runs without GPUs."""

import argparse
import os
import shutil
import subprocess
from pathlib import Path

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
    from flashoverlap.config import OverlapConfig
    from flashoverlap.rules import for_collective

    assert bench.config_label({"comm_sms": 8}, None, "all_reduce") == '{"comm_sms": 8}'
    picked = for_collective(OverlapConfig(comm_sms=8, partition=(2, 3)), "reduce_scatter")
    assert bench.config_label(None, picked, "reduce_scatter") == 'registry:{"comm_sms": 8, "partition": [2, 3]}'
    tiles = for_collective(OverlapConfig(layout="tiles"), "all_reduce")
    assert bench.config_label(None, tiles, "all_reduce") == 'registry:{"layout": "tiles"}'


def test_cli_defaults_and_choices(capsys, monkeypatch):
    monkeypatch.delenv("FLASHOVERLAP_NCCL", raising=False)
    args = bench.build_parser().parse_args(["--collective", "all_to_all", "--transport", "pcie"])
    assert args.collective == "all_to_all" and args.transport == "pcie" and args.configs == [{}]
    assert args.nccl is None  # the path a call would take (comm.uses_direct), once torchrun has started
    assert args.chunks == [2, 4, 8] and args.rounds == 15
    assert bench.build_parser().parse_args(["--nccl", "c10d", "direct"]).nccl == ["c10d", "direct"]
    assert not args.graphs and bench.build_parser().parse_args(["--graphs"]).graphs
    # inputs rotated through sets larger than L2 unless asked: hot (the same every call) or both, each a run
    assert bench.INPUTS[args.inputs] == ("rotated",)
    assert bench.INPUTS[bench.build_parser().parse_args(["--inputs", "hot"]).inputs] == ("hot",)
    assert bench.INPUTS[bench.build_parser().parse_args(["--inputs", "both"]).inputs] == ("rotated", "hot")
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--inputs", "cold"])
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--nccl", "cupy"])
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--collective", "broadcast"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--fast-accum"])  # (16-bit operands: nothing to accumulate fast)
    assert "--fast-accum is for FP8 operands" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--rowwise"])
    assert "--rowwise is for FP8 operands" in capsys.readouterr().err
    assert args.block is None  # per shape, timing.round_calls within bench.BLOCK
    for flag in ("--block", "--rounds"):
        with pytest.raises(SystemExit):
            bench.main([flag, "0"])
        assert f"{flag} must be at least 1, got 0" in capsys.readouterr().err
    assert bench.TRANSPORTS["pcie"] == {"NCCL_P2P_DISABLE": "1"}
    assert bench.TRANSPORTS["net"] == {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


def test_main_without_torchrun_says_how_to_run(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("FLASHOVERLAP_TIMING", "eager")  # (restored after the test)
    assert bench.main(["--shapes", "128x128x128"]) == 2
    assert "torchrun" in capsys.readouterr().err and os.environ["FLASHOVERLAP_TIMING"] == "eager"
    assert bench.main(["--shapes", "128x128x128", "--graphs"]) == 2
    assert os.environ["FLASHOVERLAP_TIMING"] == "graphs"  # the registry's entries for graph replays


def test_under_torchrun_without_the_gpus_it_needs_says_so(capsys, monkeypatch):
    """Not a CUDA error's traceback: what is missing, before any process group starts."""
    import torch

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--shapes", "128x128x128"]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "2")  # a third process per node on two GPUs
    assert bench.main(["--shapes", "128x128x128"]) == 2
    assert "local rank 2, but 2 GPU(s) here" in capsys.readouterr().err


def test_shape_files(tmp_path):
    good = tmp_path / "suite.yaml"
    good.write_text("- 4096x8192x8192\n- [1024, 4096, 2048]\n")
    assert bench.load_shapes(str(good)) == [(4096, 8192, 8192), (1024, 4096, 2048)]
    for text, message in (("{a: 1}", "non-empty YAML list"), ("- 12x3\n", "MxNxK")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            bench.load_shapes(str(bad))


def test_the_shipped_shape_files_load_and_the_small_one_covers_decode_and_small_prefill():
    """bench/small.yaml: the sizes a call must never lose on (M 8-2048, every size at least twice,
    N 4k-8k, K 2k-14k), each M divisible by the world sizes reduce-scatter runs on (up to 8)."""
    root = Path(__file__).resolve().parent.parent / "bench"
    assert bench.load_shapes(str(root / "suite.yaml"))
    small = bench.load_shapes(str(root / "small.yaml"))
    assert len(small) >= 16 and len(set(small)) == len(small)
    assert sorted({m for m, _, _ in small}) == [8, 64, 256, 512, 1024, 2048]
    assert all(4096 <= n <= 8192 and 2048 <= k <= 14336 and m % 8 == 0 for m, n, k in small)


def test_overlap_efficiency():
    # seq 1.0 = gemm 0.7 + comm 0.3; an overlap at 0.8 hides 0.2 of the 0.3 that could be hidden
    assert bench.overlap_efficiency(1.0, 0.8, 0.7, 0.3) == pytest.approx(2 / 3)
    assert bench.overlap_efficiency(1.0, 0.7, 0.7, 0.3) == pytest.approx(1.0)


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


def test_the_front_probe_times_a_decided_call_s_front_without_a_gpu():
    """bench/front_probe.py times each step of a repeat call's Python front and the whole front on a
    one-process gloo group: a repeat call of a decided kind must take the kept runner (a call that
    decided again would refuse its CPU operands)."""
    import sys

    script = Path(__file__).resolve().parent.parent / "bench" / "front_probe.py"
    done = subprocess.run([sys.executable, str(script), "--calls", "200"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    steps = {}
    for line in done.stdout.splitlines():
        name, value, unit = line.rsplit(None, 2)
        assert unit == "us", line
        steps[name] = float(value)
    assert list(steps)[-2:] == ["front, registry", "front, a config"]
    assert all(us > 0 for us in steps.values())
    refused = subprocess.run([sys.executable, str(script), "--calls", "0"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--calls must be at least 1" in refused.stderr


def test_every_timed_round_is_written_with_its_variant_s_config(tmp_path):
    """--rounds-csv: a row per variant, rank and round, in the order timed, the flashoverlap variants
    labelled with their config (the medians' rows say which config a variant was)."""
    import csv

    from flashoverlap import report

    samples = {"seq": [[0.30, 0.31], [0.32, 0.33]], "fo0direct": [[0.20, 0.90], [0.21, 0.22]]}
    rows = bench.round_rows((4096, 8192, 2048), "rotated", samples, {"fo0direct": "registry:{} nccl=direct"})
    assert len(rows) == 8
    assert rows[5] == {
        "shape": "4096x8192x2048",
        "inputs": "rotated",
        "variant": "fo0direct",
        "config": "registry:{} nccl=direct",
        "rank": 0,
        "round": 1,
        "ms": 0.90,
    }
    assert {row["config"] for row in rows if row["variant"] == "seq"} == {""}
    path = tmp_path / "rounds.csv"
    report.write_csv(str(path), rows)  # (as main writes every shape's rounds)
    with open(path, newline="") as handle:
        read = list(csv.DictReader(handle))
    assert [r["variant"] for r in read] == ["seq"] * 4 + ["fo0direct"] * 4 and read[5]["ms"] == "0.9"
    assert bench.build_parser().parse_args(["--rounds-csv", "r.csv"]).rounds_csv == "r.csv"
