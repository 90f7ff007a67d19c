"""The benchmark's results: one tidy CSV per machine kind in bench/results/ (``h200x2.csv``: two
H200s, ...), one row per variant, shape and run, and the plots and tables drawn from them.

    python bench/results.py                      # redraw bench/results/plots/*.png from the CSVs
    python bench/results.py table [--shapes]     # the current runs as markdown (a row per setup, or per shape)
    python bench/results.py plain RUN [RUN ...]  # the plain path's cost in those runs (fallback, noise floor)
    python bench/results.py rounds ROUNDS.csv ... # each variant against seq, with the interval one run allows
    python bench/results.py models               # the end-to-end runs (e2e.csv) as markdown
    python bench/results.py append run.csv [--note TEXT] [--run NAME]
        # add a ``python -m flashoverlap.bench --csv run.csv`` output to its machine's CSV (a
        # ``python -m flashoverlap.bench_model --csv`` output to e2e.csv), with today's date and
        # this checkout's commit

Columns (:data:`FIELDS`): ``date`` and ``commit`` the run was recorded with; ``gpu`` (torch's
device name), ``world`` (ranks), ``transport`` (``nvlink``, ``pcie``: NCCL through host memory,
as with ``NCCL_P2P_DISABLE=1``), ``collective``, ``dtype``, ``shape`` (MxNxK); ``variant``, one of
:data:`VARIANTS`; ``ms`` per call; ``speedup`` over the same run's ``sequential`` (the bench's:
paired round by round from dcbd1a1 on, before the ratio of the medians); ``efficiency``
(``(sequential - sequential / speedup) / min(gemm, collective)``: the share of the hideable time
hidden); ``mode`` (``eager``, ``graphs``: each block of calls one CUDA-graph replay, ``tune`` /
``tune-graphs``: the tuner's finalists); ``inputs`` (``rotated``: operands rotated through sets larger
than L2, ``hot``: the same every call); ``config`` (flashoverlap's config as the bench labels it, ``registry:{...}``
for what a call without ``config=`` ran; ``chunks=N`` for the decomposition); ``run`` (rows of
one invocation share it); ``note`` (empty where the commit's code and configs ran with their
defaults, else what differed).

The *current* runs of a setup (machine, world, transport, collective, mode, operand dtype) are
those of the latest commit that measured the registry's picks (a call without ``config=``) on
rotated inputs with an empty note (an FP8 run with other than per-tensor scales and promoted sums says so in its note).

``e2e.csv`` holds the end-to-end runs (``python -m flashoverlap.bench_model``), one row per model,
tensor-parallel size, transport and prefill length (:data:`E2E_FIELDS`); its current runs are the
latest commit's with an empty note per machine, TP size and transport.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import re
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent / "results"

FIELDS = [
    "date",
    "commit",
    "gpu",
    "world",
    "transport",
    "collective",
    "dtype",
    "shape",
    "variant",
    "ms",
    "speedup",
    "efficiency",
    "mode",
    "inputs",
    "config",
    "run",
    "note",
]

VARIANTS = {
    "gemm": "torch.matmul alone (cuBLAS)",
    "collective": "the torch collective alone, on the whole output",
    "sequential": "torch.matmul, then the torch collective",
    "decomposition": "the GEMM in column chunks, each chunk's collective on a second stream (best chunk count)",
    "async-tp": "torch's fused_(scaled_)matmul_reduce_scatter (symmetric memory; reduce-scatter over NVLink)",
    "flashoverlap": "the flashoverlap call",
    "fallback": "the flashoverlap call forced onto the plain path (config sequential)",
    "sequential-again": "sequential timed again as a variant of its own: the run's noise floor",
    "signal-gemm": "flashoverlap's GEMM alone, with the config's SM budget",
    "model": "the tuner's predicted time of a finalist",
    "brute-force": "the best partition the tuner's brute force measured",
}

E2E = "e2e.csv"
E2E_FIELDS = [
    "date",
    "commit",
    "gpu",
    "tp",
    "transport",
    "model",
    "tokens",
    "layers",
    "rounds",
    "plain_tok_s",
    "flashoverlap_tok_s",
    "bound_tok_s",
    "speedup",
    "bound_speedup",
    "hidden",
    "rel_err",
    "patched",
    "run",
    "note",
]

E2E_MEDIANS = ("plain_tok_s", "speedup", "bound_speedup", "hidden")  # what current_e2e takes medians of

TRANSPORT_NAMES = {"nvlink": "NVLink", "pcie": "P2P off", "net": "sockets"}
COLORS = {"decomposition": "tab:blue", "async-tp": "tab:purple", "flashoverlap": "tab:orange", "ideal": "tab:green"}


def machine(gpu: str, world: int | str) -> str:
    """The results file's name for ``world`` GPUs named ``gpu``: ``NVIDIA H100 80GB HBM3``, 2 ->
    ``h100x2``; ``NVIDIA GeForce RTX 4090``, 4 -> ``rtx4090x4``."""
    words = [w for w in re.split(r"[\s_-]+", gpu.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    name = ""
    for word in words:
        name += re.sub(r"[^a-z0-9]", "", word)
        if re.search(r"\d", word):
            break
    return f"{name or 'gpu'}x{int(world)}"


def _num(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _fmt(value: float, digits: int) -> str:
    return "" if math.isnan(value) else f"{value:.{digits}f}"


def tidy(bench_rows: Iterable[dict], date: str, commit: str, run: str, note: str = "") -> list[dict]:
    """Rows of ``python -m flashoverlap.bench --csv`` (one per shape and flashoverlap config, the
    baselines repeated on each) as tidy rows: the baselines once per shape, then each config's
    call and its GEMM alone (once per config)."""
    out: list[dict] = []
    seen: set[tuple] = set()
    for row in bench_rows:
        shape = f"{row['m']}x{row['n']}x{row['k']}"
        seq, gemm, coll = _num(row.get("t_seq_ms")), _num(row.get("t_gemm_ms")), _num(row.get("t_comm_ms"))
        base = {
            "date": date,
            "commit": commit,
            "gpu": row.get("gpu") or "",
            "world": int(row["world"]),
            "transport": row.get("transport") or "nvlink",
            "collective": row.get("collective") or "all_reduce",
            "dtype": row.get("dtype") or "bfloat16",
            "shape": shape,
            "mode": row.get("timing") or "eager",
            "inputs": row.get("inputs") or "rotated",  # (bench CSVs before --inputs: rotated)
            "run": run,
            "note": note,
        }
        config = row.get("config", "")
        decomp = _num(row.get("t_decomp_ms"))
        chunks = row.get("decomp_chunks") or ""
        # variant, config, ms, and the bench's column of its speedup over sequential: None where a
        # variant has none (the GEMM or collective alone), "" for sequential itself (1.0)
        entries = [
            ("gemm", "", gemm, None),
            ("collective", "", coll, None),
            ("sequential", "", seq, ""),
            ("decomposition", f"chunks={chunks}" if chunks else "", decomp, "decomp_speedup"),
            ("async-tp", "", _num(row.get("t_asynctp_ms")), "asynctp_speedup"),
            ("flashoverlap", config, _num(row.get("t_fo_ms")), "speedup"),
            ("fallback", "", _num(row.get("t_fallback_ms")), "fallback_speedup"),
            ("sequential-again", "", _num(row.get("t_seq_again_ms")), "noise_speedup"),
            ("signal-gemm", re.sub(r" nccl=\w+", "", config), _num(row.get("t_kernel_ms")), None),  # any NCCL path
        ]
        for variant, label, ms, column in entries:
            key = (shape, base["inputs"], variant, label if variant in ("flashoverlap", "signal-gemm") else "")
            if math.isnan(ms) or (key in seen and variant != "flashoverlap"):
                continue
            seen.add(key)
            # the bench's own speedup (paired round by round where it was), else the medians' ratio
            speedup = math.nan if column is None else _num(row.get(column)) if column else 1.0
            speedup = seq / ms if column and math.isnan(speedup) else speedup
            out.append(
                dict(
                    base,
                    variant=variant,
                    config=label,
                    ms=_fmt(ms, 4),
                    speedup=_fmt(speedup, 4),
                    efficiency=_fmt((seq - seq / speedup) / min(gemm, coll), 3),
                )
            )
    return out


def read(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def add(rows: Sequence[dict], results: Path = HERE) -> list[Path]:
    """Append tidy ``rows`` to their machines' CSVs in ``results`` (made with a header where new)."""
    by_file: dict[Path, list[dict]] = {}
    for row in rows:
        by_file.setdefault(results / f"{machine(row['gpu'], row['world'])}.csv", []).append(row)
    for path, group in by_file.items():
        _append(path, group, FIELDS)
    return sorted(by_file)


def _append(path: Path, rows: Sequence[dict], fields: Sequence[str]) -> None:
    """Append ``rows`` to the CSV at ``path``, with a header of ``fields`` where it is new."""
    new = not path.exists()
    with open(path, "a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        if new:
            writer.writeheader()
        writer.writerows(rows)


def machine_csvs(results: Path = HERE) -> list[Path]:
    """The machines' CSVs in ``results`` (``h200x2.csv``, ...; not :data:`E2E`)."""
    return sorted(p for p in results.glob("*.csv") if re.fullmatch(r"[a-z0-9]+x\d+", p.stem))


def load(results: Path = HERE) -> list[dict]:
    """Every row of every machine's CSV in ``results``, in file order (oldest first)."""
    rows = []
    for path in machine_csvs(results):
        rows += read(path)
    return rows


def is_e2e(rows: Sequence[dict]) -> bool:
    """Whether ``rows`` are ``python -m flashoverlap.bench_model --csv`` output."""
    return bool(rows) and {"model", "tokens", "plain_tok_s"} <= rows[0].keys()


def tidy_e2e(model_rows: Iterable[dict], date: str, commit: str, run: str, note: str = "") -> list[dict]:
    """Rows of ``python -m flashoverlap.bench_model --csv`` as :data:`E2E_FIELDS` rows."""
    return [
        {
            "date": date,
            "commit": commit,
            **{key: row.get(key, "") for key in E2E_FIELDS[2:-2]},  # (no rounds before bench_model wrote them)
            "run": run,
            "note": note,
        }
        for row in model_rows
    ]


def add_e2e(rows: Sequence[dict], results: Path = HERE) -> Path:
    """Append :func:`tidy_e2e` ``rows`` to :data:`E2E` in ``results`` (made with a header where new)."""
    path = results / E2E
    _append(path, rows, E2E_FIELDS)
    return path


def _e2e_setup(row: dict) -> tuple:
    return (row["gpu"], int(row["tp"]), row["transport"])


def current_e2e(rows: Sequence[dict]) -> list[dict]:
    """The current end-to-end numbers: per machine (gpu), TP size and transport, the runs of the
    latest commit (in file order) with an empty note; a row per model and prefill length holding
    the median over those runs of each rate and ratio, and ``runs``, how many there were. Sorted
    by setup, model and tokens."""
    latest: dict[tuple, str] = {}
    for row in rows:
        if not row["note"]:
            latest[_e2e_setup(row)] = row["commit"]
    cases: dict[tuple, list[dict]] = {}
    for row in rows:
        if not row["note"] and latest.get(_e2e_setup(row)) == row["commit"]:
            cases.setdefault((*_e2e_setup(row), row["model"], int(row["tokens"])), []).append(row)
    now = [
        {
            "date": max(r["date"] for r in group),
            "commit": group[0]["commit"],
            "gpu": gpu,
            "tp": tp,
            "transport": transport,
            "model": model,
            "tokens": tokens,
            **{key: statistics.median(float(r[key]) for r in group) for key in E2E_MEDIANS},
            "runs": len(group),
        }
        for (gpu, tp, transport, model, tokens), group in cases.items()
    ]
    return sorted(now, key=lambda r: (r["tp"], r["gpu"], r["transport"] != "nvlink", r["model"], r["tokens"]))


def e2e_table(rows: Sequence[dict]) -> str:
    """The current end-to-end numbers (:func:`current_e2e`) as markdown."""
    lines = [
        "| model | GPUs | transport | tokens | plain tok/s | flashoverlap | bound | hidden | runs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in current_e2e(rows):
        lines.append(
            f"| {r['model']} | {r['tp']}x {_short_gpu(r['gpu'])} "
            f"| {TRANSPORT_NAMES.get(r['transport'], r['transport'])} | {r['tokens']} | {r['plain_tok_s']:,.0f} "
            f"| {r['speedup']:.3f}x | {r['bound_speedup']:.3f}x | {r['hidden']:.0%} "
            f"| {r['runs']}: {r['date']} {r['commit']} |"
        )
    return "\n".join(lines)


def setup(row: dict) -> tuple:
    """What a current run stands for: machine, transport, collective, mode and operand dtype (an FP8
    run is no newer run of the bf16 setup)."""
    return (machine(row["gpu"], row["world"]), row["transport"], row["collective"], row["mode"], row["dtype"])


def _what(key: tuple) -> str:
    """A setup's collective, and its operands' dtype where they are not bf16."""
    collective, dtype = key[2].replace("_", "-"), key[4]
    return collective if dtype == "bfloat16" else f"{collective} ({dtype.replace('float8_', 'FP8 ')})"


def current(rows: Sequence[dict]) -> dict[tuple, list[dict]]:
    """Per setup (:func:`setup`), the rows of its current runs: the runs of the latest commit (in
    file order) that measured the registry's picks on rotated inputs with an empty note."""
    rows = [row for row in rows if row.get("inputs", "rotated") == "rotated"]
    latest: dict[tuple, str] = {}
    for row in rows:
        if row["variant"] == "flashoverlap" and row["config"].startswith("registry") and not row["note"]:
            latest[setup(row)] = row["commit"]
    runs: dict[tuple, set] = {}
    for row in rows:
        key = setup(row)
        if latest.get(key) == row["commit"] and row["variant"] == "flashoverlap" and not row["note"]:
            if row["config"].startswith("registry"):
                runs.setdefault(key, set()).add(row["run"])
    return {
        key: [r for r in rows if setup(r) == key and r["commit"] == latest[key] and r["run"] in runs[key]]
        for key in latest
    }


def per_shape(rows: Sequence[dict]) -> dict[str, dict[str, float]]:
    """Per shape of one setup's current rows, the median over its runs of the speedup over
    sequential of the registry's pick (``flashoverlap``), the decomposition, async-TP and the ideal
    bound ``sequential / max(gemm, collective)``, and of the registry's overlap efficiency."""
    samples: dict[str, dict[str, list[float]]] = {}
    times: dict[tuple, dict[str, float]] = {}
    for row in rows:
        times.setdefault((row["shape"], row["run"]), {})[row["variant"]] = _num(row["ms"])
        case = samples.setdefault(row["shape"], {})
        if row["variant"] == "flashoverlap" and row["config"].startswith("registry"):
            case.setdefault("flashoverlap", []).append(_num(row["speedup"]))
            case.setdefault("efficiency", []).append(_num(row["efficiency"]))
        elif row["variant"] in ("decomposition", "async-tp"):
            case.setdefault(row["variant"], []).append(_num(row["speedup"]))
    for (shape, _), t in times.items():
        if {"sequential", "gemm", "collective"} <= t.keys():
            samples[shape].setdefault("ideal", []).append(t["sequential"] / max(t["gemm"], t["collective"]))
    return {
        shape: {name: statistics.median(values) for name, values in case.items()}
        for shape, case in sorted(samples.items(), key=lambda item: _volume(item[0]))
    }


def _volume(shape: str) -> tuple:
    m, n, k = (int(v) for v in shape.split("x"))
    return (m * n * k, m, n, k)


def describe(key: tuple, rows: Sequence[dict]) -> str:
    _, transport, _, mode, _ = key
    runs = len({r["run"] for r in rows})
    return (
        f"{rows[0]['world']}x {_short_gpu(rows[0]['gpu'])}, {_what(key)}, "
        f"{TRANSPORT_NAMES.get(transport, transport)}, {mode}: {rows[0]['date']} {rows[0]['commit']}, "
        f"median of {runs} run{'s' * (runs > 1)}"
    )


def _short_gpu(gpu: str) -> str:
    return machine(gpu, 1)[:-2].upper()


def _mean(values: Iterable[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.mean(values) if values else math.nan


def table(rows: Sequence[dict], shapes: bool = False) -> str:
    """The current runs as markdown: a row per setup (means over its shapes of the medians over its
    runs), or with ``shapes`` a table per setup with a row per shape."""

    def cell(value: float, digits: int = 3) -> str:
        return "-" if math.isnan(value) else f"{value:.{digits}f}"

    lines = []
    groups = sorted(current(rows).items())
    if not shapes:
        lines += [
            "| GPUs | transport | collective | mode | flashoverlap (worst) | efficiency | decomposition | async-TP "
            "| ideal | >= decomposition | run |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
    for key, group in groups:
        cases = per_shape(group)
        fo = [c.get("flashoverlap", math.nan) for c in cases.values()]
        if shapes:
            lines += [
                "",
                describe(key, group),
                "",
                "| shape | flashoverlap | efficiency | decomposition | async-TP | ideal |",
                "| --- | --- | --- | --- | --- | --- |",
            ]
            for shape, c in cases.items():
                lines.append(
                    f"| {shape} | {cell(c.get('flashoverlap', math.nan))} | {cell(c.get('efficiency', math.nan), 2)} "
                    f"| {cell(c.get('decomposition', math.nan))} | {cell(c.get('async-tp', math.nan))} "
                    f"| {cell(c.get('ideal', math.nan))} |"
                )
            continue
        wins = sum(c.get("flashoverlap", math.nan) >= c.get("decomposition", math.inf) for c in cases.values())
        lines.append(
            f"| {group[0]['world']}x {_short_gpu(group[0]['gpu'])} | {TRANSPORT_NAMES.get(key[1], key[1])} "
            f"| {_what(key)} | {key[3]} | {cell(_mean(fo))} ({cell(min(fo))}) "
            f"| {cell(_mean(c.get('efficiency', math.nan) for c in cases.values()), 2)} "
            f"| {cell(_mean(c.get('decomposition', math.nan) for c in cases.values()))} "
            f"| {cell(_mean(c.get('async-tp', math.nan) for c in cases.values()))} "
            f"| {cell(_mean(c.get('ideal', math.nan) for c in cases.values()))} | {wins}/{len(cases)} "
            f"| {group[0]['date']} {group[0]['commit']} |"
        )
    return "\n".join(lines).strip()


PLAIN = ("fallback", "sequential-again")  # the plain path's table: its columns beside the registry's call


def plain(rows: Sequence[dict], runs: Sequence[str]) -> str:
    """The plain path's cost in ``runs`` as markdown: per run, mode and inputs, the mean (worst) over
    the shapes of the speedup over ``sequential`` of the registry's call, the forced fallback and
    ``sequential`` timed again (the run's noise floor), and on how many shapes the registry's call
    overlapped (the worst of those calls). A run name shared by several invocations (or their
    NCCL paths) pools their rows."""
    lines = [
        "| run | GPUs | collective | mode | inputs | registry | fallback | seq again | overlapped: worst |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        mine = [r for r in rows if r["run"] == run]
        if not mine:
            raise ValueError(f"no rows of run {run!r}")
        cases: dict[tuple, list[dict]] = {}
        for r in mine:
            cases.setdefault((machine(r["gpu"], r["world"]), r["collective"], r["mode"], r["inputs"]), []).append(r)
        for case, these in sorted(cases.items(), key=lambda item: (item[0][:3], item[0][3] != "rotated")):
            what = f"{these[0]['world']}x {_short_gpu(these[0]['gpu'])} | {case[1].replace('_', '-')}"
            mode, inputs = case[2:]
            registry = [r for r in these if r["variant"] == "flashoverlap" and r["config"].startswith("registry")]
            cells = []
            for picked in (registry, *([r for r in these if r["variant"] == v] for v in PLAIN)):
                values = [_num(r["speedup"]) for r in picked]
                cells.append(f"{_mean(values):.3f} ({min(values):.3f})" if values else "-")
            overlapped = [r for r in registry if '"sequential": true' not in r["config"]]
            worst = f"{min(_num(r['speedup']) for r in overlapped):.3f}" if overlapped else "-"
            count = f"{len({r['shape'] for r in overlapped})} of {len({r['shape'] for r in these})}"
            lines.append(f"| {run} | {what} | {mode} | {inputs} | {' | '.join(cells)} | {count}: {worst} |")
    return "\n".join(lines)


def _bars(ax, cases: dict[str, dict[str, float]], title: str) -> None:
    methods = [m for m in COLORS if any(not math.isnan(c.get(m, math.nan)) for c in cases.values())]
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        xs = [x + (i - (len(methods) - 1) / 2) * width for x in range(len(cases))]
        values = [c.get(method, math.nan) for c in cases.values()]
        label = "flashoverlap (registry)" if method == "flashoverlap" else method
        hatch = "//" if method == "ideal" else None
        ax.bar(xs, values, width, label=label, color=COLORS[method], hatch=hatch, alpha=0.9)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cases)), list(cases), fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("speedup over sequential")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=6, loc="lower right")


def plot(rows: Sequence[dict], out: Path) -> list[Path]:
    """A bar chart per setup of its current runs (``<machine>_<transport>_<collective>_<mode>.png``,
    ``_<dtype>`` added for other operands than bf16) and ``summary.png``: the eager bf16 all-reduce
    setups side by side. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    groups = sorted(current(rows).items())
    for key, group in groups:
        fig, ax = plt.subplots(figsize=(min(12.0, 3.0 + 1.0 * len({r["shape"] for r in group})), 4.2))
        _bars(ax, per_shape(group), describe(key, group))
        fig.tight_layout()
        path = out / ("_".join(key[:4]) + ("" if key[4] == "bfloat16" else f"_{key[4]}") + ".png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    summary = [(key, group) for key, group in groups if key[2:] == ("all_reduce", "eager", "bfloat16")]
    if summary:
        panels = [(describe(key, group), per_shape(group)) for key, group in summary]
        written.append(_grid(panels, out / "summary.png"))
    return written


def _grid(
    panels: Sequence[tuple[str, dict[str, dict[str, float]]]],
    path: Path,
    ylabel: str | None = None,
    labels: Sequence[str] | None = None,
) -> Path:
    """Two columns of :func:`_bars` panels, one per (title, cases) of ``panels``, saved at ``path``
    (matplotlib's backend chosen by the caller); ``ylabel`` and the legend's ``labels``, where given,
    in place of _bars' own."""
    import matplotlib.pyplot as plt

    rows_n = -(-len(panels) // 2)
    fig, axes = plt.subplots(rows_n, 2, figsize=(12, 3.6 * rows_n), squeeze=False)
    for ax, (title, cases) in zip(axes.flat, panels):
        _bars(ax, cases, title)
        if ylabel is not None:
            ax.set_ylabel(ylabel)
        if labels is not None:
            handles, _ = ax.get_legend_handles_labels()
            ax.legend(handles, labels, fontsize=6, loc="lower right")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_e2e(rows: Sequence[dict], out: Path) -> Path | None:
    """``e2e.png``: a panel per machine, TP size and transport of the current end-to-end rows, the
    patched stack's speedup over plain beside the bound's (every collective hidden), per model and
    prefill length; None where there are none."""
    now = current_e2e(rows)
    if not now:
        return None
    import matplotlib

    matplotlib.use("Agg")
    setups: dict[tuple, list[dict]] = {}
    for r in now:
        setups.setdefault((r["tp"], _short_gpu(r["gpu"]), r["transport"]), []).append(r)
    panels = [
        (
            f"{tp}x {gpu}, {TRANSPORT_NAMES.get(transport, transport)}: {group[0]['date']} {group[0]['commit']}",
            {
                f"{r['model']} {r['tokens'] // 1024}k": {"flashoverlap": r["speedup"], "ideal": r["bound_speedup"]}
                for r in group
            },
        )
        for (tp, gpu, transport), group in setups.items()
    ]
    out.mkdir(parents=True, exist_ok=True)
    labels = ["flashoverlap (patched)", "bound (collectives hidden)"]
    return _grid(panels, out / "e2e.png", ylabel="tokens/s over plain TP", labels=labels)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return out.stdout.strip()


PARTS = ("gemm", "comm", "kernel")  # rounds of a call's parts (kernel0, ...): nothing to compare with seq


def _kind(variant: str, config: str) -> str:
    """A rounds CSV's variant as :func:`rounds` groups it: each registry variant (``fo0direct``,
    ``fo0c10d``: one per NCCL path) with its calls decided plain apart from the overlapped ones."""
    if config.startswith("registry"):
        decided = "plain" if '"sequential": true' in config else "overlapped"
        return f"{variant}: registry, {decided}"
    return variant if not config else f"{variant} {config}"


def _by_volume(shape: str) -> tuple[int, ...]:
    return tuple(int(x) for x in shape.split("x"))


def rounds(path: Path, floor: float = 0.98, within: float = 0.01) -> str:
    """Every variant of a bench's ``--rounds-csv`` output (one run) against ``seq``, per input mode,
    as markdown: over the shapes, the mean and the worst paired speedup (flashoverlap.timing.
    paired_speedup, the bench's own) with the bootstrap interval at 95 % that one run gives that
    worst (timing.paired_interval, whose caveats hold), and the shapes whose whole interval lies
    below ``floor`` or outside ``within`` of ``seq``. Shapes without ``seq`` rounds are left out;
    those whose rounds hold a NaN (a variant a graph could not capture) are counted apart."""
    from flashoverlap.timing import paired_interval, paired_speedup  # (torch: the other commands need none)

    times: dict[tuple, dict[int, dict[int, float]]] = {}
    for r in read(path):
        key = (r["inputs"], _kind(r["variant"], r["config"]), r["shape"])
        per_round = times.setdefault(key, {}).setdefault(int(r["rank"]), {})
        if int(r["round"]) in per_round:
            raise ValueError(f"{path}: round {r['round']} of {key} on rank {r['rank']} twice")
        per_round[int(r["round"])] = _num(r["ms"])

    def ranks(key: tuple) -> list[list[float]]:
        return [[per[i] for i in sorted(per)] for _, per in sorted(times[key].items())]

    cases: dict[tuple, list[tuple[str, float, tuple[float, float]]]] = {}
    for inputs, kind, shape in sorted(times):
        if kind == "seq" or kind.startswith(PARTS) or (inputs, "seq", shape) not in times:
            continue
        base, other = ranks((inputs, "seq", shape)), ranks((inputs, kind, shape))
        cases.setdefault((inputs, kind), []).append((shape, paired_speedup(base, other), paired_interval(base, other)))
    lines = [
        f"| inputs | variant | shapes | mean | worst (95 % interval) | wholly below {floor:g} | "
        f"wholly outside {1 - within:g}-{1 + within:g} |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (inputs, kind), every in sorted(cases.items(), key=lambda item: (item[0][0] != "rotated", item[0])):
        shapes = sorted((c for c in every if not math.isnan(c[2][0])), key=lambda c: _by_volume(c[0]))
        untimed = f" ({len(every) - len(shapes)} with NaN rounds)" if len(shapes) < len(every) else ""
        if not shapes:
            lines.append(f"| {inputs} | {kind} | 0{untimed} | - | - | - | - |")
            continue
        shape, worst, (low, high) = min(shapes, key=lambda case: case[1])
        below = [s for s, _, (_, hi) in shapes if hi < floor]
        outside = [s for s, _, (lo, hi) in shapes if hi < 1 - within or lo > 1 + within]
        mean = statistics.fmean(speedup for _, speedup, _ in shapes)
        lines.append(
            f"| {inputs} | {kind} | {len(shapes)}{untimed} | {mean:.3f} | {worst:.3f} ({low:.3f}-{high:.3f}, "
            f"{shape}) | {_some(below)} | {_some(outside)} |"
        )
    return "\n".join(lines)


def _some(shapes: Sequence[str], shown: int = 4) -> str:
    """How many ``shapes``, and the first ``shown`` of them."""
    more = f", {len(shapes) - shown} more" if len(shapes) > shown else ""
    return f"{len(shapes)}: {', '.join(shapes[:shown])}{more}" if shapes else "0"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/results.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=HERE, help="the folder of the machines' CSVs and e2e.csv")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("plot", help="redraw the plots (the default)")
    show = sub.add_parser("table", help="print the current runs as markdown")
    show.add_argument("--shapes", action="store_true", help="a table per setup with a row per shape")
    cost = sub.add_parser("plain", help="print the plain path's cost in the named runs as markdown")
    cost.add_argument("runs", nargs="+", help="the runs' names (the CSVs' run column)")
    noise = sub.add_parser("rounds", help="every variant against seq with the interval one run puts it in")
    noise.add_argument("csv", nargs="+", type=Path, help="outputs of python -m flashoverlap.bench --rounds-csv")
    noise.add_argument("--floor", type=float, default=0.98, help="speedups below this count as losses")
    noise.add_argument("--within", type=float, default=0.01, help="how close to seq counts as the same")
    sub.add_parser("models", help="print the current end-to-end runs (e2e.csv) as markdown")
    more = sub.add_parser("append", help="append bench CSVs to their machines' CSVs (bench_model's to e2e.csv)")
    more.add_argument(
        "csv", nargs="+", type=Path, help="outputs of python -m flashoverlap.bench (or bench_model) --csv"
    )
    more.add_argument("--date", default=datetime.date.today().isoformat())
    more.add_argument("--commit", default=None, help="default: this checkout's HEAD")
    more.add_argument("--run", help="default: the file's name without its extension")
    more.add_argument("--note", default="", help="what differed from the commit's code, configs or defaults")
    args = parser.parse_args(argv)
    if args.command == "append":
        commit = args.commit or git_commit()
        for path in args.csv:
            found, run = read(path), args.run or path.stem
            if is_e2e(found):
                print(f"{path} -> {add_e2e(tidy_e2e(found, args.date, commit, run, args.note), args.results)}")
                continue
            for written in add(tidy(found, args.date, commit, run, args.note), args.results):
                print(f"{path} -> {written}")
        return 0
    if args.command == "rounds":
        for path in args.csv:  # (a table per run: the rounds CSV names neither its run nor its collective)
            print(f"{path}:\n\n{rounds(path, args.floor, args.within)}\n")
        return 0
    models = read(args.results / E2E) if (args.results / E2E).exists() else []
    if args.command == "models":
        if not models:
            parser.error(f"no end-to-end runs: {args.results / E2E} is missing or empty")
        print(e2e_table(models))
        return 0
    rows = load(args.results)
    if args.command == "table":
        print(table(rows, args.shapes))
        return 0
    if args.command == "plain":
        try:
            print(plain(rows, args.runs))
        except ValueError as exc:  # (a run with no rows)
            parser.error(str(exc))
        return 0
    for path in plot(rows, args.results / "plots"):
        print(path)
    drawn = plot_e2e(models, args.results / "plots")
    if drawn is not None:
        print(drawn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
