import pytest

from flashoverlap.config import OverlapConfig, for_collective, for_device, resolutions, resolve


def test_defaults_are_valid_and_mappings_resolve():
    assert resolve(None) == OverlapConfig()
    cfg = resolve({"tile_n": 128, "partition": [1, 2, 1], "comm_sms": 16})
    assert cfg.tile_n == 128 and cfg.partition == (1, 2, 1) and cfg.comm_sms == 16
    assert resolve(cfg) is cfg


def test_dict_configs_are_validated_once_but_never_mistaken_for_an_equal_value_of_another_type():
    first = resolve({"swizzle": 2, "partition": [1, 2]})
    assert resolve({"partition": [1, 2], "swizzle": 2}) is first  # cached, key order irrelevant
    for bad in ({"swizzle": 2.0, "partition": [1, 2]}, {"swizzle": 2, "partition": [1, 2.0]}, {"swizzle": True}):
        with pytest.raises(ValueError, match="must be"):
            resolve(bad)
    with pytest.raises(ValueError, match="unknown key"):
        resolve({"partition": [1, 2], "tile": {"m": 128}})  # unhashable value: validated as given


HOPPER, ADA, AMPERE, BLACKWELL = (9, 0), (8, 9), (8, 0), (12, 0)


def test_auto_layout_epilogue_kernel_and_tile_k_follow_collective_and_device():
    def resolved(collective, capability=HOPPER, **fields):
        cfg, arch = for_device(for_collective(OverlapConfig(**fields), collective), capability)
        return cfg.layout, cfg.epilogue, cfg.kernel, cfg.tile_k, arch

    assert resolved("all_reduce") == ("rows", "tma", "sm90", 64, "sm_90a")
    assert resolved("all_reduce", layout="tiles") == ("tiles", "direct", "sm90", 64, "sm_90a")
    assert resolved("all_reduce", layout="cols") == ("cols", "direct", "sm90", 64, "sm_90a")
    assert resolved("all_reduce", epilogue="direct") == ("rows", "direct", "sm90", 64, "sm_90a")
    assert resolved("reduce_scatter") == ("cols", "direct", "sm90", 64, "sm_90a")
    assert resolved("all_to_all") == ("cols", "direct", "sm90", 64, "sm_90a")
    # Ampere / Ada get the sm80 kernels, which Hopper can be told to use too
    assert resolved("all_reduce", ADA) == ("rows", "direct", "sm80", 32, "sm_89")
    assert resolved("reduce_scatter", AMPERE) == ("cols", "direct", "sm80", 32, "sm_80")
    assert resolved("all_reduce", HOPPER, kernel="sm80") == ("rows", "direct", "sm80", 32, "sm_90")
    # reduce-scatter / all-to-all take row bands too (the fast raster, in-place TMA stores)
    assert resolved("reduce_scatter", layout="rows") == ("rows", "tma", "sm90", 64, "sm_90a")
    # ... and segments: the same rows of every rank's segment per group (TMA stores, rows remapped)
    assert resolved("all_to_all", layout="segments") == ("segments", "tma", "sm90", 64, "sm_90a")
    assert resolved("reduce_scatter", AMPERE, layout="segments") == ("segments", "direct", "sm80", 32, "sm_80")
    with pytest.raises(ValueError, match="reduce_scatter needs layout 'cols', 'rows' or 'segments'.*got .*'tiles'"):
        for_collective(OverlapConfig(layout="tiles"), "reduce_scatter")
    with pytest.raises(ValueError, match="layout 'segments' splits rows into per-rank segments"):
        for_collective(OverlapConfig(layout="segments"), "all_reduce")
    for layout in ("rows", "segments"):
        with pytest.raises(ValueError, match=f"all_to_all in layout '{layout}' rotates or interleaves the persistent"):
            for_collective(OverlapConfig(layout=layout, scheduler="streamk"), "all_to_all")
    assert for_collective(OverlapConfig(scheduler="streamk"), "all_reduce").layout == "rows"  # not rotated
    with pytest.raises(ValueError, match="epilogue 'tma' stores whole rows .* got layout 'cols'"):
        for_collective(OverlapConfig(epilogue="tma"), "all_to_all")
    with pytest.raises(ValueError, match="reduction 'local' is for all_reduce"):
        for_collective(OverlapConfig(reduction="local"), "reduce_scatter")
    with pytest.raises(
        ValueError, match="reduction 'pull' runs all_reduce in layout 'rows', reduce_scatter and all_to"
    ):
        for_collective(OverlapConfig(reduction="pull", layout="rows"), "all_to_all")
    with pytest.raises(ValueError, match="not reduce_scatter in layout 'rows'"):
        for_collective(OverlapConfig(reduction="pull", layout="rows"), "reduce_scatter")
    assert for_collective(OverlapConfig(reduction="pull", layout="segments"), "all_to_all").layout == "segments"
    assert for_collective(OverlapConfig(reduction="pull"), "all_reduce").layout == "rows"
    assert for_collective(OverlapConfig(reduction="pull", layout="segments"), "reduce_scatter").layout == "segments"
    assert [c.layout for c in resolutions(OverlapConfig(reduction="pull"), "reduce_scatter")] == ["segments"]
    with pytest.raises(ValueError, match="the sm90 kernels need a Hopper GPU"):
        for_device(OverlapConfig(kernel="sm90", layout="rows"), ADA)
    with pytest.raises(ValueError, match=r"no flashoverlap kernels for sm_120"):
        for_device(OverlapConfig(layout="rows"), BLACKWELL)
    # valid for one family, not the other: rejected where it would run
    with pytest.raises(ValueError, match=r"cannot run on sm_90a: tile_m 64 not in \(128, 256\)"):
        for_device(OverlapConfig(tile_m=64, layout="rows"), HOPPER)
    with pytest.raises(ValueError, match=r"cannot run on sm_86: scheduler 'streamk' not in"):
        for_device(OverlapConfig(scheduler="streamk", layout="rows"), (8, 6))
    # a late budget is the Hopper kernels': on an Ampere GPU no family takes it
    assert for_device(OverlapConfig(late_budget=True, layout="rows"), HOPPER)[0].kernel == "sm90"
    with pytest.raises(ValueError, match="late_budget is for the Hopper"):
        for_device(OverlapConfig(late_budget=True, layout="rows"), (8, 0))


@pytest.mark.parametrize(
    "data, message",
    [
        ({"tile_m": 96}, r"tile_m 96 not in \(128, 256\)"),
        ({"tile_n": 100}, r"tile_n 100 not in"),
        ({"tile_m": 256, "tile_n": 256}, "exceeds"),
        ({"cluster_m": 4}, r"cluster_m 4 not in \(1, 2\)"),
        ({"comm_sms": -1}, "comm_sms must be >= 0"),
        ({"comm_sms": "8"}, "comm_sms must be an integer"),
        ({"partition": [2, 0]}, "positive integers"),
        ({"partition": []}, "non-empty"),
        ({"layout": "diagonal"}, "layout must be one of"),
        ({"sequential": "yes"}, "sequential must be true or false"),
        ({"symmetric": 1}, "symmetric must be true or false"),
        ({"reduction": "ring"}, "reduction must be one of"),
        ({"reduction": "pull", "layout": "tiles"}, "reduction 'pull' brings its own memory .* got layout 'tiles'"),
        ({"reduction": "pull", "symmetric": True}, "reduction 'pull' .* symmetric True"),
        ({"epilogue": "smem"}, "epilogue must be one of"),
        ({"scheduler": "static"}, r"scheduler 'static' not in"),
        ({"epilogue": "tma", "layout": "tiles"}, "layout 'rows' or 'segments'"),
        ({"kernel": "sm70"}, r"kernel must be one of \['auto', 'sm90', 'sm80'\]"),
        ({"kernel": "sm80", "epilogue": "tma"}, "is a Hopper"),
        ({"tile_m": 64, "epilogue": "tma"}, r"tile_m 64 not in \(128, 256\).*is a Hopper"),  # no family takes both
        ({"kernel": "sm80", "cluster_m": 2}, r"cluster_m 2 not in \(1,\) \(sm80 kernels\)"),
        ({"kernel": "sm90", "tile_k": 32}, r"tile_k 32 not in \(64,\)"),
        ({"tile_k": "32"}, "tile_k must be an integer"),
        ({"swizzle": 3}, r"swizzle must be one of \[1, 2, 4, 8\], got 3"),
        ({"swizzle": 2.0}, "swizzle must be an integer"),
        ({"swizzle": 4, "scheduler": "streamk"}, "swizzle 4 needs scheduler 'persistent'"),
        ({"late_budget": 1}, "late_budget must be true or false"),
        ({"late_budget": True, "scheduler": "streamk"}, "late_budget stops CTAs of the persistent schedule"),
        ({"late_budget": True, "cluster_m": 2}, r"cluster_m 1, got 'persistent' and 2"),
        ({"late_budget": True, "kernel": "sm80"}, "late_budget is for the Hopper"),
    ],
)
def test_invalid_values_are_named(data, message):
    with pytest.raises(ValueError, match=message):
        OverlapConfig.from_dict(data, source="my.yaml")


def test_unknown_keys_name_source_and_allowed_keys():
    with pytest.raises(ValueError, match=r"my.yaml: unknown key\(s\) \['tile'\]; allowed: .*tile_m"):
        OverlapConfig.from_dict({"tile": 128}, source="my.yaml")


def test_yaml_files(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("tile_m: 128\ntile_n: 128\ncomm_sms: 4\npartition: [1, 3, 1]\nlayout: tiles\n")
    assert resolve(str(good)) == OverlapConfig(tile_n=128, comm_sms=4, partition=(1, 3, 1), layout="tiles")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert resolve(empty) == OverlapConfig()
    bad = tmp_path / "bad.yaml"
    bad.write_text("tile_m: [128\n")
    with pytest.raises(ValueError, match="bad.yaml: malformed YAML"):
        resolve(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="wrong.yaml: expected a mapping"):
        resolve(wrong)
    with pytest.raises(FileNotFoundError, match="config file not found"):
        resolve(tmp_path / "missing.yaml")
    with pytest.raises(TypeError, match="config must be"):
        resolve(42)


def test_shipped_single_configs_resolve():
    from flashoverlap.registry import SHIPPED as configs

    assert resolve(configs / "example.yaml") == OverlapConfig()
    consumer = resolve(configs / "consumer_pcie.yaml")
    cfg, arch = for_device(for_collective(consumer, "all_reduce"), ADA)
    assert (cfg.kernel, cfg.tile_k, cfg.epilogue, arch) == ("sm80", 32, "direct", "sm_89")
