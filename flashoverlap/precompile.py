"""Build the GEMM kernels a deployment will use ahead of time (no GPU needed, only nvcc).

    python -m flashoverlap.precompile --gpu-arch sm_90 '{}' '{"tile_n": 128}' --registry
    python -m flashoverlap.precompile --gpu-arch sm_89 '{"collective": "reduce_scatter", "dtype": "float16"}'

Each item is a JSON object of :class:`~flashoverlap.config.OverlapConfig` fields plus, optionally,
``collective`` (default all_reduce), ``dtype`` (bfloat16: the output's), ``input_dtype`` (the
operands': ``dtype``, or float8_e4m3fn / float8_e5m2 for the FP8 kernels; ``fast_accum``: the calls'
``use_fast_accum``) and ``weight_layout`` (nk: weight [N, K] as in torch Linear; kn: [K, N]);
``--file`` reads a YAML list of them. ``--registry`` adds
every tuned config of the registry (the package's ``configs/*.yaml`` and ``FLASHOVERLAP_CONFIG_DIRS``, whatever
GPU they were tuned on; those the target GPU has no kernel for are skipped, as items are with
``--skip-unsupported``). Kernels land in the on-disk cache the runtime reads
(``FLASHOVERLAP_CACHE_DIR``, default ``~/.cache/flashoverlap``), so the first call of a run does
not stop for a 1-2 minute compile on every rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from . import jit, registry
from .config import OverlapConfig, cli_config, resolve
from .gemm import GemmSpec, generate
from .gemm.generator import DTYPES, FP8_DTYPES, INPUT_DTYPES, WEIGHT_LAYOUTS
from .rules import COLLECTIVES, kernel_spec, resolutions

GPU_ARCHS = {"sm_80": (8, 0), "sm_86": (8, 6), "sm_89": (8, 9), "sm_90": (9, 0)}
CALL_KEYS = {
    "collective": "all_reduce",
    "dtype": "bfloat16",
    "input_dtype": None,
    "weight_layout": "nk",
    "fast_accum": False,
}
log = logging.getLogger("flashoverlap.precompile")  # not __name__: "__main__" under python -m


def load_items(path: str) -> list[dict[str, Any]]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: malformed YAML: {exc}") from None
    if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
        raise ValueError(
            f"{path}: expected a YAML list of mappings (config fields and the call's: {', '.join(CALL_KEYS)})"
        )
    return data


def call_and_configs(item: dict[str, Any]) -> tuple[dict[str, str | None], tuple[OverlapConfig, ...]]:
    """Split an item into its call (collective, dtype, input_dtype, weight_layout) and the configs it may run,
    resolved for the collective (an ``auto`` layout of a reduce-scatter / all-to-all: ``segments``
    and ``cols``, which one depends on the call); raises ``ValueError`` for what no GPU could run."""
    call = {key: item.get(key, default) for key, default in CALL_KEYS.items()}
    if call["collective"] not in COLLECTIVES:
        raise ValueError(f"collective must be one of {list(COLLECTIVES)}, got {call['collective']!r}")
    if call["dtype"] not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {call['dtype']!r}")
    if call["input_dtype"] is not None and call["input_dtype"] not in INPUT_DTYPES:
        raise ValueError(f"input_dtype must be one of {sorted(INPUT_DTYPES)}, got {call['input_dtype']!r}")
    if call["weight_layout"] not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {sorted(WEIGHT_LAYOUTS)}, got {call['weight_layout']!r}")
    if not isinstance(call["fast_accum"], bool):
        raise ValueError(f"fast_accum must be true or false, got {call['fast_accum']!r}")
    fields = {key: value for key, value in item.items() if key not in CALL_KEYS}
    cfg = resolve(fields, call["input_dtype"] in FP8_DTYPES)  # (FP8 items: FP8's tiles, as calls)
    return call, resolutions(cfg, call["collective"])


def spec_for(call: dict[str, str | None], cfg: OverlapConfig, capability: tuple[int, int]) -> GemmSpec | None:
    """The GEMM instance ``cfg`` runs for ``call`` on a GPU of ``capability`` (None: sequential);
    raises ``ValueError`` where that GPU has no kernel for it."""
    if cfg.sequential:
        return None
    spec = kernel_spec(cfg, call["dtype"], call["weight_layout"], capability, call["input_dtype"])[1]
    return dataclasses.replace(spec, fast_accum=call["fast_accum"] and spec.family == "sm90")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashoverlap.precompile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "items", nargs="*", type=cli_config, help="configs as JSON objects or YAML config files (default: '{}')"
    )
    parser.add_argument(
        "--gpu-arch", choices=sorted(GPU_ARCHS), help="the GPUs' compute capability (default: this machine's GPU)"
    )
    parser.add_argument("--file", help="a YAML list of items (mappings like the JSON ones) to add")
    parser.add_argument("--registry", action="store_true", help="add every config of the tuned registry")
    parser.add_argument(
        "--skip-unsupported", action="store_true", help="skip configs this GPU has no kernel for instead of failing"
    )
    parser.add_argument("--jobs", type=int, default=2, help="nvcc processes at once (each takes ~2-4 GB)")
    parser.add_argument("--list", action="store_true", help="print the kernels that would be built, build nothing")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    if args.gpu_arch is None:
        import torch

        if not torch.cuda.is_available():
            parser.error(f"no GPU on this machine: pass --gpu-arch (one of {sorted(GPU_ARCHS)})")
        capability = torch.cuda.get_device_capability()
    else:
        capability = GPU_ARCHS[args.gpu_arch]
    items = list(args.items)
    if args.file:
        try:
            items += load_items(args.file)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
    wanted = []  # (where, call, config, skip where this GPU has no kernel for it)
    for item in items or ([] if args.registry else [{}]):
        try:
            call, cfgs = call_and_configs(item)
            wanted += [(json.dumps(item), call, cfg, args.skip_unsupported) for cfg in cfgs]
        except (ValueError, TypeError) as exc:
            parser.error(f"{json.dumps(item)}: {exc}")
    for entry in registry.entries() if args.registry else []:
        # (an FP8 entry is keyed by its operands' dtype: its kernel's, bf16 out as calls default to;
        # off Hopper FP8 calls overlap only with config=, never from the registry)
        fp8 = entry.dtype in FP8_DTYPES
        if fp8 and capability != (9, 0):
            continue
        dtypes = {"dtype": "bfloat16", "input_dtype": entry.dtype} if fp8 else {"dtype": entry.dtype}
        call = {**CALL_KEYS, "collective": entry.collective, **dtypes}
        wanted += [(entry.source, call, cfg, True) for cfg in resolutions(entry.config, entry.collective)]
    specs: dict[str, GemmSpec] = {}
    for where, call, cfg, skip in wanted:
        try:
            spec = spec_for(call, cfg, capability)
        except ValueError as exc:  # a kernel this GPU lacks (e.g. a Hopper-only config on sm_89)
            if not skip:
                parser.error(f"{where}: {exc} (--skip-unsupported skips such items)")
            log.warning("skipping %s: %s", where, exc)
            continue
        if spec is not None:
            specs.setdefault(spec.name, spec)
    if args.list:
        print("\n".join(specs))
        return 0
    jit.build_runtime()
    started, done = itertools.count(1), itertools.count(1)  # (next() is atomic: the pool's threads share them)
    begin = time.monotonic()

    def build(spec: GemmSpec) -> None:
        start = time.monotonic()
        jit.build(spec.name, generate(spec), arch=spec.arch, cutlass=True, progress=(next(started), len(specs)))
        log.info(
            "%d of %d kernels ready: %s (%.0f s; %.0f s in all)",
            next(done),
            len(specs),
            spec.name,
            time.monotonic() - start,
            time.monotonic() - begin,
        )

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(build, specs.values()))
    print(f"{len(specs)} kernels in {jit.cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
