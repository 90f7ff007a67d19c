"""The benchmark's results: table, summary, runs kept apart, CSV files and plots (CPU)."""

import csv
import math

import pytest

from flashoverlap import bench, report


def row(**overrides):
    base = dict(
        m=4096, n=8192, k=8192, world=2, collective="all_reduce", dtype="bfloat16", inputs="rotated", config="{}",
        waves=9, groups=6, t_gemm_ms=0.8, t_comm_ms=0.3, t_seq_ms=1.1, t_fallback_ms=1.1, t_fo_ms=1.0,
        t_kernel_ms=0.9, t_decomp_ms=1.05, decomp_chunks=4, t_asynctp_ms=float("nan"), speedup=1.1,
        fallback_speedup=1.0, decomp_speedup=1.0476, asynctp_speedup=float("nan"), ideal_speedup=1.375, of_ideal=0.8,
        efficiency=1 / 3, kernel_vs_cublas=0.89, rel_err=0.0,
    )  # fmt: skip
    return {**base, **overrides}


def test_table_is_aligned_and_marks_missing_values():
    rows = [row(), row(m=16384, config='{"comm_sms": 8}', waves="", groups="")]
    lines = report.format_table(rows).splitlines()
    assert len(lines) == 3 and len({len(line) for line in lines}) == 1
    header = lines[0].split()
    assert header[:9] == ["M", "N", "K", "gemm", "comm", "seq", "fo", "speedup", "fallback"]
    assert "async-tp" in header and "of_ideal" in header
    cells = dict(zip(header, lines[1].split()))
    assert cells["async-tp"] == "-" and cells["decomp"] == "1.048" and cells["chunks"] == "4"
    # rows of an older CSV, as strings, without the later columns
    old = {k: str(v) for k, v in row().items() if not k.startswith(("t_fallback", "fallback"))}
    cells = dict(zip(header, report.format_table([old]).splitlines()[1].split()))
    assert cells["fallback"] == "-" and cells["async-tp"] == "-" and cells["speedup"] == "1.100"


def test_config_labels_are_one_method_whatever_the_registry_picked():
    assert report.variant('registry:{"comm_sms": 8}') == "registry"
    assert report.variant('registry:{"comm_sms": 8} nccl=direct') == "registry nccl=direct"
    assert report.variant('{"comm_sms": 8} nccl=direct') == '{"comm_sms": 8} nccl=direct'


def test_csv_round_trip_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.csv"
    rows = [row(transport="nvlink"), row(collective="reduce_scatter", asynctp_speedup=1.02, transport="nvlink")]
    report.write_csv(str(path), rows)
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
        row(m=8192, speedup=0.9, efficiency=-0.1, of_ideal=0.6, fallback_speedup=0.97),  # slower than decomposition
        row(config='{"comm_sms": 8}', speedup=1.2, efficiency=0.5, of_ideal=0.9),
    ]
    lines = report.summarize(rows).splitlines()
    assert lines[0].split()[:4] == ["variant", "shapes", "speedup", "worst"]
    assert lines[1].split() == ["{}", "2", "1.000", "0.900", "0.12", "0.70", "1/2"]
    assert lines[2].split()[-5:] == ["1.200", "1.200", "0.50", "0.90", "1/1"]
    # the forced fallback against seq, once per shape
    assert lines[3] == "forced fallback (config sequential) against seq: worst 0.970, mean 0.985 over 2 shapes"
    # and seq against itself (the noise floor), where the rows have it (not in older CSVs)
    assert not any(line.startswith("seq itself") for line in lines)
    noisy = [row(noise_speedup=0.96), row(m=8192, noise_speedup=1.01)]
    assert report.summarize(noisy).splitlines()[-1] == "seq itself against seq: worst 0.960, mean 0.985 over 2 shapes"
    # whatever the registry picked per shape is one method
    picks = [row(config='registry:{"sequential": true}', speedup=0.99), row(config="registry:{}", speedup=1.21)]
    assert report.summarize(picks).splitlines()[1].split() == [
        "registry", "2", "1.100", "0.990", "0.33", "0.80", "1/2"
    ]  # fmt: skip
    assert "of_ideal > 1" not in report.summarize(rows)
    # beyond the bound (it times one whole collective): said, not hidden
    assert report.summarize([row(of_ideal=1.03)]).splitlines()[-1].startswith("of_ideal > 1 (1 row)")
    # the same from saved CSVs, no GPUs
    path = tmp_path / "r.csv"
    report.write_csv(str(path), rows)
    assert bench.main(["--from-csv", str(path)]) == 0
    assert "1/2" in capsys.readouterr().out


def test_runs_of_several_csvs_are_kept_apart(tmp_path, capsys):
    """Two runs of the same shapes (say, before and after a change): a table and summary each,
    labelled with the file and what the run was; inputs modes of one file apart too."""
    before, after = tmp_path / "before.csv", tmp_path / "after.csv"
    report.write_csv(str(before), [row(gpu="NVIDIA H200", transport="nvlink", timing="eager", speedup=0.9)])
    both = [row(inputs=mode, gpu="NVIDIA H200", transport="nvlink", timing="eager") for mode in ("rotated", "hot")]
    report.write_csv(str(after), [dict(r, speedup=1.2) for r in both])
    labelled = report.read_runs([str(before), str(after)])
    assert list(labelled) == [
        f"{before}: NVIDIA H200 x2, all_reduce, nvlink, bfloat16, eager, rotated inputs",
        f"{after}: NVIDIA H200 x2, all_reduce, nvlink, bfloat16, eager, rotated inputs",
        f"{after}: NVIDIA H200 x2, all_reduce, nvlink, bfloat16, eager, hot inputs",
    ]
    assert [len(group) for group in labelled.values()] == [1, 1, 1]
    assert bench.main(["--from-csv", str(before), str(after)]) == 0
    out = capsys.readouterr().out
    sections = out.split("== ")[1:]
    assert len(sections) == 3
    assert "0.900" in sections[0] and "0.900" not in sections[1] and "1.200" in sections[2]
    assert all(s.splitlines()[1].split()[:3] == ["M", "N", "K"] for s in sections)  # the per-shape table


def test_a_plot_has_a_panel_per_run(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    titles = []
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: titles.extend(a.get_title() for a in fig.axes)
    )
    report.plot({"a.csv: x": [row()], "b.csv: x": [row(speedup=1.3)]}, str(tmp_path / "p.png"))
    assert titles == ["a.csv: x", "b.csv: x"]  # the same shape twice: both runs' bars, each in its panel


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "missing.csv: cannot read it"),
        ("", "no rows"),
        ("shape,predicted_ms,measured_ms,seq_ms\n4096x8192x8192,1.0,1.1,1.2\n", "the tuner's"),
        ("a,b\n1,2\n", "not a CSV of python -m flashoverlap.bench --csv \\(no column m, n, k"),
    ],
)
def test_what_is_not_a_benchmark_csv_is_named(tmp_path, capsys, content, message):
    path = tmp_path / "missing.csv"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        report.read_runs([str(path)])
    with pytest.raises(SystemExit):  # the command line: a usage error, no traceback
        bench.main(["--from-csv", str(path)])
    assert "missing.csv" in capsys.readouterr().err
