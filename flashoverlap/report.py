"""The benchmark's results (python -m flashoverlap.bench) as tables, summaries, CSV files and plots.

Rows are what ``bench.bench_shape`` measures, or the same read back from CSV files (strings then)
by ``python -m flashoverlap.bench --from-csv a.csv b.csv [--plot out.png]``, which needs no GPU.
Rows of different runs (another file, GPU, world size, collective, transport, dtype, timing or
inputs mode) are never mixed: each run gets its own labelled table, summary and plot panel.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Sequence

COLUMNS = [
    ("m", "M", "d"),
    ("n", "N", "d"),
    ("k", "K", "d"),
    ("t_gemm_ms", "gemm", ".3f"),
    ("t_comm_ms", "comm", ".3f"),
    ("t_seq_ms", "seq", ".3f"),
    ("t_fo_ms", "fo", ".3f"),
    ("speedup", "speedup", ".3f"),
    ("fallback_speedup", "fallback", ".3f"),
    ("decomp_speedup", "decomp", ".3f"),
    ("decomp_chunks", "chunks", "d"),
    ("asynctp_speedup", "async-tp", ".3f"),
    ("ideal_speedup", "ideal", ".3f"),
    ("of_ideal", "of_ideal", ".2f"),
    ("efficiency", "eff", ".2f"),
    ("kernel_vs_cublas", "kern/cublas", ".3f"),
    ("rel_err", "rel_err", ".1e"),
    ("config", "config", "s"),
]
# what tells runs apart, in the order a run's label names them
RUN_KEYS = ("gpu", "world", "collective", "transport", "dtype", "timing", "inputs")
# what a benchmark CSV must hold to be summarised (older ones lack the later columns: shown as "-")
REQUIRED = ("m", "n", "k", "collective", "config", "speedup", "decomp_speedup", "ideal_speedup", "of_ideal")


def variant(label: str) -> str:
    """The method a row belongs to: its config, or ``registry`` whatever the registry picked (with
    the NCCL path, where not c10d)."""
    if not label.startswith("registry:"):
        return label
    return "registry" + (label[label.rindex(" nccl=") :] if " nccl=" in label else "")


def _num(row: dict, key: str) -> float:
    value = row.get(key)
    return float(value) if value not in (None, "") else float("nan")


def _cell(value, fmt: str) -> str:
    if isinstance(value, str) and value and fmt != "s":  # read back from a CSV
        value = int(value) if fmt == "d" else float(value)
    if value in (None, "") or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def format_table(rows: list[dict]) -> str:
    """Aligned table, a row per shape and variant: times in ms, speedups over sequential (``fallback``:
    a call forced onto the sequential path; paired round by round, bench.bench_shape), ``of_ideal`` =
    speedup / ideal."""
    cells = [[title for _, title, _ in COLUMNS]]
    for row in rows:
        cells.append([_cell(row.get(key), fmt) for key, _, fmt in COLUMNS])
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)


def summarize(rows: list[dict]) -> str:
    """Per flashoverlap variant (the registry's picks count as one) over the shapes of one run: mean
    speedup over sequential, mean overlap efficiency and share of the ideal, the worst speedup, and
    on how many shapes it was at least as fast as the chunked decomposition; the forced fallback's
    worst against sequential where measured; a note where a call beat the ideal bound."""
    variants: dict[str, list[dict]] = {}
    for row in rows:
        variants.setdefault(variant(row["config"]), []).append(row)
    lines = [f"{'variant':>28} {'shapes':>6} {'speedup':>8} {'worst':>6} {'eff':>5} {'of_ideal':>8}  >= decomp"]
    for config, group in variants.items():
        speedups = [_num(r, "speedup") for r in group]
        wins = sum(_num(r, "speedup") >= _num(r, "decomp_speedup") for r in group)
        lines.append(
            f"{config[:28]:>28} {len(group):>6} {statistics.mean(speedups):>8.3f} {min(speedups):>6.3f} "
            f"{statistics.mean(_num(r, 'efficiency') for r in group):>5.2f} "
            f"{statistics.mean(_num(r, 'of_ideal') for r in group):>8.2f}  {wins}/{len(group)}"
        )
    for key, what in (("fallback_speedup", "forced fallback (config sequential)"), ("noise_speedup", "seq itself")):
        per_shape = {(r["m"], r["n"], r["k"]): _num(r, key) for r in rows}
        per_shape = {shape: v for shape, v in per_shape.items() if not math.isnan(v)}
        if per_shape:  # (one per shape: every variant of a shape shares it)
            lines.append(
                f"{what} against seq: worst {min(per_shape.values()):.3f}, mean "
                f"{statistics.mean(per_shape.values()):.3f} over {len(per_shape)} shape{'s' * (len(per_shape) > 1)}"
            )
    beyond = sum(_num(r, "of_ideal") > 1 for r in rows)
    if beyond:  # the bound is timed with one whole collective on the default communicator
        lines.append(
            f"of_ideal > 1 ({beyond} row{'s' * (beyond > 1)}): faster than the collective alone as the bound times it "
            "(one call on the default communicator); the overlapped groups ran on two communicators at once"
        )
    return "\n".join(lines)


def runs(rows: list[dict], source: str = "") -> dict[str, list[dict]]:
    """``rows`` split into runs (:data:`RUN_KEYS`), each under a label naming it (``source``, e.g.
    the file, first), in the order they first appear."""
    split: dict[tuple, list[dict]] = {}
    for row in rows:
        split.setdefault(tuple(str(row.get(key, "")) for key in RUN_KEYS), []).append(row)
    labelled = {}
    for values, group in split.items():
        named = dict(zip(RUN_KEYS, values))
        parts = [
            named["gpu"] + (f" x{named['world']}" if named["world"] else ""),
            *(named[key] for key in ("collective", "transport", "dtype", "timing")),
            f"{named['inputs']} inputs" if named["inputs"] else "",
        ]
        label = ", ".join(p for p in parts if p)
        labelled[f"{source}: {label}" if source else label] = group
    return labelled


def show(labelled: dict[str, list[dict]]) -> str:
    """Each run's label, table and summary."""
    return "\n\n".join(f"== {label}\n{format_table(group)}\n{summarize(group)}" for label, group in labelled.items())


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def read_runs(paths: Sequence[str]) -> dict[str, list[dict]]:
    """The runs of benchmark CSV files (:func:`runs`, labelled by file); raises ``ValueError``
    naming the file where one is missing, empty or not a benchmark's."""
    labelled: dict[str, list[dict]] = {}
    for path in paths:
        try:
            with open(path, newline="") as handle:
                rows = list(csv.DictReader(handle))
        except OSError as exc:
            raise ValueError(f"{path}: cannot read it: {exc.strerror or exc}") from None
        if not rows:
            raise ValueError(f"{path}: no rows (expected a CSV of python -m flashoverlap.bench --csv)")
        missing = [key for key in REQUIRED if key not in rows[0]]
        if missing:
            tuner = "predicted_ms" in rows[0]
            raise ValueError(
                f"{path}: not a CSV of python -m flashoverlap.bench --csv (no column {', '.join(missing)})"
                + ("; it is the tuner's (python -m flashoverlap.tune --csv), which prints its own summary" * tuner)
            )
        labelled.update(runs(rows, path))
    return labelled


def plot(labelled: dict[str, list[dict]], path: str) -> None:
    """Bar charts of speedup over sequential per shape, a panel per run titled with its label:
    decomposition, async-TP (where measured), the forced fallback, each flashoverlap config, and
    the ideal bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for label, rows in labelled.items():
        cases: dict[str, dict[str, float]] = {}
        for row in rows:
            case = cases.setdefault(f"{row['m']}x{row['n']}x{row['k']}", {})
            case["decomposition"] = _num(row, "decomp_speedup")
            case["async-TP"] = _num(row, "asynctp_speedup")
            case["fallback"] = _num(row, "fallback_speedup")
            case[f"flashoverlap {variant(row['config'])}"] = _num(row, "speedup")
            case["ideal"] = _num(row, "ideal_speedup")
        measured = dict.fromkeys(m for case in cases.values() for m, v in case.items() if not math.isnan(v))
        panels.append((label, cases, [m for m in measured if m != "ideal"] + ["ideal"]))
    widest = max(len(cases) for _, cases, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(min(14.0, 3.0 + 1.1 * widest), 4.2 * len(panels)), squeeze=False)
    for ax, (label, cases, methods) in zip(axes[:, 0], panels):
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            values = [case.get(method, float("nan")) for case in cases.values()]
            xs = [x + (i - (len(methods) - 1) / 2) * width for x in range(len(cases))]
            ax.bar(xs, values, width, label=method, hatch="//" if method == "ideal" else None, alpha=0.9)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(cases)), list(cases), fontsize=7, rotation=30, ha="right")
        ax.set_ylabel("speedup over matmul then collective", fontsize=8)
        ax.set_title(label, fontsize=8)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def from_csv(paths: Sequence[str], plot_path: str | None = None) -> str:
    """What ``--from-csv`` prints (each run's table and summary), plotting them where asked;
    raises ``ValueError`` for a file it cannot take."""
    labelled = read_runs(paths)
    if plot_path:
        plot(labelled, plot_path)
    return show(labelled)
