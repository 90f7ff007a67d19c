"""One GPU: the signal GEMM writes every tile into its slot and signals each group exactly."""

import dataclasses
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from flashoverlap import OverlapConfig, comm, decision, enqueue, jit, runtime, signal, state
from flashoverlap.comm import restore
from flashoverlap.config import resolve
from flashoverlap.inputs import Fp8, Scales, check_scales
from flashoverlap.prepared import prepare
from flashoverlap.rules import alternative, for_collective, pulled
from flashoverlap.runtime import run_overlapped

from .helpers import ENTRY_POINTS, no_host_sync, rel_err, runs_on_this_gpu

pytestmark = pytest.mark.gpu

SHAPES = [(4096, 4096, 4096), (1000, 1032, 200), (333, 520, 264), (129, 8, 8), (2500, 3000, 1560)]
CONFIGS = [
    ("bfloat16", "nk", OverlapConfig()),
    ("bfloat16", "nk", OverlapConfig(epilogue="direct")),
    ("bfloat16", "nk", OverlapConfig(layout="cols")),
    ("bfloat16", "nk", OverlapConfig(layout="cols", scheduler="streamk", comm_sms=12)),
    ("bfloat16", "nk", OverlapConfig(layout="cols", tile_m=256, tile_n=128)),
    ("bfloat16", "nk", OverlapConfig(layout="tiles")),
    ("bfloat16", "nk", OverlapConfig(cluster_m=2, comm_sms=0)),
    ("bfloat16", "nk", OverlapConfig(scheduler="streamk", comm_sms=12)),
    ("bfloat16", "nk", OverlapConfig(scheduler="streamk", layout="tiles")),
    ("bfloat16", "nk", OverlapConfig(tile_m=256, tile_n=128, layout="tiles")),
    ("bfloat16", "nk", OverlapConfig(tile_n=128, comm_sms=20)),
    # late SM budgets: CTAs stop after the first waves (their tiles taken by the rest)
    ("bfloat16", "nk", OverlapConfig(late_budget=True)),
    ("bfloat16", "nk", OverlapConfig(late_budget=True, comm_sms=40, swizzle=4, layout="cols")),
    ("bfloat16", "kn", OverlapConfig()),
    ("float16", "nk", OverlapConfig(layout="tiles")),
    ("float16", "nk", OverlapConfig()),
    # swizzled rasters (padding included)
    ("bfloat16", "nk", OverlapConfig(swizzle=4)),
    ("bfloat16", "nk", OverlapConfig(layout="cols", swizzle=8)),
    ("bfloat16", "nk", OverlapConfig(cluster_m=2, swizzle=2, comm_sms=0)),
    ("bfloat16", "nk", OverlapConfig(kernel="sm80", swizzle=2, layout="tiles")),
    # the Ampere/Ada family, forced on Hopper
    ("bfloat16", "nk", OverlapConfig(kernel="sm80")),
    ("bfloat16", "nk", OverlapConfig(kernel="sm80", layout="cols", tile_n=128)),
    ("float16", "kn", OverlapConfig(kernel="sm80", tile_n=128, layout="tiles")),
]


def operands(m, n, k, dtype, weight_layout, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    w = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
    ref = a.float() @ w.float().t()
    return a, (w if weight_layout == "nk" else w.t().contiguous()), ref


@pytest.mark.parametrize("dtype, weight_layout, cfg", CONFIGS, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_signal_gemm_slots_and_counters(shape, dtype, weight_layout, cfg):
    if not runs_on_this_gpu(cfg):
        pytest.skip(f"no kernel for {cfg} on this GPU")
    m, n, k = shape
    torch_dtype = getattr(torch, dtype)
    a, w, ref = operands(m, n, k, torch_dtype, weight_layout)
    prep = prepare(m, n, k, torch_dtype, weight_layout, a.device, for_collective(cfg, "all_reduce"))
    plan = prep.plan
    buffer = torch.full((plan.numel,), float("nan"), dtype=torch_dtype, device="cuda")  # poison
    stream = torch.cuda.current_stream()
    prep.launch(a, w, buffer, stream)
    torch.cuda.synchronize()
    assert prep.counters.tolist() == list(prep.targets)
    prep.counters.zero_()
    out = buffer.view(m, n) if plan.in_place else torch.full((m, n), float("nan"), dtype=torch_dtype, device="cuda")
    if not plan.in_place:
        restore(buffer, out, plan, prep.slots)
    assert not torch.isnan(out).any(), "unwritten output elements"
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize(
    "cfg",
    [
        OverlapConfig(),
        OverlapConfig(epilogue="direct", tile_n=128),
        OverlapConfig(cluster_m=2, swizzle=2, comm_sms=0),
        OverlapConfig(kernel="sm80"),
    ],
    ids=str,
)
def test_rotated_schedules_compute_every_tile_in_place(cfg):
    """The rows layout of reduce-scatter / all-to-all starts each rank's schedule at another tile row
    (comm.rows_rotation): operands and stores must both follow the rotated tile."""
    if not runs_on_this_gpu(cfg):
        pytest.skip(f"no kernel for {cfg} on this GPU")
    cfg = for_collective(dataclasses.replace(cfg, layout="rows"), "reduce_scatter")
    m, n, k = 3 * 1024, 1032, 520
    a, w, ref = operands(m, n, k, torch.bfloat16, "nk")
    for start in (1024, 2048):
        prep = prepare(m, n, k, torch.bfloat16, "nk", a.device, cfg, rotate=start)
        assert prep.plan.rotate * prep.plan.tile_m == start
        assert rel_err(launched_alone(prep, a, w).view(m, n), ref) < 1e-2


def launched_alone(prep, a, w) -> torch.Tensor:
    """The signal GEMM of ``prep`` alone into a poisoned buffer; every counter reached, reset after."""
    buffer = torch.full((prep.plan.numel,), float("nan"), dtype=a.dtype, device="cuda")
    prep.launch(a, w, buffer, torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert prep.counters.tolist() == list(prep.targets)
    prep.counters.zero_()
    assert not torch.isnan(buffer).any(), "unwritten output elements"
    return buffer


@pytest.mark.parametrize(
    "cfg",
    [
        OverlapConfig(),
        OverlapConfig(cluster_m=2, swizzle=2, comm_sms=0),
        OverlapConfig(tile_n=128, epilogue="direct"),
        OverlapConfig(kernel="sm80"),
    ],
    ids=str,
)
@pytest.mark.parametrize("segments", [2, 3])
def test_interleaved_schedules_store_every_tile_at_its_slot(cfg, segments):
    """The segments layout walks the ranks' segments interleaved and stores each group segment
    after segment (plan.make_plan(interleave=...)): operands follow the walked tile, stores the
    tile's slot (the TMA epilogue remaps its row)."""
    if not runs_on_this_gpu(cfg):
        pytest.skip(f"no kernel for {cfg} on this GPU")
    cfg = for_collective(dataclasses.replace(cfg, layout="segments"), "reduce_scatter")
    m, n, k = segments * 2048, 2056, 520
    a, w, ref = operands(m, n, k, torch.bfloat16, "nk")
    prep = prepare(m, n, k, torch.bfloat16, "nk", a.device, cfg, interleave=segments)
    plan = prep.plan
    assert plan.interleave == segments and plan.num_groups > 1
    index = torch.from_numpy(plan.buffer_index()).to(a.device)
    assert rel_err(launched_alone(prep, a, w)[index].view(m, n), ref) < 1e-2


@pytest.mark.parametrize(
    "cfg", [OverlapConfig(), OverlapConfig(epilogue="direct"), OverlapConfig(kernel="sm80")], ids=str
)
def test_alpha_from_the_device_scales_the_product(cfg):
    """fo_run's alpha pointer (FP8's scale_a * scale_b) reaches every epilogue; a 16-bit GEMM here."""
    if not runs_on_this_gpu(cfg):
        pytest.skip(f"no kernel for {cfg} on this GPU")
    m, n, k = 1000, 1032, 520
    a, w, ref = operands(m, n, k, torch.bfloat16, "nk")
    prep = prepare(m, n, k, torch.bfloat16, "nk", a.device, for_collective(cfg, "all_reduce"))
    buffer = torch.full((prep.plan.numel,), float("nan"), dtype=a.dtype, device="cuda")
    alpha = torch.tensor([0.25], device="cuda")
    prep.launch(a, w, buffer, torch.cuda.current_stream(), alpha=alpha)
    torch.cuda.synchronize()
    assert prep.counters.tolist() == list(prep.targets)
    prep.counters.zero_()
    assert prep.plan.in_place  # (all-reduce's rows layout)
    assert rel_err(buffer.view(m, n), 0.25 * ref) < 1e-2


FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
FP8_SHAPES = [(4096, 4096, 4096), (1000, 1040, 208), (333, 528, 272)]  # N % 16 == 0: torch._scaled_mm's


def fp8_operand(rows: int, k: int, dtype: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [rows, k] matrix quantized per tensor: (fp8 values, float32 scale), x ~= values * scale."""
    x = torch.randn(rows, k, device="cuda", generator=gen)
    scale = x.abs().max() / FP8_MAX[dtype]
    return (x / scale).to(getattr(torch, dtype)), scale


def fp8_signal_gemm(a: torch.Tensor, w: torch.Tensor, alpha: torch.Tensor, cfg: OverlapConfig, out_dtype: str):
    """C = alpha * a @ w.T by the FP8 signal GEMM of ``cfg`` alone on every SM: (C, the prepared
    kernel); the buffer poisoned before the launch, every group's counter checked at its target."""
    (m, k), n = a.shape, w.shape[0]
    fp8 = Fp8(getattr(torch, out_dtype))
    prep = prepare(m, n, k, a.dtype, "nk", a.device, for_collective(cfg, "all_reduce"), fp8=fp8)
    buffer = torch.full((prep.plan.numel,), float("nan"), dtype=fp8.out_dtype, device="cuda")
    prep.launch(a, w, buffer, torch.cuda.current_stream(), alpha=alpha.reshape(1))
    torch.cuda.synchronize()
    assert prep.counters.tolist() == list(prep.targets)
    prep.counters.zero_()  # (prepare keeps the plan for the next test of its shape)
    assert prep.plan.in_place and not torch.isnan(buffer).any(), "unwritten output elements"
    return buffer.view(m, n), prep


WIDE = {"tile_m": 128, "tile_n": 256}  # (FP8 calls default to 256 x 128)


@pytest.mark.parametrize(
    "input_dtype, out_dtype, epilogue, kernel, fields",
    [
        ("float8_e4m3fn", "bfloat16", "tma", "sm90", WIDE),
        ("float8_e4m3fn", "bfloat16", "tma", "sm90", {}),
        ("float8_e4m3fn", "bfloat16", "tma", "sm90", {"scheduler": "streamk"}),  # K split over CTAs: partial sums
        ("float8_e4m3fn", "bfloat16", "tma", "sm90", {"cluster_m": 2}),
        ("float8_e4m3fn", "bfloat16", "direct", "sm90", WIDE),
        ("float8_e4m3fn", "bfloat16", "direct", "sm90", {}),
        ("float8_e4m3fn", "float16", "tma", "sm90", WIDE),
        ("float8_e5m2", "bfloat16", "tma", "sm90", WIDE),
        ("float8_e4m3fn", "bfloat16", "direct", "sm80", WIDE),  # Ada's FP8 mma.sync kernels, forced here
    ],
)
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=str)
def test_fp8_signal_gemm_with_per_tensor_scales(shape, input_dtype, out_dtype, epilogue, kernel, fields):
    """The FP8 signal GEMM alone (Hopper's, or the Ada family's; ``fields``: the config's beyond FP8's
    256 x 128 tiles), scale_a * scale_b as the epilogue's alpha on the device: torch._scaled_mm's
    result within FP8 tolerance, every group's counter at its target."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("Hopper runs both families' FP8 kernels (Ada's sm_89 ones, forced, as sm_90)")
    m, n, k = shape
    out_torch = getattr(torch, out_dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    a, scale_a = fp8_operand(m, k, input_dtype, gen)
    w, scale_b = fp8_operand(n, k, input_dtype, gen)  # [N, K]: K-major, as FP8 WGMMA reads B
    ref = (a.float() * scale_a) @ (w.float() * scale_b).t()
    cfg = resolve({"epilogue": epilogue, "kernel": kernel, **fields}, fp8=True)
    out, prep = fp8_signal_gemm(a, w, scale_a * scale_b, cfg, out_dtype)
    assert prep.kernel.spec.tile_k == (128 if kernel == "sm90" else 64) and prep.kernel.spec.input_dtype == input_dtype
    assert rel_err(out, ref) < 2e-2
    if input_dtype == "float8_e4m3fn":  # (torch has no e5m2 x e5m2 _scaled_mm)
        scaled = torch._scaled_mm(a, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_torch)
        assert rel_err(out, scaled.float()) < 1e-2


def fp8_rowwise(rows: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [rows, k] matrix quantized per row (rows of very different size): (e4m3 values,
    float32 [rows, 1] scales), x ~= values * scales."""
    x = torch.randn(rows, k, device="cuda", generator=gen) * torch.rand(rows, 1, device="cuda", generator=gen) * 8
    scale = x.abs().amax(dim=1, keepdim=True) / FP8_MAX["float8_e4m3fn"]
    return (x / scale).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize(
    "fields",
    [{}, WIDE, {"scheduler": "streamk"}, {"cluster_m": 2}, {"layout": "cols"}, {"fast": True}],
    ids=["default", "wide", "streamk", "cluster", "cols", "fast"],
)
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=str)
def test_fp8_signal_gemm_with_rowwise_scales(shape, fields):
    """Rowwise scales (scale_a [M, 1], scale_b [1, N], torch._scaled_mm's) multiplied in by the direct
    epilogue, which an FP8 call with them resolves to: torch._scaled_mm's result within rounding,
    every element of the tile grid's edges included; the TMA epilogue refused."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("Hopper's FP8 kernels")
    (m, n, k), fields = shape, dict(fields)
    fast = fields.pop("fast", False)
    gen = torch.Generator(device="cuda").manual_seed(1)
    a, scale_a = fp8_rowwise(m, k, gen)
    w, scale_w = fp8_rowwise(n, k, gen)
    scales, kind = check_scales(a, w, "nk", scale_a, scale_w.t().contiguous(), None, fast)
    cfg = for_collective(resolve(fields, fp8=True), "all_reduce")
    prep = prepare(m, n, k, a.dtype, "nk", a.device, cfg, fp8=kind)
    assert prep.kernel.spec.epilogue == "direct"
    buffer = torch.full((prep.plan.numel,), float("nan"), dtype=torch.bfloat16, device="cuda")
    prep.launch(a, w, buffer, torch.cuda.current_stream(), None, *scales.epilogue())
    torch.cuda.synchronize()
    assert prep.counters.tolist() == list(prep.targets)
    prep.counters.zero_()
    got = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    restore(buffer, got, prep.plan, prep.slots)  # (each tile from its slot, in any layout)
    assert not torch.isnan(got).any(), "unwritten output elements"
    want = torch._scaled_mm(a, w.t(), scale_a=scales.a, scale_b=scales.b, out_dtype=torch.bfloat16, use_fast_accum=fast)
    assert rel_err(got, want.float()) < 1e-2
    ref = (a.float() * scale_a) @ (w.float() * scale_w).t()
    assert rel_err(got, ref) < 2e-2
    tma = for_collective(resolve({"epilogue": "tma"}, fp8=True), "all_reduce")
    with pytest.raises(ValueError, match="need epilogue 'direct'"):
        prepare(m, n, k, a.dtype, "nk", a.device, tma, fp8=kind)


@pytest.mark.parametrize("tile", [(256, 128), (128, 128), (128, 256)], ids=str)
def test_fp8_promotion_as_precise_as_scaled_mm(tile):
    """Promoted FP8 GEMMs (the default accumulation) add every K tile's partial sums into fp32
    accumulators, as torch._scaled_mm does: over a long K the two agree to fp16's rounding, closer
    than either is to a GEMM that lets the tensor cores accumulate all of K (fast accumulation;
    fp16 out, whose rounding bf16's would hide)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("Hopper's FP8 kernels")
    m, n, k = 1024, 1024, 16384
    gen = torch.Generator(device="cuda").manual_seed(0)
    a, scale_a = fp8_operand(m, k, "float8_e4m3fn", gen)
    w, scale_b = fp8_operand(n, k, "float8_e4m3fn", gen)
    out, prep = fp8_signal_gemm(a, w, scale_a * scale_b, OverlapConfig(tile_m=tile[0], tile_n=tile[1]), "float16")
    assert not prep.kernel.spec.fast_accum

    def scaled(fast: bool) -> torch.Tensor:
        return torch._scaled_mm(
            a, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float16, use_fast_accum=fast
        ).float()

    promoted = scaled(False)
    assert rel_err(out, promoted) < 0.5 * rel_err(scaled(True), promoted)


@pytest.fixture(scope="module")
def nccl_one_rank():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "nccl",
            store=dist.FileStore(os.path.join(tmp, "s"), 1),
            rank=0,
            world_size=1,
            device_id=torch.device("cuda", 0),
        )
        yield
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "mode, symmetric, nccl",
    [
        ("stream", False, "c10d"),
        ("spin", False, "c10d"),
        ("stream", True, "c10d"),
        ("stream", False, "direct"),
        ("stream", True, "direct"),
    ],
)
@pytest.mark.parametrize(
    "collective, layout, reduction",
    [
        ("all_reduce", "rows", "nccl"),
        ("all_reduce", "tiles", "nccl"),
        ("reduce_scatter", "cols", "nccl"),
        ("all_to_all", "cols", "nccl"),
        ("reduce_scatter", "rows", "nccl"),
        ("all_to_all", "rows", "nccl"),
        ("reduce_scatter", "segments", "nccl"),
        ("all_to_all", "segments", "nccl"),
        ("all_reduce", "rows", "local"),
        ("all_reduce", "tiles", "local"),
        ("all_reduce", "rows", "pull"),
        ("all_reduce", "rows", "pull_scatter"),
        ("reduce_scatter", "segments", "pull"),
        ("all_to_all", "segments", "pull"),
    ],
)
def test_pipeline_on_one_gpu(nccl_one_rank, monkeypatch, mode, symmetric, nccl, collective, layout, reduction):
    """The whole overlapped call (waits, NCCL per group, reset, restore) on a group of one rank;
    ``symmetric``: in a registered NCCL window, the result copied out; ``nccl``: the collectives
    through c10d or NCCL's C API (comm.direct); ``reduction`` local: all-gathered, then added; pull:
    the same by copies out of the ranks' memory (comm.peer: no NCCL, so native on either path).
    Four calls on new operands: through NCCL's C API the third and fourth are replayed natively
    (every step of every layout is a native call on one rank; runtime.replay_key)."""
    replays, keys = [], []
    replay, replay_key = enqueue.Program.replay, runtime.replay_key
    monkeypatch.setattr(enqueue.Program, "replay", lambda self, values: replays.append(1) or replay(self, values))
    monkeypatch.setattr(runtime, "replay_key", lambda *args: keys.append(1) or replay_key(*args))
    if reduction in comm.PULLS and symmetric:
        pytest.skip("pulls bring their own memory (no NCCL window)")
    native = nccl == "direct" or reduction in comm.PULLS
    monkeypatch.setenv("FLASHOVERLAP_WAIT", mode)
    monkeypatch.setenv("FLASHOVERLAP_NCCL", nccl)
    signal.forget_probes()
    group = comm.direct(comm.budget_group(dist.group.WORLD, 16), torch.device("cuda", 0))
    tail = comm.tail_group(dist.group.WORLD, torch.device("cuda", 0))  # direct: a private communicator
    assert isinstance(group, comm.Direct) == isinstance(tail, comm.Direct) == (nccl == "direct")
    if reduction in comm.PULLS:
        group, tail = comm.peer.peers(dist.group.WORLD, torch.device("cuda", 0)), None
    try:
        cfg = for_collective(OverlapConfig(layout=layout, symmetric=symmetric, reduction=reduction), collective)
        for m, n, k in [(2048, 4096, 1024), (777, 1032, 264)]:
            if collective != "all_reduce" and layout in comm.EQUAL_SEGMENTS and m % cfg.tile_m:
                continue  # rows / segments of reduce-scatter / all-to-all: segments of whole tile rows
            inputs = [operands(m, n, k, torch.bfloat16, "nk", seed=m + i) for i in range(4)]
            prep = prepare(m, n, k, torch.bfloat16, "nk", inputs[0][0].device, cfg)
            ex = comm.exchange(collective, m, 1, reduction=reduction)
            replays.clear()
            keys.clear()
            prep.programs.clear()  # (plans are shared by the cases of this test)
            prep.replays.clear()
            outs = [run_overlapped(prep, *inputs[0][:2], ex, group, tail)]  # may set up communicators, windows
            with no_host_sync():  # none inside a call: the host runs ahead
                outs += [run_overlapped(prep, a, w, ex, group, tail) for a, w, _ in inputs[1:]]  # counters reset
            torch.cuda.synchronize()
            assert len({o.data_ptr() for o in outs}) == 4  # each result its own tensor (none is the window)
            assert prep.counters.tolist() == [0] * prep.plan.num_groups
            for i, (out, (_, _, ref)) in enumerate(zip(outs, inputs)):
                assert not torch.isnan(out).any() and rel_err(out, ref) < 1e-2, f"call {i}"
            assert len(replays) == (len(inputs) - runtime.RECORDED_CALLS if native else 0)
            # the replays kept and taken first: only the recorded calls work out their replay key
            assert len(prep.replays) == native and len(keys) == (runtime.RECORDED_CALLS if native else len(inputs))
    finally:
        signal.forget_probes()


def test_fp8_row_parallel_layer_on_one_gpu(nccl_one_rank):
    """flashoverlap.nn's FP8 layer on CUDA: its input quantized per tensor as it comes, the call
    torch._scaled_mm's with the layer's scales (one rank: the plain path), then its bias."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores")
    from flashoverlap.nn import FP8, FP8_MAX, RowParallelLinear

    gen = torch.Generator(device="cuda").manual_seed(0)
    w8, w_scale = fp8_operand(2048, 1024, "float8_e4m3fn", gen)
    x = torch.randn(4, 512, 1024, device="cuda", generator=gen).bfloat16()
    bias = torch.randn(2048, device="cuda", generator=gen).bfloat16()
    layer = RowParallelLinear.from_fp8(w8, w_scale, bias=bias)
    with torch.inference_mode():
        y = layer(x)
    x_scale = x.abs().amax().float() / FP8_MAX
    x8 = (x.reshape(-1, 1024).float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    want = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16) + bias
    assert y.shape == (4, 512, 2048)
    torch.testing.assert_close(y.reshape(-1, 2048), want)


@pytest.mark.parametrize(
    "collective, layout, reduction, nccl, fast, out_dtype",
    [
        ("all_reduce", "rows", "nccl", "direct", False, torch.bfloat16),
        ("all_reduce", "rows", "pull_scatter", "direct", False, torch.bfloat16),
        ("reduce_scatter", "segments", "pull", "direct", False, torch.bfloat16),
        ("all_to_all", "cols", "nccl", "c10d", False, torch.bfloat16),
        ("all_reduce", "rows", "nccl", "direct", True, torch.bfloat16),
        ("all_reduce", "rows", "nccl", "c10d", False, torch.float16),
    ],
)
def test_fp8_pipeline_on_one_gpu(nccl_one_rank, monkeypatch, collective, layout, reduction, nccl, fast, out_dtype):
    """The overlapped call with FP8 operands on a group of one rank, into ``out_dtype`` (``fast``:
    partial sums unpromoted): each call's own scales (a new product every call) reach its GEMM, also where
    calls are replayed natively (the scales' product is among the values a replay substitutes) and
    in a CUDA graph's replays (read on the device); the public call on one rank is
    torch._scaled_mm's."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8 signal GEMMs are Hopper (sm_90a) kernels")
    import flashoverlap

    replays = []
    replay = enqueue.Program.replay
    monkeypatch.setattr(enqueue.Program, "replay", lambda self, values: replays.append(1) or replay(self, values))
    monkeypatch.setenv("FLASHOVERLAP_NCCL", nccl)
    device = torch.device("cuda", 0)
    group = comm.direct(comm.budget_group(dist.group.WORLD, 16), device)
    tail = comm.tail_group(dist.group.WORLD, device)
    if reduction in comm.PULLS:
        group, tail = comm.peer.peers(dist.group.WORLD, device), None
    m, n, k = 2048, 4096, 1024
    gen = torch.Generator(device="cuda").manual_seed(0)
    calls, kept = [], []
    for i in range(4):
        a, scale_a = fp8_operand(m, k, "float8_e4m3fn", gen)
        w, scale_b = fp8_operand(n, k, "float8_e4m3fn", gen)
        scales = Scales(scale_a.reshape(1), (scale_b * (i + 1)).reshape(1))
        calls.append((a, w, scales, (a.float() * scales.a) @ (w.float() * scales.b).t()))
    cfg = for_collective(OverlapConfig(layout=layout, reduction=reduction), collective)
    prep = prepare(m, n, k, torch.float8_e4m3fn, "nk", device, cfg, fp8=Fp8(out_dtype, fast))
    assert prep.kernel.spec.fast_accum == fast
    ex = comm.exchange(collective, m, 1, reduction=reduction)
    outs = []
    for a, w, scales, _ in calls:
        outs.append(run_overlapped(prep, a, w, ex, group, tail, scales))
        kept.append(torch.empty(1, device=device))  # (the next call's scales' product lands elsewhere)
    torch.cuda.synchronize()
    assert prep.out_dtype == out_dtype and all(out.dtype == out_dtype for out in outs)
    for i, (out, (*_, ref)) in enumerate(zip(outs, calls)):
        assert not torch.isnan(out).any() and rel_err(out, ref) < 2e-2, f"call {i}"
    assert len(replays) == (len(calls) - runtime.RECORDED_CALLS if nccl == "direct" else 0)
    if nccl == "direct" and reduction == "nccl":  # captured once, replayed with a scale changed in place
        a, w, scales, ref = calls[0]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run_overlapped(prep, a, w, ex, group, tail, scales)
        scales.b.mul_(2)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, 2 * ref) < 2e-2
    a, w, scales, _ = calls[1]
    given = {"scale_a": scales.a, "scale_b": scales.b, "out_dtype": torch.float16, "use_fast_accum": fast}
    plain = flashoverlap.gemm_all_reduce(a, w, **given)
    scaled = torch._scaled_mm(a, w.t(), **given)
    assert torch.equal(plain, scaled)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_parallel_linear_on_one_gpu(nccl_one_rank, sequence_parallel):
    """The CUDA path of ColumnParallelLinear (its backward's gemm_* call with the "kn" weight; a group
    of one rank runs it as the plain GEMM) against the fp32 layer."""
    from flashoverlap.nn import ColumnParallelLinear

    t, k, n = 1024, 512, 768
    x, w, g = (torch.randn(*shape, device="cuda").bfloat16().float() for shape in [(t, k), (n, k), (t, n)])
    layer = ColumnParallelLinear(k, n, bias=False, sequence_parallel=sequence_parallel, device="cuda")
    with torch.no_grad():
        layer.weight.copy_(w)
    xr = x.bfloat16().requires_grad_()
    y = layer(xr)
    assert rel_err(y, x @ w.t()) < 1e-2
    (y.float() * g).sum().backward()
    assert rel_err(xr.grad, g @ w) < 1e-2 and rel_err(layer.weight.grad, g.t() @ x) < 1e-2
    odd = ColumnParallelLinear(k, 100, bias=False, device="cuda")  # the backward's K must be a multiple of 8
    with pytest.raises(ValueError, match="N and K must be multiples of 8"):
        odd(xr)
    assert odd(xr.detach()).shape == (t, 100)  # no gradient to x: nothing to refuse


def test_an_untuned_call_is_timed_once_against_sequential(nccl_one_rank, caplog):
    """decision.trial on a group of one rank: real timing of the defaults, the same with its SM
    budget late, as a pull all-reduce, and the plain path, decided once per plans and communicators,
    the inputs and counters left as they were."""
    m, n, k = 2048, 4096, 1024
    a, w, ref = operands(m, n, k, torch.bfloat16, "nk", seed=5)
    snapshot = a.clone()
    cfg = for_collective(OverlapConfig(), "all_reduce")
    prep = prepare(m, n, k, torch.bfloat16, "nk", a.device, cfg)
    total = prep.sm_count + cfg.comm_sms
    late = alternative(cfg, (m, n, k), total, torch.cuda.get_device_capability())
    pull = pulled(cfg, "all_reduce", (m, n, k), total)
    assert late is not None and late.late_budget and pull.reduction == "pull"
    cfgs = [cfg, late, pull]
    preps = [prep, *(prepare(m, n, k, torch.bfloat16, "nk", a.device, c) for c in cfgs[1:])]
    exes = [comm.exchange("all_reduce", m, 1, reduction=c.reduction) for c in cfgs]
    budgets = [decision.budget_communicator(c, "all_reduce", dist.group.WORLD, a.device) for c in cfgs]
    tails = [dist.group.WORLD, dist.group.WORLD, None]
    trials = state.of(None).trials
    trials.clear()
    args = (cfgs, preps, budgets, a, w, "nk", exes, tails, dist.group.WORLD, m)
    pick = decision.trial(*args)
    assert pick in (0, 1, 2, None) and list(trials.values()) == [pick]
    assert "no tuned config" in caplog.text
    key = next(iter(trials))
    trials[key] = other = 1 if pick is None else None
    assert decision.trial(*args) is other  # kept: not timed again
    torch.cuda.synchronize()
    for prep in preps:
        assert prep.counters.tolist() == [0] * prep.plan.num_groups
    assert torch.equal(a, snapshot)
    for prep, budget, ex, tail in zip(preps, budgets, exes, tails):
        assert rel_err(run_overlapped(prep, a, w, ex, budget, tail_group=tail), ref) < 1e-2


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("symmetric", [False, True])
def test_calls_from_two_streams_do_not_race(nccl_one_rank, symmetric, direct):
    """Back-to-back calls issued from two streams share the counters (and the symmetric window):
    each must wait for the other's use of them. ``direct``: through NCCL's C API, so that from the
    fifth call on (the third from each stream) they are replayed natively."""
    m, n, k = 2048, 4096, 1024
    device = torch.device("cuda", 0)
    cfg = for_collective(OverlapConfig(symmetric=symmetric), "all_reduce")
    prep = prepare(m, n, k, torch.bfloat16, "nk", device, cfg)
    ex = comm.exchange("all_reduce", m, 1)
    group = comm.direct(comm.budget_group(dist.group.WORLD, 16), device) if direct else None
    tail = comm.tail_group(dist.group.WORLD, device) if direct else None
    assert isinstance(group, comm.Direct) == direct
    inputs = [operands(m, n, k, torch.bfloat16, "nk", seed=s) for s in range(4)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for i, (a, w, _) in enumerate(inputs * 3):
        with torch.cuda.stream(streams[i % 2]):
            outs.append(run_overlapped(prep, a, w, ex, group, tail))
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        assert rel_err(out, inputs[i % 4][2]) < 1e-2, f"call {i}"
    assert prep.counters.tolist() == [0] * prep.plan.num_groups


def test_debug_mode_reports_a_group_that_never_completes(nccl_one_rank, monkeypatch):
    """A counter that cannot reach its target (a plan/kernel mismatch, simulated) is reported with
    its group and value within the timeout instead of hanging the stream forever."""
    monkeypatch.setenv("FLASHOVERLAP_DEBUG", "1")
    monkeypatch.setenv("FLASHOVERLAP_TIMEOUT_S", "0.5")
    m, n, k = 2048, 4096, 512
    a, w, ref = operands(m, n, k, torch.bfloat16, "nk")
    prep = prepare(m, n, k, torch.bfloat16, "nk", a.device, for_collective(OverlapConfig(), "all_reduce"))
    out = run_overlapped(prep, a, w, comm.exchange("all_reduce", m, 1), None)  # debug mode, all well
    assert rel_err(out, ref) < 1e-2
    wrong = dataclasses.replace(prep, targets=(prep.targets[0] + 1, *prep.targets[1:]))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"group 0 of {prep.plan.num_groups} never completed: .* reached \d+ of"):
        run_overlapped(wrong, a, w, comm.exchange("all_reduce", m, 1), None)
    assert time.monotonic() - start < 30
    assert prep.report.tolist() == [0, 0, 0, 0]  # cleared for the next call
    out = run_overlapped(prep, a, w, comm.exchange("all_reduce", m, 1), None)
    assert rel_err(out, ref) < 1e-2 and prep.counters.tolist() == [0] * prep.plan.num_groups


@pytest.mark.parametrize(
    "collective, layout, symmetric, reduction",
    [
        ("all_reduce", "rows", False, "nccl"),
        ("all_reduce", "tiles", False, "nccl"),
        ("all_to_all", "cols", False, "nccl"),
        ("all_reduce", "rows", True, "nccl"),
        ("all_reduce", "rows", True, "local"),  # the adds' own stream joins the capture
        ("all_reduce", "rows", False, "pull"),  # the flags' writes and waits captured
    ],
)
def test_cuda_graph_capture_and_replay(nccl_one_rank, collective, layout, symmetric, reduction):
    """The whole call -- GEMM, waits, per-group NCCL, counter reset, restore -- in a CUDA graph,
    replayed on new inputs."""
    m, n, k = 1000, 2056, 512
    cfg = for_collective(OverlapConfig(layout=layout, symmetric=symmetric, reduction=reduction), collective)
    a, w, _ = operands(m, n, k, torch.bfloat16, "nk", seed=3)
    prep = prepare(m, n, k, torch.bfloat16, "nk", a.device, cfg)
    ex = comm.exchange(collective, m, 1, reduction=reduction)
    group = comm.peer.peers(dist.group.WORLD, a.device) if reduction == "pull" else None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as CUDA graphs require
        run_overlapped(prep, a, w, ex, group)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_overlapped(prep, a, w, ex, group)
    try:
        for seed in (4, 5):
            fresh_a, fresh_w, ref = operands(m, n, k, torch.bfloat16, "nk", seed=seed)
            a.copy_(fresh_a)
            w.copy_(fresh_w)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert not torch.isnan(out).any() and rel_err(out, ref) < 1e-2
        assert prep.counters.tolist() == [0] * prep.plan.num_groups
    finally:
        graph.reset()  # a live graph holding NCCL work would hang the fixture's destroy_process_group


def test_a_captured_wait_is_a_stream_wait_that_holds(monkeypatch):
    """Inside a CUDA graph the waits are stream waits too (no spin kernel needing an SM beside the
    GEMM) where the driver captures them, and a replay waits for its counter."""
    monkeypatch.setenv("FLASHOVERLAP_WAIT", "auto")
    signal.forget_probes()
    try:
        assert signal.stream_waits(0, capturing=True) is False  # not probed yet: a probe would break the capture
        assert signal.stream_waits(0, capturing=False) and signal.stream_waits(0, capturing=True)
        counters, flag = torch.zeros(1, dtype=torch.int32, device="cuda"), torch.zeros(1, device="cuda")
        waiter, producer = torch.cuda.Stream(), torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(waiter):
            graph.capture_begin()
            signal.wait_geq(waiter, counters, 0, 1)
            flag.add_(1)
            graph.capture_end()
        for _ in range(2):
            counters.zero_()
            torch.cuda.synchronize()
            with torch.cuda.stream(producer):  # enqueued first, as the GEMM is before its waits
                torch.cuda._sleep(500_000_000)  # ~0.25 s
                counters.fill_(1)
            with torch.cuda.stream(waiter):
                graph.replay()
            time.sleep(0.05)
            assert not waiter.query(), "the replayed wait did not wait for its counter"
            torch.cuda.synchronize()
        assert flag.item() == 2
    finally:
        signal.forget_probes()


def test_a_replay_keeps_the_order_of_the_stream_operations_it_batches():
    """fo_replay enqueues stream memory operations in a row on one stream as one batch: in their
    order (two writes of one flag: the last stays), before the operation after them (a copy reads
    what they wrote), a row at the end too, and a row on another stream in between."""
    flags = torch.zeros(8, dtype=torch.int32, device="cuda")
    lib = jit.runtime_library()
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    side.wait_stream(main)  # (the zeros first)
    at = [flags.data_ptr() + 4 * i for i in range(8)]
    tape = enqueue.Tape([])
    for (name, flag, value), stream in [
        (("fo_write_value", 0, 1), main),
        (("fo_write_value", 0, 2), main),
        (("fo_stream_wait", 0, 2), main),  # (already set: a wait that holds nothing up)
        (("fo_write_value", 1, 3), main),
        (("fo_write_value", 2, 4), side),  # another stream: the row on `main` goes first
    ]:
        function = getattr(lib, name)
        tape.add(
            enqueue.signature(function.argtypes), enqueue.address(lib, name), (at[flag], value, stream.cuda_stream), str
        )
    tape.add(
        enqueue.signature(lib.fo_copy_2d.argtypes),
        enqueue.address(lib, "fo_copy_2d"),
        (at[4], 8, at[0], 8, 8, 1, main.cuda_stream),
        str,
    )  # flags 0, 1 -> 4, 5 after the row
    tape.add(
        enqueue.signature(lib.fo_write_value.argtypes),
        enqueue.address(lib, "fo_write_value"),
        (at[6], 5, main.cuda_stream),
        str,
    )  # the last row
    tape.program().replay([])
    torch.cuda.synchronize()
    assert flags.tolist() == [2, 3, 4, 0, 2, 3, 5, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_adds_equal_torch_s_bit_for_bit(dtype):
    """comm.add (csrc/runtime.cu fo_sum of two, the partial sums' adds): torch's add bit for bit, in 16-byte
    vectors or element by element (unaligned starts, lengths not a multiple of 8), in place too."""
    flat = torch.randn(3, 1 << 20, device="cuda").to(dtype)
    for offset, n in [(0, 1 << 20), (0, 1000003), (3, 12345), (8, 7), (1, 1), (0, 0)]:
        a, b = flat[0, offset : offset + n], flat[1, offset : offset + n]
        out = flat[2, offset : offset + n].fill_(float("nan"))
        comm.add(out, a, b)
        assert torch.equal(out, a + b), (offset, n)
        expected = a + b
        comm.add(a, a, b)
        assert torch.equal(a, expected), (offset, n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_sums_round_once_as_float32_does(dtype):
    """comm.add_rows (csrc/runtime.cu fo_sum, the pulls' sums): the rows summed in float32 in their
    order, rounded once, as the CPU path does, bit for bit; in 16-byte vectors or element by element;
    into one of the rows and a second output too; more rows than one pass takes (comm.MAX_SUM) in two."""
    flat = torch.randn(11, 1 << 20, device="cuda").to(dtype)  # (rows 9 and 10: the outputs)
    for rows, offset, n in [(2, 0, 1 << 20), (4, 0, 1000003), (8, 3, 12345), (3, 8, 7), (5, 1, 1), (4, 0, 0)]:
        parts = [flat[r, offset : offset + n] for r in range(rows)]
        out = flat[9, offset : offset + n].fill_(float("nan"))
        comm.add_rows(parts, out)
        expected = parts[0].float()
        for part in parts[1:]:
            expected = expected + part.float()
        expected = expected.to(dtype)
        cpu = torch.empty(n, dtype=dtype)
        comm.add_rows([p.cpu() for p in parts], cpu)
        assert torch.equal(out, expected) and torch.equal(out.cpu(), cpu), (rows, offset, n)
        also = flat[10, offset : offset + n].fill_(float("nan"))
        comm.add_rows(parts, parts[-1], also)
        assert torch.equal(parts[-1], expected) and torch.equal(also, expected), (rows, offset, n)
    many = [flat[r, :4096] for r in range(9)]
    out = torch.empty(4096, device="cuda", dtype=dtype)
    comm.add_rows(many, out)
    assert torch.allclose(out.float(), torch.stack(many).float().sum(0), rtol=2e-2, atol=2e-2)


def test_plan_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(state.plans, "limit", 2)
    cfg = for_collective(OverlapConfig(), "all_reduce")
    preps = [prepare(256 * i, 512, 64, torch.bfloat16, "nk", torch.device("cuda", 0), cfg) for i in (1, 2, 3)]
    assert len(state.plans) <= 2
    assert prepare(256 * 3, 512, 64, torch.bfloat16, "nk", torch.device("cuda", 0), cfg) is preps[-1]


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_one_rank_group_runs_the_plain_gemm(nccl_one_rank, fn):
    a, w, ref = operands(1000, 1032, 200, torch.bfloat16, "nk", seed=7)
    out = fn(a, w)
    assert out.shape == (1000, 1032) and rel_err(out, ref) < 1e-2
