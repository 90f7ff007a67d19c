import dataclasses
import re
import shutil
import subprocess

import pytest

from flashoverlap import jit
from flashoverlap.gemm import GemmSpec, generate


def test_source_names_the_instance():
    src = generate(GemmSpec(dtype="float16", weight_layout="kn", tile_m=256, tile_n=128, cluster_m=2))
    assert "using Element = cutlass::half_t;" in src
    assert "using LayoutB = cutlass::layout::RowMajor;" in src
    assert "Shape<_256, _128, _64>" in src and "Shape<_2, _1, _1>" in src
    assert "KernelTmaWarpSpecializedCooperative" in src and '#include "launcher.cuh"' in src
    assert "TmaSignalEpilogue<EpilogueBase, false>" in src
    assert "SignalEpilogue<" not in src.replace("TmaSignalEpilogue<", "")
    direct = generate(GemmSpec(epilogue="direct"))
    assert "flashoverlap::SignalEpilogue<Element" in direct and "TmaSignalEpilogue" not in direct


def test_spec_rejects_what_it_cannot_generate():
    with pytest.raises(ValueError, match=r"tile_n 96 not in .*dtype 'float32'"):
        GemmSpec(dtype="float32", tile_n=96)
    with pytest.raises(ValueError, match="weight_layout"):
        GemmSpec(weight_layout="t")
    with pytest.raises(ValueError, match="epilogue 'smem' not in"):
        GemmSpec(epilogue="smem")
    with pytest.raises(ValueError, match=r"arch 'sm_75' not in \['sm_90a', 'sm_80'"):
        GemmSpec(arch="sm_75")
    # the Ampere/Ada family: its own tiles, no clusters, stream-K or TMA epilogue
    assert GemmSpec(tile_m=64, tile_k=32, epilogue="direct", arch="sm_86").family == "sm80"
    with pytest.raises(ValueError, match=r"tile_k 64 not in \(32,\) \(sm80 kernels\).*epilogue 'tma'"):
        GemmSpec(arch="sm_89")
    with pytest.raises(ValueError, match=r"cluster_m 2 not in \(1,\).*scheduler 'streamk'"):
        GemmSpec(tile_k=32, cluster_m=2, scheduler="streamk", epilogue="direct", arch="sm_80")


FP8 = GemmSpec(input_dtype="float8_e4m3fn", tile_k=128)


def test_16_bit_instances_keep_their_names():
    """Caches, precompile lists and bench/kernels.yaml name 16-bit kernels as before FP8."""
    assert GemmSpec().name == "fo_gemm_bfloat16_nk_128x256x64_c1x1_persistent_tma_sm_90a"
    assert GemmSpec(dtype="float16", input_dtype="float16") == GemmSpec(dtype="float16")
    assert GemmSpec(dtype="float16").name == "fo_gemm_float16_nk_128x256x64_c1x1_persistent_tma_sm_90a"
    assert FP8.name == "fo_gemm_float8_e4m3fn_bfloat16_nk_128x256x128_c1x1_persistent_tma_sm_90a"


def test_fp8_source_reads_fp8_operands_and_writes_the_output_dtype():
    src = generate(FP8)
    assert "using ElementIn = cutlass::float_e4m3_t;" in src and "using Element = cutlass::bfloat16_t;" in src
    assert "Shape<_128, _256, _128>" in src
    assert "constexpr int kAlignmentIn = 16;" in src and "constexpr int kAlignment = 8;" in src  # 16 bytes each
    assert "ElementIn, LayoutA, kAlignmentIn" in src and "ElementIn, LayoutB, kAlignmentIn" in src
    # the accurate FP8 mainloop (not FP8FastAccum), its promotion ours
    assert "KernelTmaWarpSpecializedCooperative>" in src
    assert "using CollectiveMainloop = flashoverlap::Fp8AtomPromotion<MainloopBase>;" in src
    assert '#include "fp8_promotion.cuh"' in src
    e5m2 = generate(GemmSpec(dtype="float16", input_dtype="float8_e5m2", tile_k=128, epilogue="direct"))
    assert "using ElementIn = cutlass::float_e5m2_t;" in e5m2 and "using Element = cutlass::half_t;" in e5m2
    assert "kAlignmentIn = 8;" in generate(GemmSpec())


def test_fast_accumulation_is_an_fp8_mainloop_of_its_own():
    fast = dataclasses.replace(FP8, fast_accum=True)
    assert fast.name == "fo_gemm_float8_e4m3fn_bfloat16_nk_128x256x128_c1x1_persistent_tma_fastaccum_sm_90a"
    assert "KernelTmaWarpSpecializedCooperativeFP8FastAccum>" in generate(fast)
    assert "Fp8AtomPromotion" not in generate(fast) and "Fp8AtomPromotion" not in generate(GemmSpec())
    with pytest.raises(ValueError, match="fast_accum is for FP8 inputs"):
        GemmSpec(fast_accum=True)


def test_fused_sums_are_epilogues_of_their_own():
    """A reduce-scatter's sums in the epilogue (reduction pull_fused) get kernels of their own: the
    plain kernels keep their code (and registers) whatever the sums need. Hopper's only."""
    sums = GemmSpec(epilogue="direct", sums=True)
    assert sums.name == "fo_gemm_bfloat16_nk_128x256x64_c1x1_persistent_direct_sums_sm_90a"
    assert "SignalEpilogue<Element, TileShape, 256, true>" in generate(sums)
    assert "SignalEpilogue<Element, TileShape, 256, false>" in generate(GemmSpec(epilogue="direct"))
    assert GemmSpec(sums=True).name == "fo_gemm_bfloat16_nk_128x256x64_c1x1_persistent_tma_sums_sm_90a"
    assert "TmaSignalEpilogue<EpilogueBase, true>" in generate(GemmSpec(sums=True))
    assert "TmaSignalEpilogue<EpilogueBase, false>" in generate(GemmSpec())
    with pytest.raises(ValueError, match=r"sums \(a reduce-scatter's, in the epilogue\) are the sm90"):
        GemmSpec(tile_k=32, epilogue="direct", arch="sm_80", sums=True)


ADA_FP8 = GemmSpec(input_dtype="float8_e4m3fn", tile_n=128, tile_k=64, epilogue="direct", arch="sm_89")


def test_ada_fp8_source_takes_the_fp8_mma_and_leaves_16_bit_sources_alone():
    src = generate(ADA_FP8)
    assert "cutlass::arch::Sm89" in src and "GemmShape<16, 8, 32>" in src and "GemmShape<128, 128, 64>" in src
    assert "GemmShape<64, 32, 64>" in src  # (64x64 warps of 8-bit operands spill)
    wide = generate(GemmSpec(input_dtype="float8_e4m3fn", tile_k=64, epilogue="direct", arch="sm_89"))
    assert "GemmShape<64, 64, 64>" in wide  # (128x256 in 64x32 warps: twice the register file)
    assert "using ElementIn = cutlass::float_e4m3_t;" in src and "ElementIn, LayoutB, kAlignmentIn" in src
    assert "constexpr int kAlignmentIn = 16;" in src and "LinearCombination<Element, kAlignment" in src
    bf16 = generate(GemmSpec(tile_k=32, epilogue="direct", arch="sm_89"))  # (the kernel cache keys on it)
    assert "ElementIn" not in bf16 and "cutlass::arch::Sm80" in bf16 and "GemmShape<16, 8, 16>" in bf16


def test_fp8_spec_rejects_what_its_kernels_cannot_do():
    with pytest.raises(ValueError, match=r"FP8 needs FP8 tensor cores \(sm_89, sm_90, sm_90a\), not sm_86"):
        GemmSpec(input_dtype="float8_e4m3fn", tile_k=64, epilogue="direct", arch="sm_86")
    with pytest.raises(ValueError, match=r"tile_k 32 not in \(64,\) \(sm80 kernels\)"):
        GemmSpec(input_dtype="float8_e4m3fn", tile_k=32, epilogue="direct", arch="sm_89")
    with pytest.raises(ValueError, match="fast_accum is for FP8 inputs on the sm90 kernels"):
        GemmSpec(input_dtype="float8_e4m3fn", tile_k=64, epilogue="direct", arch="sm_89", fast_accum=True)
    with pytest.raises(ValueError, match=r"tile_k 64 not in \(128,\).*weight_layout 'nk'.*got 'kn'"):
        GemmSpec(input_dtype="float8_e4m3fn", weight_layout="kn")
    with pytest.raises(ValueError, match=r"input_dtype 'int8' not in"):
        GemmSpec(input_dtype="int8")
    with pytest.raises(ValueError, match="16-bit inputs give their own dtype"):
        GemmSpec(input_dtype="float16")
    with pytest.raises(ValueError, match=r"tile_k 128 not in \(64,\)"):  # 16-bit kernels keep their K tile
        GemmSpec(tile_k=128)


def test_sm80_source_uses_cutlass_2x_and_fits_consumer_shared_memory():
    src = generate(GemmSpec(tile_k=32, epilogue="direct", arch="sm_86"))
    assert "cutlass::gemm::kernel::DefaultGemm<" in src and '#include "sm80_signal_gemm.cuh"' in src
    assert "GemmShape<128, 256, 32>" in src and "GemmShape<64, 64, 32>" in src
    stages = int(re.search(r"(\d+), false, cutlass::arch::OpMultiplyAdd", src).group(1))
    assert stages * (128 + 256) * 32 * 2 <= 99 * 1024  # RTX 3090/4090: 99 KB per block


def test_cache_key_changes_with_the_source(tmp_path, monkeypatch):
    """A rebuilt template must never load a stale library: the key covers the source."""
    monkeypatch.setenv("FLASHOVERLAP_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(jit, "nvcc_version", lambda: "test")
    monkeypatch.setattr(jit, "toolkit", lambda: jit.Toolkit("nvcc", "test"))
    monkeypatch.setattr(jit, "_compile", lambda cmd, what: calls.append(cmd) or _touch(cmd[-1]))
    first = jit.build("x", "int a;")
    assert jit.build("x", "int a;") == first and len(calls) == 1  # cached
    assert jit.build("x", "int b;") != first and len(calls) == 2


def test_cache_key_covers_exactly_the_headers_a_source_includes(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "a.cuh").write_text('#include "b.cuh"\n')
    (csrc / "b.cuh").write_text("int b;\n")
    (csrc / "c.cuh").write_text("int c;\n")
    monkeypatch.setattr(jit, "_PACKAGE_DIR", tmp_path)
    uses_a = '#include "a.cuh"\n#include "cutlass/cutlass.h"\n'
    before = jit._own_headers_digest(uses_a)
    (csrc / "c.cuh").write_text("int c2;\n")  # not included: same key
    assert jit._own_headers_digest(uses_a) == before
    (csrc / "b.cuh").write_text("int b2;\n")  # included through a.cuh: new key
    assert jit._own_headers_digest(uses_a) != before


def _touch(path):
    open(path, "w").close()

    class Done:
        returncode = 0

    return Done()


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


@pytest.mark.nvcc
@needs_nvcc
@pytest.mark.parametrize(
    "spec",
    [
        GemmSpec(),
        GemmSpec(dtype="float16", weight_layout="kn", tile_m=256, tile_n=128, cluster_m=2, epilogue="direct"),
        GemmSpec(epilogue="direct", sums=True),
        GemmSpec(sums=True),
    ],
    ids=["tma", "direct", "direct-sums", "tma-sums"],
)
def test_generated_source_compiles_for_sm90a(spec, tmp_path):
    obj = jit.build(spec.name, generate(spec), arch=spec.arch, cutlass=True, object_only=True, output=tmp_path / "k.o")
    assert obj.stat().st_size > 0


FP8_DEFAULT = dataclasses.replace(FP8, tile_m=256, tile_n=128)


@pytest.mark.nvcc
@needs_nvcc
@pytest.mark.parametrize(
    "spec", [FP8_DEFAULT, dataclasses.replace(FP8_DEFAULT, epilogue="direct")], ids=["256x128-tma", "256x128-direct"]
)
def test_promoted_fp8_source_compiles_for_sm90a(spec, tmp_path):
    """The promoted FP8 mainloop under each signal epilogue, alpha read from the device (~1 min each).
    Its scratch accumulators hold one 64-row atom per warp group: the 256 x 128 tiles FP8 calls
    default to spill no register (ptxas; CUTLASS's own FP8 mainloop spills ~1 KB per thread there)."""
    includes = [jit._PACKAGE_DIR / "csrc", *jit.cutlass_include_dirs()]
    source = tmp_path / "k.cu"
    source.write_text(generate(spec))
    flags = [*jit.BASE_FLAGS, *jit.ARCH_FLAGS[spec.arch], *[f"-I{d}" for d in includes], "-Xptxas", "-v"]
    done = subprocess.run(
        [*jit.toolkit().command(), *flags, "-c", "-o", str(tmp_path / "k.o"), str(source)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    spilled = [int(v) for v in re.findall(r"(\d+) bytes spill stores", done.stderr)]
    assert spilled and not any(spilled), spilled


@pytest.mark.nvcc
@needs_nvcc
@pytest.mark.parametrize(
    "spec",
    [GemmSpec(tile_k=32, epilogue="direct", arch=arch) for arch in ("sm_80", "sm_86", "sm_89", "sm_90")]
    + [GemmSpec(dtype="float16", weight_layout="kn", tile_n=128, tile_k=32, epilogue="direct", arch="sm_86")],
    ids=lambda s: s.name,
)
def test_sm80_family_compiles(spec, tmp_path):
    obj = jit.build(spec.name, generate(spec), arch=spec.arch, cutlass=True, object_only=True, output=tmp_path / "k.o")
    assert obj.stat().st_size > 0


@pytest.mark.nvcc
@needs_nvcc
def test_ada_fp8_source_compiles_for_sm89_without_spills(tmp_path):
    """Ada's FP8 mma.sync under the sm80 family's persistent loop and signal epilogue (RTX 4090, L40),
    in 64x32 warps: with 64x64 ones the 128x128 tile spilled (its speed forced on Hopper: 0.07 of
    cuBLAS). jit.build's flags, with ptxas saying what each kernel uses."""
    import subprocess

    spec = ADA_FP8
    assert "GemmShape<64, 32, 64>" in generate(spec)
    src, obj = tmp_path / "k.cu", tmp_path / "k.o"
    src.write_text(generate(spec))
    includes = [f"-I{d}" for d in (str(jit._PACKAGE_DIR / "csrc"), *jit.cutlass_include_dirs())]
    flags = [*jit.BASE_FLAGS, *jit.ARCH_FLAGS[spec.arch], *includes, "-Xptxas", "-v", "-c"]
    proc = subprocess.run([*jit.toolkit().command(), *flags, str(src), "-o", str(obj)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert obj.stat().st_size > 0
    spills = [line for line in proc.stderr.splitlines() if "spill stores" in line]
    assert spills and all(" 0 bytes spill stores" in line for line in spills), spills


@pytest.mark.nvcc
@needs_nvcc
def test_sm80_family_rejects_shared_memory_a_consumer_gpu_lacks(tmp_path):
    spec = GemmSpec(tile_k=32, epilogue="direct", arch="sm_89")
    src, stages = re.subn(r"\d+(, false, cutlass::arch::OpMultiplyAdd)", r"5\1", generate(spec))
    assert stages == 1  # 5 stages of 128x256x32 bf16: 120 KB > 99 KB
    with pytest.raises(RuntimeError, match="exceed sm_86/sm_89 shared memory"):
        jit.build(spec.name, src, arch=spec.arch, cutlass=True, object_only=True, output=tmp_path / "k.o")


@pytest.mark.nvcc
@needs_nvcc
def test_runtime_kernels_compile(tmp_path):
    obj = jit.build_runtime(object_only=True, output=tmp_path / "rt.o")
    # a fat binary with code for every supported GPU, not Hopper's alone (the embedded cubins name their arch)
    assert set(re.findall(rb"sm_\d\d", obj.read_bytes())) >= {b"sm_80", b"sm_86", b"sm_89", b"sm_90"}
