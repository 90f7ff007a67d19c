"""End-to-end benchmark: prefill through transformers' own modeling code, tensor-parallel over the
ranks of torchrun, plain against :func:`flashoverlap.patch`.

    torchrun --nproc-per-node 4 -m flashoverlap.bench_model --csv e2e_tp4.csv
    torchrun --nproc-per-node 2 -m flashoverlap.bench_model --models llama3-70b --tokens 8192 --transport pcie

Each model is a decoder stack of the named shape (hidden size, heads, MLP width and vocabulary of
the real model, ``--layers`` layers, random weights from its config: no checkpoint), sharded by
transformers' own tensor parallelism (``tensor_parallel_from_config``: its ``tp_plan``, the world
size as TP). For each prefill length (batch 1, ``--tokens`` tokens) three variants of one forward
pass take turns: ``plain`` (transformers as it is: each row-parallel projection a local GEMM then
an NCCL all-reduce), ``flashoverlap`` (patched: ``o_proj`` and ``down_proj`` one overlapped call
each, configs from the registry) and ``bound`` (those all-reduces skipped: wrong results, the time
of the stack with all of its collectives hidden). Timed with CUDA events after warm-up, medians
over rounds in balanced orders, the slowest rank's (``flashoverlap.timing.time_variants``). Reported:
tokens/s of each, the speedup over plain, the bound's, and ``hidden``: the share of the
collectives' time (plain - bound) that the overlap removed.

The first flashoverlap call of each GEMM shape times its candidates (and, on a fresh machine,
compiles its kernels: ``python -m flashoverlap.precompile --registry`` beforehand keeps that out);
it happens during warm-up. To tune for them instead, the shapes the patched projections run
(``--shapes-for-tp``, no GPU needed) go to the tuner:

    python -m flashoverlap.bench_model --models llama3-70b --tokens 2048 8192 --shapes-for-tp 4 > shapes.yaml
    torchrun --nproc-per-node 4 -m flashoverlap.tune --shapes-file shapes.yaml --output my_configs/h200_x4.yaml
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

MODELS = {  # the real models' shapes (their config.json), a few layers of them
    "llama3-70b": dict(
        model_type="llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
    "qwen2.5-72b": dict(
        model_type="qwen2",
        hidden_size=8192,
        intermediate_size=29568,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=152064,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
}
VARIANTS = ("plain", "flashoverlap", "bound")


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from .bench import TRANSPORTS, parse_config

    parser = argparse.ArgumentParser(
        prog="python -m flashoverlap.bench_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--tokens", nargs="+", type=positive, default=[2048, 8192, 32768], help="prefill lengths")
    parser.add_argument("--layers", type=positive, default=4, help="decoder layers of each model")
    parser.add_argument("--transport", choices=sorted(TRANSPORTS), default="nvlink")
    # (three cycles of the three variants' six balanced orders: a short stack's forward pass takes a
    # few ms and its rounds spread a few percent, about its whole gain at 2048 tokens; more rounds
    # narrow a run's own median, not the few percent plain itself moves between processes)
    parser.add_argument(
        "--rounds", type=positive, default=18, help="timed rounds per variant (rounded up to whole balanced cycles)"
    )
    parser.add_argument("--warmup", type=positive, default=2)
    parser.add_argument(
        "--config",
        type=parse_config,
        help="the overlapped calls' config: JSON fields or a YAML path (default: the registry's for each shape)",
    )
    parser.add_argument("--csv", help="write one row per model and length here (rank 0)")
    parser.add_argument(
        "--shapes-for-tp",
        type=positive,
        metavar="TP",
        help="print the models' row-parallel GEMM shapes (MxNxK) at TP ranks for --tokens as a YAML list and "
        "exit, no GPU needed: the input of python -m flashoverlap.tune --shapes-file",
    )
    return parser


def row_parallel_shapes(name: str, tp: int, tokens: Sequence[int]) -> list[tuple[int, int, int]]:
    """The GEMMs the overlapped calls of model ``name`` run at ``tp`` ranks, per prefill length: the
    attention output (K: this rank's heads) and the MLP down projection (K: its share of the MLP),
    N the hidden size; a TP size the model does not split over is refused (:func:`model_config`'s rule)."""
    shape = MODELS[name]
    for what in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if shape[what] % tp:
            raise ValueError(f"{name}: {what}={shape[what]} does not split over {tp} ranks")
    hidden = shape["hidden_size"]
    head_dim = hidden // shape["num_attention_heads"]
    ks = (shape["num_attention_heads"] // tp * head_dim, shape["intermediate_size"] // tp)
    return [(m, hidden, k) for m in tokens for k in dict.fromkeys(ks)]


def model_config(name: str, layers: int, world: int):
    """The transformers config of model ``name`` cut to ``layers`` layers; refuses a TP size the
    shape does not divide (heads, KV heads, MLP width)."""
    from transformers import AutoConfig

    row_parallel_shapes(name, world, [])  # (refuses a TP size the model does not split over)
    shape = dict(MODELS[name])
    model_type = shape.pop("model_type")
    return AutoConfig.for_model(model_type, num_hidden_layers=layers, max_position_embeddings=131072, **shape)


class Variants:
    """One tensor-parallel model run as any of :data:`VARIANTS`, switched by setting the forwards
    of its row-parallel projections, each mode's made once: a timed call (the variants take turns
    call by call) does nothing beside its forward pass but a few attribute writes."""

    def __init__(self, model: torch.nn.Module, config: dict | None) -> None:
        from .integrations import hf

        self.model = model
        self.patched = hf.patch(model, config=config)  # (refuses a model it cannot patch before any timing)
        modules = [module for _, module, _ in hf.row_parallel_linears(model)[1]]
        self.forwards = {"flashoverlap": [(m, m.forward) for m in modules]}
        hf.without_collectives(model)
        self.forwards["bound"] = [(m, m.forward) for m in modules]
        hf.unpatch(model)
        self.forwards["plain"] = [(m, m.forward) for m in modules]
        self.mode = "plain"

    def __call__(self, mode: str, ids: torch.Tensor) -> torch.Tensor:
        if mode != self.mode:
            for module, forward in self.forwards[mode]:
                module.forward = forward
            self.mode = mode
        return self.model(input_ids=ids, use_cache=False).last_hidden_state


def bench_model(name: str, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """One row per prefill length of ``args.tokens`` for model ``name`` (every rank)."""
    from .integrations import hf
    from .timing import time_variants

    world = dist.get_world_size()
    run = Variants(hf.tensor_parallel_from_config(model_config(name, args.layers, world), device=device), args.config)
    rows = []
    for tokens in args.tokens:
        ids = torch.randint(0, run.model.config.vocab_size, (1, tokens), device=device, generator=_generator(device))
        with torch.no_grad():
            plain, overlapped = run("plain", ids), run("flashoverlap", ids)
            error = ((overlapped.float() - plain.float()).norm() / plain.float().norm()).item()
            del plain, overlapped
            variants = {mode: lambda i, mode=mode, ids=ids: run(mode, ids) for mode in VARIANTS}
            ms = time_variants(variants, args.rounds, 1, args.warmup)
        rows.append(_row(name, tokens, args, world, ms, error, len(run.patched)))
        if dist.get_rank() == 0:
            print(format_row(rows[-1]), flush=True)
    return rows


def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)  # the same tokens on every rank


def _row(name: str, tokens: int, args, world: int, ms: dict, error: float, patched: int) -> dict:
    from .timing import whole_cycles

    rounds = whole_cycles(args.rounds, len(VARIANTS))  # (what was timed: --rounds rounded up)
    row = dict(model=name, tp=world, tokens=tokens, layers=args.layers, rounds=rounds, transport=args.transport)
    row.update({f"{mode}_ms": round(ms[mode], 3) for mode in VARIANTS})
    row.update({f"{mode}_tok_s": round(tokens * 1000 / ms[mode]) for mode in VARIANTS})
    row["speedup"] = round(ms["plain"] / ms["flashoverlap"], 4)
    row["bound_speedup"] = round(ms["plain"] / ms["bound"], 4)
    collectives = ms["plain"] - ms["bound"]
    row["hidden"] = round((ms["plain"] - ms["flashoverlap"]) / collectives, 3) if collectives > 0 else float("nan")
    row["rel_err"] = f"{error:.2e}"  # flashoverlap's output against plain's (bf16)
    row["patched"] = patched
    return row


def format_row(row: dict) -> str:
    return (
        f"{row['model']:>12} TP{row['tp']} {row['tokens']:>6} tokens: plain {row['plain_tok_s']:>8} tok/s, "
        f"flashoverlap {row['flashoverlap_tok_s']:>8} ({row['speedup']:.3f}x), bound {row['bound_tok_s']:>8} "
        f"({row['bound_speedup']:.3f}x), hidden {row['hidden']:.0%}, rel err {row['rel_err']}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.shapes_for_tp is not None:
        try:
            shapes = [s for name in args.models for s in row_parallel_shapes(name, args.shapes_for_tp, args.tokens)]
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        print("\n".join(f"- {m}x{n}x{k}" for m, n, k in dict.fromkeys(shapes)))
        return 0
    if not torch.cuda.is_available():
        print("flashoverlap.bench_model needs CUDA GPUs (one per rank): none is visible here", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print("run under torchrun, e.g. torchrun --nproc-per-node 2 -m flashoverlap.bench_model", file=sys.stderr)
        return 2
    from .bench import TRANSPORTS
    from .report import write_csv

    os.environ.update(TRANSPORTS[args.transport])  # before NCCL creates its communicators
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        for name in args.models:  # refuse a TP size before building anything
            model_config(name, args.layers, dist.get_world_size())
        rows = []
        for name in args.models:
            rows += bench_model(name, args, device)
            torch.cuda.empty_cache()  # (the model is gone: its memory to the next)
        if dist.get_rank() == 0:
            gpu = torch.cuda.get_device_name()
            print(f"\n{gpu} x{dist.get_world_size()}, transport={args.transport}, bf16, batch 1 prefill")
            for row in rows:
                print(format_row(row))
            if args.csv:
                write_csv(args.csv, [dict(row, gpu=gpu) for row in rows])
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
