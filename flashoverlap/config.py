"""Overlap configuration: the GEMM instance, the SM budget and the group partition.

A config is an :class:`OverlapConfig`, a mapping with the same keys, or a YAML file holding
one. Validation names the source, the key and the allowed values.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from .gemm.generator import EPILOGUES, FAMILIES, validate_instance
from .plan import LAYOUTS, SWIZZLES

# "local" and "pull" gather every rank's partial sums, then add; "pull_scatter" sums one share of
# every group per rank, reading the others' partial sums in their memory, then copies the other
# shares' sums (a reduce-scatter and an all-gather per group: 2 (w - 1) / w of a group per rank, as
# a ring, where "pull" moves w - 1); "pull_fused" (reduce-scatter) copies a rank's own rows of the
# others' partial sums and adds them in the GEMM's epilogue, as it computes those rows last
REDUCTIONS = ("nccl", "local", "pull", "pull_scatter", "pull_fused")
PULLS = ("pull", "pull_scatter", "pull_fused")  # the reductions that take from the other ranks' memory (comm.peer)
ROW_MAJOR = ("rows", "segments")  # layouts whose buffer is row-major tile rows (the TMA epilogue's)


@dataclass(frozen=True)
class OverlapConfig:
    """How one overlapped GEMM + collective runs.

    tile_m, tile_n, tile_k, cluster_m, scheduler: the CUTLASS instance (see ``flashoverlap.gemm``;
      ``tile_k`` None: 64 for Hopper kernels, 32 for Ampere/Ada ones).
    kernel: ``sm90`` (Hopper: TMA + WGMMA), ``sm80`` (Ampere / Ada: cp.async + mma.sync; runs on
      Hopper too), or ``auto``: ``sm90`` on compute capability 9.0, else ``sm80``.
    swizzle: tile raster in panels this many tiles wide (1, 2, 4, 8; persistent scheduler only) for
      L2 reuse; the scheduler applies less where the tile grid is small (plan.effective_swizzle).
    comm_sms: SMs left out of the GEMM's persistent grid so NCCL kernels can run beside it.
    late_budget: leave the ``comm_sms`` SMs only from the wave after which the rest of the grid
      still ends the GEMM in as many waves as every SM does (plan.late_after): the CTAs on them stop
      there and NCCL's kernels, queued behind the GEMM, take their SMs. The early groups' collectives
      wait until then, but the budget costs the GEMM no wave (where it does: 116 SMs take 9 waves
      of 1024 tiles, 132 take 8). Hopper kernels (``sm90``), persistent scheduler, ``cluster_m`` 1.
    partition: waves per group, summing to the GEMM's wave count; ``None`` picks a default.
    layout: ``rows`` (groups rounded to row bands, stored in place; all-reduce, and reduce-scatter /
      all-to-all with a rotated schedule, a send / receive per group), ``tiles`` (exact wave
      groups, packed slots, restored after; all-reduce), ``cols`` (groups of whole tile columns;
      any collective), ``segments`` (reduce-scatter / all-to-all with equal segments: each group
      the same rows of every rank's segment, stored segment after segment at full width, one
      ordinary collective per group), or ``auto``: ``rows`` for all-reduce; for the others
      ``segments`` where they carry the call, else ``cols`` (rules.resolutions, rules.for_call).
    epilogue: ``tma`` (bulk tensor stores overlapped with the next tile; ``rows`` / ``segments``),
      ``direct`` (register stores into any slot), or ``auto``: ``tma`` for ``rows``, else ``direct``.
    sequential: run the plain GEMM then the collective (where overlap cannot pay).
    symmetric: the group buffers live in an NCCL symmetric-memory window (NCCL >= 2.27, ranks with
      peer access; elsewhere NCCL runs its usual kernels): all-reduce / reduce-scatter take NCCL's
      symmetric kernels (NVLink loads and stores instead of a ring), all-to-all the copy engines (no
      SM). One window per communicator pair serves every call (comm.nccl.Window); the result is
      copied out of it.
    reduction: where an all-reduce adds the ranks' partial sums: ``nccl`` (NCCL's all-reduce per
      group) or ``local``: each group is all-gathered (with ``symmetric``, on the copy engines, so
      ``comm_sms`` can be 0) and each group's partial sums are added as soon as they arrive, on the
      SMs ``comm_sms`` leaves (a few suffice; with 0, as the GEMM retires). Moves as many bytes as
      an all-reduce on 2 ranks, world / 2 times more beyond. Or ``pull``: as ``local``, but each
      rank copies the other ranks' partial sums of a group out of their memory on the copy engines
      (CUDA peer access through torch symmetric memory, no NCCL, no SM: comm.peer), which keep
      their pace beside a GEMM on every SM where NCCL's copy-engine all-gather does not; ranks with
      peer access only (NVLink or PCIe P2P), layout ``rows``, no NCCL window (``symmetric``).
      Reduce-scatter / all-to-all (layout ``segments``) pull too: each rank copies only its own
      segment's rows of every other rank's group as each group lands, and sums them from the copies
      on the ``comm_sms`` SMs (reduce-scatter; with 0, after the GEMM) or copies them straight into
      its result (all-to-all). Or
      ``pull_scatter`` (all-reduce, layout ``rows``): each rank sums only its 1 / w share of each
      group, reading the other ranks' partial sums where they are, and then copies the other
      ranks' summed shares: a reduce-scatter and an all-gather per group, 2 (w - 1) / w of a group
      per rank as NCCL's ring (``pull``: w - 1) and 1 / w of the adds; for four and more ranks. Or
      ``pull_fused`` (reduce-scatter, layout ``rows``, the Hopper kernels): the
      schedule computes every other rank's segment first and this rank's own last; meanwhile the
      copy engines copy this rank's rows of the other ranks' groups, and the GEMM's epilogue adds
      them to its own rows as it computes them, into the result: no SM for the sums beside the GEMM
      (``comm_sms`` can be 0) and no sums after it.
    """

    tile_m: int = 128
    tile_n: int = 256
    tile_k: int | None = None
    cluster_m: int = 1
    scheduler: str = "persistent"
    swizzle: int = 1
    comm_sms: int = 16
    late_budget: bool = False
    partition: tuple[int, ...] | None = None
    layout: str = "auto"
    epilogue: str = "auto"
    kernel: str = "auto"
    sequential: bool = False
    symmetric: bool = False
    reduction: str = "nccl"

    def __post_init__(self) -> None:
        if self.partition is not None:
            object.__setattr__(self, "partition", tuple(self.partition))
        problems = _problems(self)
        if problems:
            raise ValueError("invalid flashoverlap config: " + "; ".join(problems))
        self._keep_hash()

    # Every call with ``config=`` hashes it (the key its decision is kept under): the frozen
    # dataclass's own hash builds a tuple of every field each time, ~1 us on a GPU host's CPU, 1 %
    # of a host-bound call. So it is made once; not pickled (a string's hash differs between
    # processes), made again where unpickled.
    def _keep_hash(self) -> None:
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self))))

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self._keep_hash()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> OverlapConfig:
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: expected a mapping of config keys, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown}; allowed: {sorted(known)}")
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], fp8: bool = False) -> OverlapConfig:
        """The config a YAML file holds (``fp8``: see :func:`resolve`)."""
        path = os.fspath(path)
        try:
            with open(path) as handle:
                data = yaml.safe_load(handle)
        except FileNotFoundError:
            raise FileNotFoundError(f"flashoverlap config file not found: {path}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: malformed YAML: {exc}") from None
        data = data if data is not None else {}
        return cls.from_dict(with_fp8_tiles(data) if fp8 else data, source=path)


def _problems(cfg: OverlapConfig) -> list[str]:
    problems = []
    for name in ("tile_m", "tile_n", "tile_k", "cluster_m", "swizzle", "comm_sms"):
        value = getattr(cfg, name)
        if (not isinstance(value, int) or isinstance(value, bool)) and not (name == "tile_k" and value is None):
            problems.append(f"{name} must be an integer, got {value!r}")
    if cfg.kernel != "auto" and cfg.kernel not in FAMILIES:
        problems.append(f"kernel must be one of {['auto', *FAMILIES]}, got {cfg.kernel!r}")
    if problems:
        return problems
    # a config must make an instance of its kernel family (either family for "auto")
    families = list(FAMILIES) if cfg.kernel == "auto" else [cfg.kernel]
    reasons = {f: family_problems(cfg, f, cfg.epilogue) for f in families}
    if all(reasons.values()):
        problems += reasons[families[0]] if len(families) == 1 else reasons["sm90"] + reasons["sm80"]
    if cfg.swizzle not in SWIZZLES:
        problems.append(f"swizzle must be one of {list(SWIZZLES)}, got {cfg.swizzle}")
    elif cfg.swizzle > 1 and cfg.scheduler != "persistent":
        problems.append(f"swizzle {cfg.swizzle} needs scheduler 'persistent' (stream-K tiles are planned unswizzled)")
    if cfg.comm_sms < 0:
        problems.append(f"comm_sms must be >= 0, got {cfg.comm_sms}")
    if cfg.late_budget is True and (cfg.scheduler != "persistent" or cfg.cluster_m != 1):
        problems.append(
            f"late_budget stops CTAs of the persistent schedule one by one: scheduler 'persistent' and "
            f"cluster_m 1, got {cfg.scheduler!r} and {cfg.cluster_m}"
        )
    if cfg.partition is not None and (
        not cfg.partition or any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in cfg.partition)
    ):
        problems.append(f"partition must be a non-empty list of positive integers (waves), got {list(cfg.partition)}")
    if cfg.layout != "auto" and cfg.layout not in LAYOUTS:
        problems.append(f"layout must be one of {['auto', *LAYOUTS]}, got {cfg.layout!r}")
    if cfg.epilogue != "auto" and cfg.epilogue not in EPILOGUES:
        problems.append(f"epilogue must be one of {['auto', *EPILOGUES]}, got {cfg.epilogue!r}")
    elif cfg.epilogue == "tma" and cfg.layout not in (*ROW_MAJOR, "auto"):
        problems.append(
            f"epilogue 'tma' stores whole rows of a row-major buffer: layout 'rows' or 'segments', got {cfg.layout!r}"
        )
    if cfg.reduction not in REDUCTIONS:
        problems.append(f"reduction must be one of {list(REDUCTIONS)}, got {cfg.reduction!r}")
    elif cfg.reduction in PULLS and (cfg.symmetric or cfg.layout not in ("rows", "segments", "auto")):
        problems.append(
            f"reduction {cfg.reduction!r} brings its own memory every rank maps and adds into the result's row "
            f"bands: layout 'rows', 'segments' (or auto) without symmetric, got layout {cfg.layout!r}, "
            f"symmetric {cfg.symmetric!r}"
        )
    for name in ("sequential", "symmetric", "late_budget"):
        if not isinstance(getattr(cfg, name), bool):
            problems.append(f"{name} must be true or false, got {getattr(cfg, name)!r}")
    return problems


def family_problems(cfg: OverlapConfig, family: str, epilogue: str) -> list[str]:
    """Reasons ``cfg`` with ``epilogue`` makes no kernel of ``family`` (empty when it does)."""
    problems = validate_instance(*gemm_instance(cfg, family), family=family)
    if family == "sm80" and epilogue == "tma":
        problems.append("epilogue 'tma' is a Hopper (sm90) kernel's; the sm80 kernels write through CUTLASS 2.x's")
    if family == "sm80" and cfg.late_budget:  # two resident CTAs per SM: those that stop free no whole SM
        problems.append("late_budget is for the Hopper (sm90) kernels")
    if family == "sm80" and cfg.reduction == "pull_fused":
        problems.append("reduction 'pull_fused' adds in the Hopper (sm90) kernels' epilogues")
    return problems


def gemm_instance(cfg: OverlapConfig, family: str) -> tuple[int, int, int, int, str]:
    tile_k = cfg.tile_k if cfg.tile_k is not None else FAMILIES[family]["tile_k"][0]
    return cfg.tile_m, cfg.tile_n, tile_k, cfg.cluster_m, cfg.scheduler


def differences(cfg: OverlapConfig, base: OverlapConfig) -> dict[str, Any]:
    """``cfg``'s fields whose values differ from ``base``'s (a config named by what it changes)."""
    return {
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(base, f.name)
    }


def cli_config(text: str) -> dict[str, Any]:
    """A config given on a command line (an argparse ``type``): a JSON object of its fields, or
    the path of a YAML config file (``flashoverlap/configs/consumer_pcie.yaml``), whose fields it returns once
    they validate."""
    import argparse
    import json

    if text.endswith((".yaml", ".yml")):
        try:
            OverlapConfig.from_yaml(text)
        except (OSError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        with open(text) as handle:
            return yaml.safe_load(handle) or {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object or a .yaml file, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object or a .yaml file, got {text!r}")
    return value


# Dicts passed as config= (per call, as in a training loop) validated once: key -> config
_from_dicts: dict[tuple, OverlapConfig] = {}
MAX_DICT_CONFIGS = 256


def _typed(value: Any) -> Any:
    """A hashable stand-in for a config value that keeps its type (1, 1.0 and True must not meet)."""
    return (type(value), tuple(map(_typed, value)) if isinstance(value, list) else value)


# The tiles a call with FP8 operands starts from: where the partial sums are promoted, 128x256 (one
# 64x256 atom per warp group) spills registers and runs ~3x slower than 256x128 alone
# (csrc/fp8_promotion.cuh; docs/experiments.md, FP8); with fast accumulation 256x128 measured as fast
# as 128x256 or faster on most shapes.
FP8_TILES = {"tile_m": 256, "tile_n": 128}


def with_fp8_tiles(data: Any) -> Any:
    """A config mapping for a call with FP8 operands: FP8's tiles where it names neither."""
    if isinstance(data, Mapping) and "tile_m" not in data and "tile_n" not in data:
        return {**FP8_TILES, **data}
    return data


def resolve(
    config: OverlapConfig | Mapping[str, Any] | str | os.PathLike[str] | None, fp8: bool = False
) -> OverlapConfig:
    """Turn what a user passed as ``config=`` into an :class:`OverlapConfig`. ``fp8``: for a call
    with FP8 operands, whose mapping or YAML file (or none) naming neither ``tile_m`` nor ``tile_n``
    takes :data:`FP8_TILES`; an :class:`OverlapConfig` is taken as it is."""
    if config is None:
        return OverlapConfig(**FP8_TILES) if fp8 else OverlapConfig()
    if isinstance(config, OverlapConfig):
        return config
    if isinstance(config, Mapping):
        if fp8:
            config = with_fp8_tiles(config)
        try:
            key = tuple(sorted((k, _typed(v)) for k, v in config.items()))
            hash(key)
        except TypeError:  # unhashable or unsortable: validate as given, which names the problem
            return OverlapConfig.from_dict(config)
        cfg = _from_dicts.get(key)
        if cfg is None:
            cfg = OverlapConfig.from_dict(config)
            if len(_from_dicts) < MAX_DICT_CONFIGS:
                _from_dicts[key] = cfg
        return cfg
    if isinstance(config, (str, os.PathLike)):
        return OverlapConfig.from_yaml(config, fp8)
    raise TypeError(f"config must be an OverlapConfig, a mapping or a YAML path, got {type(config).__name__}")
