import pytest

from flashoverlap.config import OverlapConfig, for_collective, resolve


def test_defaults_are_valid_and_mappings_resolve():
    assert resolve(None) == OverlapConfig()
    cfg = resolve({"tile_n": 128, "partition": [1, 2, 1], "comm_sms": 16})
    assert cfg.tile_n == 128 and cfg.partition == (1, 2, 1) and cfg.comm_sms == 16
    assert resolve(cfg) is cfg


def test_auto_layout_and_epilogue_follow_the_collective():
    def resolved(collective, **fields):
        cfg = for_collective(OverlapConfig(**fields), collective)
        return cfg.layout, cfg.epilogue

    assert resolved("all_reduce") == ("rows", "tma")
    assert resolved("all_reduce", layout="tiles") == ("tiles", "direct")
    assert resolved("all_reduce", layout="cols") == ("cols", "direct")
    assert resolved("all_reduce", epilogue="direct") == ("rows", "direct")
    assert resolved("reduce_scatter") == ("cols", "direct")
    assert resolved("all_to_all") == ("cols", "direct")
    with pytest.raises(ValueError, match="reduce_scatter needs layout 'cols'.*got layout 'rows'"):
        for_collective(OverlapConfig(layout="rows"), "reduce_scatter")
    with pytest.raises(ValueError, match="epilogue 'tma' .* needs layout 'rows', got layout 'cols'"):
        for_collective(OverlapConfig(epilogue="tma"), "all_to_all")


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
        ({"epilogue": "smem"}, "epilogue must be one of"),
        ({"scheduler": "static"}, r"scheduler 'static' not in"),
        ({"epilogue": "tma", "layout": "tiles"}, "needs layout 'rows'"),
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


def test_shipped_example_is_the_default():
    from pathlib import Path

    assert resolve(Path(__file__).parent.parent / "configs" / "example.yaml") == OverlapConfig()
