import pytest

from flashoverlap.config import OverlapConfig, epilogue_of, resolve


def test_defaults_are_valid_and_mappings_resolve():
    assert resolve(None) == OverlapConfig()
    cfg = resolve({"tile_n": 128, "partition": [1, 2, 1], "comm_sms": 16})
    assert cfg.tile_n == 128 and cfg.partition == (1, 2, 1) and cfg.comm_sms == 16
    assert resolve(cfg) is cfg


def test_epilogue_auto_follows_the_layout():
    assert epilogue_of(OverlapConfig()) == "tma"
    assert epilogue_of(OverlapConfig(layout="tiles")) == "direct"
    assert epilogue_of(OverlapConfig(epilogue="direct")) == "direct"


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
        ({"layout": "cols"}, "layout must be one of"),
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
