"""Tuned-config registry: file validation, nearest-shape lookup, transport detection (CPU)."""

import os
from pathlib import Path

import pytest
import yaml

from flashoverlap import registry
from flashoverlap.comm import exchange
from flashoverlap.config import OverlapConfig

ENTRY = {"collective": "all_reduce", "transport": "nvlink", "dtype": "bfloat16", "shape": [4096, 8192, 8192]}


def write(tmp_path: Path, data, name="r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_shipped_registry_files_are_valid():
    entries = registry.load(registry.yaml_files(registry.SHIPPED))
    assert entries and {e.collective for e in entries} == {"all_reduce", "reduce_scatter", "all_to_all"}
    assert {e.transport for e in entries} == {"nvlink", "pcie"}
    # the shipped FP8 entries run in the tiles they were tuned in (none names its own)
    fp8 = [e for e in entries if e.dtype.startswith("float8") and not e.config.sequential]
    assert fp8 and all((e.config.tile_m, e.config.tile_n) == (256, 128) for e in fp8)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"gpu": "H200", "world": 2, "entries": [], "tuned": 1}, r"r.yaml: unknown key\(s\) \['tuned'\]"),
        ({"gpu": "", "world": 2, "entries": []}, "gpu must be a GPU name"),
        ({"gpu": "H200", "world": 0, "entries": []}, "world must be a positive integer"),
        ({"gpu": "H200", "world": 2, "entries": {}}, "entries must be a list"),
        ({"gpu": "H200", "world": 2, "entries": [{**ENTRY, "shape": [1, 2]}]}, r"entries\[0\]: shape must be"),
        ({"gpu": "H200", "world": 2, "entries": [{**ENTRY, "transport": "ib"}]}, "transport must be one of"),
        ({"gpu": "H200", "world": 2, "entries": [{**ENTRY, "dtype": "fp8"}]}, "dtype must be one of"),
        ({"gpu": "H200", "world": 2, "entries": [{**ENTRY, "speed": 1}]}, r"unknown key\(s\) \['speed'\]"),
        (
            {"gpu": "H200", "world": 2, "entries": [{**ENTRY, "timing": "graph"}]},
            r"timing must be one of \['eager', 'graphs'\]",
        ),
        (
            {"gpu": "H200", "world": 2, "entries": [ENTRY, {**ENTRY, "config": {"tile_n": 96}}]},
            r"entries\[1\]: config: .*tile_n 96 not in",
        ),
        (
            {
                "gpu": "H200",
                "world": 2,
                "entries": [{**ENTRY, "collective": "reduce_scatter", "config": {"layout": "tiles"}}],
            },
            r"entries\[0\]: config: reduce_scatter needs layout 'cols', 'rows' or 'segments'",
        ),
        (
            {
                "gpu": "H200",
                "world": 2,
                "entries": [{**ENTRY, "collective": "all_to_all", "fallback": {"layout": "rows"}}],
            },
            r"entries\[0\]: fallback is for calls the entry's config cannot carry: it must carry every call",
        ),
        (
            {
                "gpu": "H200",
                "world": 2,
                "entries": [{**ENTRY, "collective": "all_to_all", "fallback": {"symmetric": True}}],
            },
            r"entries\[0\]: fallback .* no symmetric all-to-all",
        ),
        (
            {"gpu": "H200", "world": 2, "entries": [{**ENTRY, "fallback": {"comm_sms": -1}}]},
            r"entries\[0\]: fallback: .*comm_sms must be >= 0",
        ),
    ],
)
def test_invalid_files_name_file_entry_and_key(tmp_path, data, message):
    path = write(tmp_path, data)
    with pytest.raises(ValueError, match=message):
        registry.load([path])


def test_malformed_yaml_is_named(tmp_path):
    path = write(tmp_path, "gpu: [H200\n")
    with pytest.raises(ValueError, match=f"{path}: malformed YAML"):
        registry.load([path])


def test_fp8_entries_naming_no_tile_take_fp8_tiles(tmp_path):
    """The tuner measures an FP8 candidate naming no tile in FP8's tiles (config.resolve) and writes
    it as it was named: read back, it must be the kernel that was measured, not the 16-bit default."""
    fp8 = {**ENTRY, "dtype": "float8_e4m3fn", "config": {"reduction": "pull", "partition": [1, 2, 2, 2, 1]}}
    named = {**fp8, "shape": [8192, 8192, 8192], "config": {"tile_m": 128, "tile_n": 256}, "fallback": {}}
    data = {"gpu": "H200", "world": 2, "entries": [ENTRY, fp8, named]}
    plain, tuned, own = registry.load([write(tmp_path, data)])
    assert (plain.config.tile_m, plain.config.tile_n) == (OverlapConfig().tile_m, OverlapConfig().tile_n)
    assert (tuned.config.tile_m, tuned.config.tile_n) == (256, 128) and tuned.config.partition == (1, 2, 2, 2, 1)
    assert (own.config.tile_m, own.config.tile_n) == (128, 256)
    assert (own.fallback.tile_m, own.fallback.tile_n) == (256, 128)


def test_single_config_files_are_not_registry_files():
    assert registry.load([registry.SHIPPED / "example.yaml"]) == []


def make_entries(tmp_path):
    data = {
        "gpu": "NVIDIA H200",
        "world": 2,
        "entries": [
            {**ENTRY, "shape": [1024, 8192, 8192], "config": {"sequential": True}},
            {**ENTRY, "config": {"comm_sms": 8, "partition": [1, 2, 2, 2, 1, 1]}},
            {**ENTRY, "transport": "pcie", "config": {"comm_sms": 32}},
        ],
    }
    return registry.load([write(tmp_path, data)])


def test_nearest_shape_within_the_same_gpu_world_collective_transport_dtype(tmp_path):
    entries = make_entries(tmp_path)
    key = ("NVIDIA H200", 2, "all_reduce", "nvlink", "bfloat16")
    assert registry.nearest(entries, *key, (1100, 8192, 8192)).config.sequential
    assert registry.nearest(entries, *key, (8192, 8192, 16384)).config.comm_sms == 8
    assert (
        registry.nearest(entries, "NVIDIA H200", 2, "all_reduce", "pcie", "bfloat16", (1, 8, 8)).config.comm_sms == 32
    )
    for other in (("NVIDIA H100", 2), ("NVIDIA H200", 4)):
        assert registry.nearest(entries, *other, "all_reduce", "nvlink", "bfloat16", (4096, 8192, 8192)) is None
    assert registry.nearest(entries, "NVIDIA H200", 2, "all_to_all", "nvlink", "bfloat16", (4096, 8192, 8192)) is None
    assert registry.nearest(entries, "NVIDIA H200", 2, "all_reduce", "nvlink", "float16", (4096, 8192, 8192)) is None


def test_lookup_searches_user_dirs_first_and_keeps_partitions_only_for_the_exact_shape(tmp_path, monkeypatch):
    first, second = tmp_path / "z_first", tmp_path / "a_second"  # names sort against the search order
    first.mkdir(), second.mkdir()
    make_entries(first)  # writes first/r.yaml
    write(second, {"gpu": "NVIDIA H200", "world": 2, "entries": [{**ENTRY, "config": {"comm_sms": 4}}]})
    monkeypatch.setenv("FLASHOVERLAP_CONFIG_DIRS", os.pathsep.join(map(str, (first, second))))
    registry.reload()
    try:
        exact = registry.lookup("NVIDIA H200", 2, "all_reduce", "nvlink", "bfloat16", (4096, 8192, 8192))
        assert exact == (OverlapConfig(comm_sms=8, partition=(1, 2, 2, 2, 1, 1)), True)
        near = registry.lookup("NVIDIA H200", 2, "all_reduce", "nvlink", "bfloat16", (4096, 8192, 9000))
        assert near == (OverlapConfig(comm_sms=8), False)  # a hint: timed on first use (decision.trial)
        # not in the user's file: the repository's registry answers
        rs = registry.lookup("NVIDIA H200", 2, "reduce_scatter", "pcie", "bfloat16", (16384, 8192, 4096))
        assert rs is not None and rs.exact and not rs.config.sequential
        assert registry.lookup("NVIDIA A100", 8, "all_reduce", "nvlink", "bfloat16", (1, 8, 8)) is None
    finally:
        registry.reload()


def test_graph_timed_entries_apply_only_to_calls_replayed_as_graphs(tmp_path, monkeypatch):
    small, large = [4096, 4096, 4096], [8192, 8192, 8192]
    data = {
        "gpu": "NVIDIA H100",
        "world": 2,
        "entries": [
            {**ENTRY, "shape": small, "config": {"sequential": True}},
            {**ENTRY, "shape": large, "config": {"comm_sms": 16}},
            {**ENTRY, "shape": small, "config": {"symmetric": True}, "timing": "graphs"},
        ],
    }
    entries = registry.load([write(tmp_path, data)])
    assert [e.timing for e in entries] == ["eager", "eager", "graphs"]
    key = ("NVIDIA H100 80GB HBM3", 2, "all_reduce", "nvlink", "bfloat16")
    assert registry.nearest(entries, *key, tuple(small)).config.sequential  # eager: host time counts
    assert registry.nearest(entries, *key, tuple(small), "graphs").config.symmetric
    # the graph-timed entry is no nearer to another shape than the eager one tuned for it
    assert registry.nearest(entries, *key, (8192, 8192, 7000), "graphs").config.comm_sms == 16
    monkeypatch.setenv("FLASHOVERLAP_CONFIG_DIRS", str(tmp_path))
    registry.reload()
    try:
        monkeypatch.delenv("FLASHOVERLAP_TIMING", raising=False)
        assert registry.timing() == "eager"
        assert registry.lookup(*key, tuple(small)).config.sequential
        monkeypatch.setenv("FLASHOVERLAP_TIMING", "graphs")
        assert registry.lookup(*key, tuple(small), timing=registry.timing()) == (OverlapConfig(symmetric=True), True)
        monkeypatch.setenv("FLASHOVERLAP_TIMING", "graph")
        with pytest.raises(ValueError, match=r"FLASHOVERLAP_TIMING='graph': expected one of \['eager', 'graphs'\]"):
            registry.timing()
    finally:
        registry.reload()


def test_transport_follows_the_nccl_environment(monkeypatch):
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    monkeypatch.delenv("NCCL_SHM_DISABLE", raising=False)
    assert registry.transport() == "pcie"
    monkeypatch.setenv("NCCL_SHM_DISABLE", "1")
    assert registry.transport() == "net"
    monkeypatch.delenv("NCCL_P2P_DISABLE")
    assert registry.transport() == "nvlink"  # no GPUs here to say otherwise


@pytest.mark.parametrize("config", [{"layout": "rows", "comm_sms": 8}, {"symmetric": True}])
def test_an_entry_is_not_used_for_unequal_all_to_all_splits_it_cannot_carry(tmp_path, monkeypatch, config):
    """Entries are tuned with equal splits; a call with unequal ones, which the rows layout and
    symmetric windows cannot carry, gets the defaults (or the entry's fallback) instead of an error."""
    import torch

    from flashoverlap import decision
    from flashoverlap.decision import tuned_config

    a2a = {**ENTRY, "collective": "all_to_all", "config": config}
    write(tmp_path, {"gpu": "NVIDIA H200", "world": 2, "entries": [a2a]})
    monkeypatch.setenv("FLASHOVERLAP_CONFIG_DIRS", str(tmp_path))
    monkeypatch.setattr(decision, "_device_name", lambda index: "NVIDIA H200")
    a = torch.empty(4096, 8192, dtype=torch.bfloat16)
    shape = (4096, 8192, 8192)
    even = exchange("all_to_all", 4096, 2)
    assert tuned_config(a, 2, even, shape, "nvlink") == (OverlapConfig(**config), True)
    uneven = exchange("all_to_all", 4096, 2, splits=[1000, 3096], output_splits=[1000, 1000])
    assert tuned_config(a, 2, uneven, shape, "nvlink") is None  # the defaults, timed on first use (decision.trial)
    # with the fallback the tuner measured for such calls
    write(tmp_path, {"gpu": "NVIDIA H200", "world": 2, "entries": [{**a2a, "fallback": {"sequential": True}}]})
    registry.reload()
    assert tuned_config(a, 2, even, shape, "nvlink") == (OverlapConfig(**config), True)
    assert tuned_config(a, 2, uneven, shape, "nvlink") == (OverlapConfig(sequential=True), True)
    # over a group that sends no CUDA tensors point to point (gloo) the rows layout falls back too
    rows = config.get("layout") == "rows"
    assert tuned_config(a, 2, even, shape, "nvlink", p2p=False) == (
        OverlapConfig(sequential=True) if rows else OverlapConfig(**config),
        True,
    )


def test_registry_writing_merges_and_validates(tmp_path):

    path = tmp_path / "tuned.yaml"
    tuned = {"comm_sms": 8, "partition": [3, 6]}
    first = [registry.entry("all_reduce", "nvlink", "bfloat16", (4096, 8192, 8192), tuned, {})]
    registry.write_registry(str(path), "NVIDIA H200", 2, first)
    again = [
        registry.entry("all_reduce", "nvlink", "bfloat16", (4096, 8192, 8192), {"sequential": True}, {"speedup": 0.97}),
        registry.entry("all_reduce", "nvlink", "bfloat16", (1024, 8192, 8192), {}, {"speedup": 1.05}),
    ]
    registry.write_registry(str(path), "NVIDIA H200", 2, again)
    loaded = registry.load([path])
    assert [(e.shape, e.config.sequential) for e in loaded] == [((1024, 8192, 8192), False), ((4096, 8192, 8192), True)]
    with pytest.raises(ValueError, match="holds configs for 'NVIDIA H200' x2"):
        registry.write_registry(str(path), "NVIDIA H100", 2, again)
    bad = [registry.entry("reduce_scatter", "nvlink", "bfloat16", (8, 8, 8), {"layout": "tiles"}, {})]
    with pytest.raises(ValueError, match="needs layout 'cols'"):
        registry.write_registry(str(path), "NVIDIA H200", 2, bad)
    assert len(registry.load([path])) == 2  # the rejected write left the file as it was
    # an entry timed as CUDA graphs sits beside the eager one of its shape, and is replaced by its own kind
    graphs = registry.entry("all_reduce", "nvlink", "bfloat16", (4096, 8192, 8192), {"symmetric": True}, {}, "graphs")
    registry.write_registry(str(path), "NVIDIA H200", 2, [graphs])
    registry.write_registry(str(path), "NVIDIA H200", 2, [{**graphs, "config": {"comm_sms": 8}}])
    loaded = registry.load([path])
    assert [(e.shape[0], e.timing) for e in loaded] == [(1024, "eager"), (4096, "eager"), (4096, "graphs")]
    assert loaded[1].config.sequential and loaded[2].config == OverlapConfig(comm_sms=8)
    assert "timing" not in again[0]  # eager entries are written as before
