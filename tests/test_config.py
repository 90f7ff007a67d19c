import dataclasses
import os

import pytest

from flashoverlap.config import OverlapConfig, resolve
from flashoverlap.rules import for_collective, for_device


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


ADA = (8, 9)


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


def test_fp8_calls_take_fp8_tiles_where_their_config_names_none(tmp_path):
    """A call with FP8 operands starts from FP8's tiles (config.FP8_TILES) where its mapping or YAML
    file names neither tile; an OverlapConfig, or a config naming a tile, is taken as it is."""
    assert resolve(None, fp8=True) == OverlapConfig(tile_m=256, tile_n=128)
    assert resolve({"comm_sms": 8}, fp8=True) == OverlapConfig(tile_m=256, tile_n=128, comm_sms=8)
    assert resolve({"comm_sms": 8}) == OverlapConfig(comm_sms=8)  # (the cache keeps them apart)
    assert resolve({"tile_n": 128}, fp8=True) == OverlapConfig(tile_n=128)
    assert resolve(OverlapConfig(comm_sms=8), fp8=True) == OverlapConfig(comm_sms=8)
    path = tmp_path / "c.yaml"
    path.write_text("comm_sms: 4\n")
    assert resolve(path, fp8=True) == OverlapConfig(tile_m=256, tile_n=128, comm_sms=4)
    assert resolve(path) == OverlapConfig(comm_sms=4)


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


def test_equal_configs_hash_alike_however_made():
    """A config's hash is made once (every call with config= hashes it): equal configs must still
    hash alike when replaced, copied, or unpickled in another process, whose strings hash
    differently (a hash carried over from the pickling process would miss there)."""
    import copy
    import pickle
    import subprocess
    import sys

    cfg = OverlapConfig(tile_m=64, partition=[1, 2], layout="rows", reduction="pull")
    assert hash(cfg) == hash(OverlapConfig(tile_m=64, partition=(1, 2), layout="rows", reduction="pull"))
    assert hash(dataclasses.replace(cfg, comm_sms=4)) == hash(dataclasses.replace(copy.deepcopy(cfg), comm_sms=4))
    assert hash(dataclasses.replace(cfg, comm_sms=4)) != hash(cfg)
    check = (
        "import pickle, sys; from flashoverlap.config import OverlapConfig; "
        "got = pickle.loads(sys.stdin.buffer.read()); "
        "fresh = OverlapConfig(tile_m=64, partition=(1, 2), layout='rows', reduction='pull'); "
        "assert got == fresh and hash(got) == hash(fresh) and {fresh: 1}[got] == 1"
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-c", check], input=pickle.dumps(cfg), env=env, check=True, timeout=120)
