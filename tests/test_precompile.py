"""Ahead-of-time kernel builds: items, files, the registry, and the kernels they name (CPU)."""

import re
import shutil

import pytest

from flashoverlap import precompile


def listed(capsys, *argv):
    assert precompile.main([*argv, "--list"]) == 0
    return capsys.readouterr().out.split()


def test_items_name_the_kernels_the_runtime_would_build(capsys):
    assert listed(capsys, "--gpu-arch", "sm_90") == ["fo_gemm_bfloat16_nk_128x256x64_c1x1_persistent_tma_sm_90a"]
    names = listed(
        capsys,
        "--gpu-arch",
        "sm_90",
        '{"collective": "reduce_scatter", "dtype": "float16", "weight_layout": "kn"}',
        '{"kernel": "sm80", "tile_n": 128}',
        '{"tile_n": 256}',  # the default again: built once
        '{"sequential": true}',  # nothing to build
    )
    assert names == [  # an auto layout of a reduce-scatter: segments or cols, by call (rules.for_call)
        "fo_gemm_float16_kn_128x256x64_c1x1_persistent_tma_sm_90a",
        "fo_gemm_float16_kn_128x256x64_c1x1_persistent_direct_sm_90a",
        "fo_gemm_bfloat16_nk_128x128x32_c1x1_persistent_direct_sm_90",
        "fo_gemm_bfloat16_nk_128x256x64_c1x1_persistent_tma_sm_90a",
    ]
    # a consumer GPU gets the Ampere/Ada family
    assert listed(capsys, "--gpu-arch", "sm_89", '{"tile_m": 64}') == [
        "fo_gemm_bfloat16_nk_64x256x32_c1x1_persistent_direct_sm_89"
    ]


def test_fp8_items_name_the_hopper_fp8_kernels(capsys):
    assert listed(capsys, "--gpu-arch", "sm_90", '{"input_dtype": "float8_e4m3fn"}', '{"input_dtype": "bfloat16"}') == [
        "fo_gemm_float8_e4m3fn_bfloat16_nk_256x128x128_c1x1_persistent_tma_sm_90a",  # FP8's tiles, its own K tile
        "fo_gemm_bfloat16_nk_128x256x64_c1x1_persistent_tma_sm_90a",
    ]
    fast = '{"input_dtype": "float8_e4m3fn", "fast_accum": true}'
    assert listed(capsys, "--gpu-arch", "sm_90", fast, '{"input_dtype": "float8_e4m3fn", "tile_n": 256}') == [
        "fo_gemm_float8_e4m3fn_bfloat16_nk_256x128x128_c1x1_persistent_tma_fastaccum_sm_90a",
        "fo_gemm_float8_e4m3fn_bfloat16_nk_128x256x128_c1x1_persistent_tma_sm_90a",  # a tile named: as given
    ]
    assert listed(capsys, "--gpu-arch", "sm_89", '{"input_dtype": "float8_e5m2", "fast_accum": true}') == [
        "fo_gemm_float8_e5m2_bfloat16_nk_256x128x64_c1x1_persistent_direct_sm_89"  # (Ada: no fast mode)
    ]
    with pytest.raises(SystemExit):
        precompile.main(["--gpu-arch", "sm_86", '{"input_dtype": "float8_e5m2"}', "--list"])
    assert "FP8 needs FP8 tensor cores" in capsys.readouterr().err


def test_files_and_the_registry_add_items(tmp_path, capsys):
    path = tmp_path / "k.yaml"
    path.write_text("- {tile_n: 128}\n- {collective: all_to_all}\n")
    assert listed(capsys, "--gpu-arch", "sm_90", "--file", str(path)) == [
        "fo_gemm_bfloat16_nk_128x128x64_c1x1_persistent_tma_sm_90a",
        "fo_gemm_bfloat16_nk_128x256x64_c1x1_persistent_tma_sm_90a",
        "fo_gemm_bfloat16_nk_128x256x64_c1x1_persistent_direct_sm_90a",
    ]
    # every overlapped entry of the shipped registry, for the arch asked for
    names = listed(capsys, "--gpu-arch", "sm_86", "--registry")
    assert names and all(n.endswith("_sm_86") for n in names)


def test_fp8_registry_entries_build_fp8_kernels(tmp_path, monkeypatch, capsys):
    """An FP8 entry is keyed by its operands' dtype: its kernel reads FP8 and writes bf16."""
    from flashoverlap import registry

    (tmp_path / "h100_x2.yaml").write_text(
        "gpu: NVIDIA H100\nworld: 2\nentries:\n- {collective: all_reduce, transport: nvlink, dtype: float8_e4m3fn,"
        " shape: [4096, 8192, 8192], config: {tile_n: 128}}\n"
    )
    monkeypatch.setenv("FLASHOVERLAP_CONFIG_DIRS", str(tmp_path))
    registry.reload()
    try:
        names = listed(capsys, "--gpu-arch", "sm_90", "--registry")
    finally:
        monkeypatch.delenv("FLASHOVERLAP_CONFIG_DIRS")
        registry.reload()
    assert "fo_gemm_float8_e4m3fn_bfloat16_nk_128x128x128_c1x1_persistent_tma_sm_90a" in names


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpu-arch", "sm_90", '{"tile_m": 96}'], r"\{\"tile_m\": 96\}: .*tile_m 96 not in"),
        (["--gpu-arch", "sm_90", '{"dtype": "fp8"}'], "dtype must be one of"),
        (["--gpu-arch", "sm_90", '{"weight_layout": "t"}'], "weight_layout must be one of"),
        (["--gpu-arch", "sm_90", '{"input_dtype": "fp8"}'], "input_dtype must be one of"),
        (["--gpu-arch", "sm_90", '{"input_dtype": "float8_e4m3fn", "fast_accum": 1}'], "fast_accum must be true or"),
        (["--gpu-arch", "sm_90", '{"fast_accum": true}'], "fast_accum is for FP8 inputs"),
        (["--gpu-arch", "sm_90", '{"input_dtype": "float8_e4m3fn", "weight_layout": "kn"}'], "weight_layout 'nk'"),
        # a misspelt collective would build another collective's kernels (its auto layout)
        (["--gpu-arch", "sm_90", '{"collective": "allreduce"}'], "collective must be one of .*'allreduce'"),
        (["--gpu-arch", "sm_90", '{"collective": "broadcast"}'], "collective must be one of .*'broadcast'"),
        (
            ["--gpu-arch", "sm_90", '{"collective": "all_reduce", "layout": "cols", "epilogue": "tma"}'],
            "layout 'rows' or 'segments'",
        ),
        (["--gpu-arch", "sm_90", "[1]"], "expected a JSON object"),
        (["--gpu-arch", "sm_75"], "invalid choice"),
        (["--gpu-arch", "sm_90", "--jobs", "0"], "--jobs must be >= 1"),
        (["--gpu-arch", "sm_90", "--file", "missing.yaml"], "missing.yaml"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        precompile.main([*argv, "--list"])
    assert re.search(message, capsys.readouterr().err)


def test_configs_a_gpu_has_no_kernel_for_fail_or_are_skipped(capsys):
    hopper_only = '{"cluster_m": 2}'
    with pytest.raises(SystemExit):
        precompile.main(["--gpu-arch", "sm_89", hopper_only, "--list"])
    err = capsys.readouterr().err
    assert "cannot run on sm_89" in err and "--skip-unsupported skips" in err
    assert listed(capsys, "--gpu-arch", "sm_89", "--skip-unsupported", hopper_only, "{}") == [
        "fo_gemm_bfloat16_nk_128x256x32_c1x1_persistent_direct_sm_89"
    ]


def test_malformed_item_files_are_named(tmp_path, capsys):
    for text in ("- {tile_n: [\n", "tile_n: 128\n"):
        path = tmp_path / "k.yaml"
        path.write_text(text)
        with pytest.raises(SystemExit):
            precompile.main(["--gpu-arch", "sm_90", "--file", str(path), "--list"])
        assert str(path) in capsys.readouterr().err


def test_without_a_gpu_the_arch_must_be_given(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        precompile.main(["--list"])
    assert "pass --gpu-arch" in capsys.readouterr().err


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_builds_into_the_cache_the_runtime_reads(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FLASHOVERLAP_CACHE_DIR", str(tmp_path))
    assert precompile.main(["--gpu-arch", "sm_86", '{"tile_m": 64, "tile_n": 64}']) == 0
    built = sorted(p.name.split("-")[0] for p in tmp_path.glob("*.so"))
    assert built == ["fo_gemm_bfloat16_nk_64x64x32_c1x1_persistent_direct_sm_86", "fo_runtime"]
    assert any(m.startswith("compiling kernel 1 of 1, fo_gemm_bfloat16_nk_64x64x32") for m in caplog.messages)
    assert any(m.startswith("1 of 1 kernels ready: fo_gemm_bfloat16_nk_64x64x32") for m in caplog.messages)
