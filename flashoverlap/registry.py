"""Tuned configs from YAML files, looked up by GPU, world size, collective, transport, dtype and shape.

A registry file (``flashoverlap/configs/*.yaml``, shipped inside the package)::

    gpu: NVIDIA H200        # matched against torch.cuda.get_device_name() (substring)
    world: 2
    entries:
      - {collective: all_reduce, transport: nvlink, dtype: bfloat16, shape: [4096, 8192, 8192],
         config: {comm_sms: 16}, measured: {speedup: 1.13}}
      - {collective: all_reduce, transport: nvlink, dtype: bfloat16, shape: [1024, 8192, 8192],
         config: {sequential: true}}

``config`` holds :class:`~flashoverlap.config.OverlapConfig` fields; ``fallback`` (optional, the
tuner writes it next to a reduce-scatter / all-to-all config that cannot carry every call: ``rows``
or ``segments``, symmetric all-to-all) the same, for the calls that config cannot carry (unequal
splits, segments not whole tile rows), itself one that carries every call; ``measured`` is
free-form information. ``timing`` (optional): ``eager`` (the default) or ``graphs``, how the entry
was measured (``tune --graphs``: replayed as CUDA graphs, no host time); ``graphs`` entries are read
only by processes that set ``FLASHOVERLAP_TIMING=graphs`` (their calls are replayed as CUDA graphs),
where they come before ``eager`` ones of the same shape. A call with ``config=None`` takes the entry
of its GPU, world size, collective, transport and dtype whose shape is nearest (log-distance over
M, N, K); a ``partition`` (waves per group) is kept only for the exact shape. An entry of another
shape is a hint: a call takes it, or the same with NCCL's SMs taken differently
(rules.alternative), or the sequential path, whichever its first timing finds beats the
sequential call clearly (decision.trial); so does a call with no matching entry, from the built-in
defaults.

Files are read from ``FLASHOVERLAP_CONFIG_DIRS`` (``os.pathsep``-separated directories, searched
first) and the package's own ``configs/`` (:data:`SHIPPED`, package data: an installed wheel carries it).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import yaml

from . import state
from .config import OverlapConfig, with_fp8_tiles
from .rules import COLLECTIVES, resolutions, takes_every_call

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

TRANSPORTS = ("nvlink", "pcie", "net")
DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")  # the operands' (FP8: any result dtype)
# how calls run, and so how an entry was measured: host time included, or replayed as CUDA graphs
TIMINGS = ("eager", "graphs")
FILE_KEYS = {"gpu", "world", "entries"}
ENTRY_KEYS = {"collective", "transport", "dtype", "shape", "config", "fallback", "measured", "timing"}
# the tuned registry files (and the sample single configs) the package carries; read through
# importlib.resources, so that any installed form of the package finds them
SHIPPED: Traversable = importlib.resources.files(__package__) / "configs"


class Found(NamedTuple):
    """A registry's answer for a call: the config, and whether it was tuned for the call's very
    shape (else it is the nearest shape's, its partition dropped: a hint, not a measurement)."""

    config: OverlapConfig
    exact: bool


@dataclass(frozen=True)
class Entry:
    gpu: str
    world: int
    collective: str
    transport: str
    dtype: str
    shape: tuple[int, int, int]
    config: OverlapConfig
    source: str  # file and entry index, for messages
    fallback: OverlapConfig | None = None  # for calls ``config`` cannot carry (rules.takes_every_call)
    timing: str = "eager"  # TIMINGS


def parse(data: Any, source: str) -> list[Entry]:
    """Validate one registry file's content; errors name the file, the entry and the key."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping with keys {sorted(FILE_KEYS)}")
    unknown = sorted(set(data) - FILE_KEYS)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown}; allowed: {sorted(FILE_KEYS)}")
    gpu, world, entries = data.get("gpu"), data.get("world"), data.get("entries")
    if not isinstance(gpu, str) or not gpu:
        raise ValueError(f"{source}: gpu must be a GPU name such as 'NVIDIA H200', got {gpu!r}")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"{source}: world must be a positive integer, got {world!r}")
    if not isinstance(entries, list):
        raise ValueError(f"{source}: entries must be a list, got {type(entries).__name__}")
    return [_entry(item, gpu, world, f"{source}: entries[{i}]") for i, item in enumerate(entries)]


def _entry(item: Any, gpu: str, world: int, where: str) -> Entry:
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a mapping with keys {sorted(ENTRY_KEYS)}")
    unknown = sorted(set(item) - ENTRY_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(ENTRY_KEYS)}")
    item = {"timing": TIMINGS[0], **item}
    choices = (("collective", COLLECTIVES), ("transport", TRANSPORTS), ("dtype", DTYPES), ("timing", TIMINGS))
    for key, allowed in choices:
        if item.get(key) not in allowed:
            raise ValueError(f"{where}: {key} must be one of {list(allowed)}, got {item.get(key)!r}")
    shape = item.get("shape")
    if not (
        isinstance(shape, list)
        and len(shape) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape)
    ):
        raise ValueError(f"{where}: shape must be [M, N, K] of positive integers, got {shape!r}")
    # an FP8 entry naming no tile was tuned in FP8's (config.resolve): read back in them too
    fp8 = item["dtype"].startswith("float8")
    config = _config(item.get("config", {}), item["collective"], f"{where}: config", fp8)
    fallback = _config(item["fallback"], item["collective"], f"{where}: fallback", fp8) if "fallback" in item else None
    if fallback is not None and not takes_every_call(fallback, item["collective"]):
        raise ValueError(
            f"{where}: fallback is for calls the entry's config cannot carry: it must carry every call "
            "(no rows / segments layout, no symmetric all-to-all)"
        )
    return Entry(
        gpu,
        world,
        item["collective"],
        item["transport"],
        item["dtype"],
        tuple(shape),
        config,
        where,
        fallback,
        item["timing"],
    )


def _config(data: Any, collective: str, where: str, fp8: bool = False) -> OverlapConfig:
    """An entry's config (or fallback), valid for its collective (``fp8``: of an FP8 entry, FP8's
    tiles where it names neither, as config.resolve gives a call's mapping)."""
    config = OverlapConfig.from_dict(with_fp8_tiles(data) if fp8 else data, source=where)
    try:
        resolutions(config, collective)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return config


def load(paths: Iterable[Path | Traversable]) -> list[Entry]:
    entries = []
    for path in paths:
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: malformed YAML: {exc}") from None
        if isinstance(data, dict) and "entries" in data:  # registry files (not single configs)
            entries += parse(data, str(path))
    return entries


def config_dirs() -> list[Path | Traversable]:
    return list(_dirs(os.environ.get("FLASHOVERLAP_CONFIG_DIRS", "")))


@functools.lru_cache(maxsize=16)  # every call without config= asks (as the variable's text: cheap to hash)
def _dirs(spec: str) -> tuple[Path | Traversable, ...]:
    return (*(Path(p) for p in spec.split(os.pathsep) if p), SHIPPED)


def yaml_files(directory: Path | Traversable) -> list[Path | Traversable]:
    """The YAML files of a directory (a user's, or :data:`SHIPPED`), by name."""
    return sorted((p for p in directory.iterdir() if p.name.endswith(".yaml")), key=lambda p: p.name)


@functools.cache
def _entries_in(dirs: tuple[Path | Traversable, ...]) -> list[Entry]:
    # directory order first (user directories win ties), file names within a directory
    return load(p for d in dirs if d.is_dir() for p in yaml_files(d))


def entries() -> list[Entry]:
    """Every entry of the registry files in :func:`config_dirs` (read once per set of directories)."""
    return _entries_in(tuple(config_dirs()))


def nearest(
    entries: Sequence[Entry],
    gpu: str,
    world: int,
    collective: str,
    transport: str,
    dtype: str,
    shape: tuple[int, int, int],
    timing: str = "eager",
) -> Entry | None:
    """The entry for this call's GPU, world, collective, transport and dtype nearest in shape
    (log-distance), of calls that run as ``timing`` says (:func:`timing`: ``graphs`` reads
    ``eager`` entries too; of two as near, the ``graphs`` one); earlier entries (earlier
    directories) win ties."""
    timings = TIMINGS if timing == "graphs" else (timing,)
    candidates = [
        e
        for e in entries
        if e.gpu in gpu
        and e.world == world
        and (e.collective, e.transport, e.dtype) == (collective, transport, dtype)
        and e.timing in timings
    ]
    if not candidates:
        return None
    return min(
        candidates,
        key=lambda e: (sum(abs(math.log(a / b)) for a, b in zip(e.shape, shape)), e.timing != timing),
    )


def reload() -> None:
    """Forget the files read so far and every call's decision, for a process that edits them, or
    the environment its decisions rest on (``FLASHOVERLAP_*``, ``NCCL_P2P_DISABLE``), while it runs:
    a decision reads both when made."""
    _entries_in.cache_clear()
    _lookup.cache_clear()
    state.forget_decisions()


def lookup(
    gpu: str,
    world: int,
    collective: str,
    transport: str,
    dtype: str,
    shape: tuple[int, int, int],
    fallback: bool = False,
    timing: str = "eager",
) -> Found | None:
    """The tuned config for a call (see the module doc), or None; ``fallback``: the entry's config
    for calls its config cannot carry instead (None where it has none; rules.carries);
    ``timing``: how the calls run (:func:`timing`)."""
    spec = os.environ.get("FLASHOVERLAP_CONFIG_DIRS", "")
    return _lookup(spec, gpu, world, collective, transport, dtype, tuple(shape), fallback, timing)


@functools.lru_cache(maxsize=1024)  # every call without config= asks: keep the search off its host time
def _lookup(
    spec: str,
    gpu: str,
    world: int,
    collective: str,
    transport: str,
    dtype: str,
    shape: tuple[int, ...],
    fallback: bool,
    timing: str,
) -> Found | None:
    entry = nearest(_entries_in(_dirs(spec)), gpu, world, collective, transport, dtype, shape, timing)
    config = None if entry is None else entry.fallback if fallback else entry.config
    if config is None:
        return None
    exact = entry.shape == tuple(shape)
    if not exact and config.partition is not None:
        config = dataclasses.replace(config, partition=None)  # waves differ between shapes
    return Found(config, exact)


def timing() -> str:
    """How this process's calls run (``FLASHOVERLAP_TIMING``): ``eager`` (the default; the host's
    time to enqueue a call counts) or ``graphs`` (replayed as CUDA graphs: it does not, and entries
    measured so, ``tune --graphs``, apply). Set it for the eager warm-up calls before capture too,
    so that they decide as the captured ones will."""
    value = os.environ.get("FLASHOVERLAP_TIMING", TIMINGS[0])
    if value not in TIMINGS:
        raise ValueError(f"FLASHOVERLAP_TIMING={value!r}: expected one of {list(TIMINGS)}")
    return value


def transport(hosts: int = 1) -> str:
    """How NCCL moves data between a group's GPUs: ``net`` where its ranks sit on several ``hosts``
    (decision._start counts them per group); between this node's GPUs what ``NCCL_P2P_DISABLE`` /
    ``NCCL_SHM_DISABLE`` force, else ``nvlink`` where the GPUs can access each other's memory."""
    if hosts > 1:
        return "net"
    if os.environ.get("NCCL_P2P_DISABLE") == "1":
        return "net" if os.environ.get("NCCL_SHM_DISABLE") == "1" else "pcie"
    return "nvlink" if _peer_access() else "pcie"


@functools.cache  # a driver query: every call without config= asks
def _peer_access() -> bool:
    import torch

    return torch.cuda.device_count() < 2 or torch.cuda.can_device_access_peer(0, 1)


# --- writing registry files (python -m flashoverlap.tune) ------------------------------------


def entry(
    collective: str, transport: str, dtype: str, shape, config: dict, measured: dict, timing: str = "eager"
) -> dict:
    """One registry entry (flashoverlap.registry) as written to YAML (``timing`` only where not eager)."""
    return {
        "collective": collective,
        "transport": transport,
        "dtype": dtype,
        "shape": [int(v) for v in shape],
        "config": config,
        "measured": measured,
        **({"timing": timing} if timing != "eager" else {}),
    }


def _key(e: dict) -> tuple:
    """What a registry entry is for: one call (collective, transport, dtype, shape) timed one way."""
    return (e["collective"], e["transport"], e["dtype"], tuple(e["shape"]), e.get("timing", "eager"))


def incumbent(existing: list[dict], collective: str, transport: str, dtype: str, shape, timing: str) -> dict | None:
    """The entry in ``existing`` a re-tune of this call would replace, None where there is none or
    it runs sequentially (the tuner measures sequential anyway)."""
    want = (collective, transport, dtype, tuple(int(v) for v in shape), timing)
    found = next((e for e in existing if _key(e) == want), None)
    return None if found is None or found["config"].get("sequential") else found


def merge(existing: list[dict], new: list[dict]) -> list[dict]:
    """``existing`` entries with those ``new`` re-tunes replaced; sorted by collective, transport, shape
    (an entry timed as CUDA graphs beside the eager one of its shape)."""
    fresh = {_key(e): e for e in new}
    kept = [e for e in existing if _key(e) not in fresh]
    return sorted(kept + list(fresh.values()), key=_key)


def read_entries(path: str, gpu: str, world: int) -> list[dict]:
    """The entries of the registry file at ``path`` (none where it does not exist yet); a file for
    another GPU or world size is an error."""
    target = Path(path)
    if not target.exists():
        return []
    data = yaml.safe_load(target.read_text()) or {}
    if (data.get("gpu"), data.get("world")) != (gpu, world):
        raise ValueError(f"{path} holds configs for {data.get('gpu')!r} x{data.get('world')}, not {gpu!r} x{world}")
    return data.get("entries", [])


def write_registry(path: str, gpu: str, world: int, entries: list[dict]) -> None:
    """Write (or update) the registry file at ``path``; the result is validated by loading it."""
    target = Path(path)
    existing = read_entries(path, gpu, world)
    text = yaml.safe_dump({"gpu": gpu, "world": world, "entries": merge(existing, entries)}, sort_keys=False)
    parse(yaml.safe_load(text), str(path))  # never write a file the runtime would reject
    tmp = target.with_suffix(".tmp")
    tmp.write_text("# written by python -m flashoverlap.tune\n" + text)
    os.replace(tmp, target)
