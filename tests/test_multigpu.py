"""Every visible GPU, one process each (NCCL): each entry point equals matmul + its collective."""

import contextlib
import os
import time
from functools import partial

import pytest
import torch
import torch.distributed as dist

import flashoverlap
from flashoverlap import OverlapConfig, comm, registry, signal
from flashoverlap.config import resolve
from flashoverlap.rules import rotation_unit
from flashoverlap.runtime import sequential

from .helpers import (
    check_column_parallel,
    check_gradients,
    count_replays,
    no_host_sync,
    rel_err,
    runs_on_this_gpu,
    spawn_ranks,
)

pytestmark = pytest.mark.multigpu

SHAPES = [(4096, 8192, 2048), (1000, 1032, 200), (333, 520, 264), (3000, 2056, 1000)]
CONFIGS = [
    OverlapConfig(),
    OverlapConfig(epilogue="direct"),
    OverlapConfig(layout="tiles"),
    OverlapConfig(layout="cols"),
    OverlapConfig(cluster_m=2, partition=None, comm_sms=16),
    OverlapConfig(tile_n=128, layout="tiles"),
    OverlapConfig(scheduler="streamk", comm_sms=12),
    OverlapConfig(kernel="sm80"),
    resolve(registry.SHIPPED / "consumer_pcie.yaml"),  # as shipped: sm80, 4 SMs for NCCL
    OverlapConfig(swizzle=4),
    OverlapConfig(late_budget=True),  # NCCL's SMs from the last waves on
    OverlapConfig(symmetric=True),  # NCCL symmetric-memory kernels
    OverlapConfig(layout="tiles", symmetric=True),
    OverlapConfig(reduction="local"),  # partial sums all-gathered, then added
    OverlapConfig(reduction="local", symmetric=True, comm_sms=0),  # ... on the copy engines
    OverlapConfig(reduction="pull"),  # ... copied out of the other ranks' memory (comm.peer)
    OverlapConfig(reduction="pull", comm_sms=4, partition=None),
    OverlapConfig(reduction="pull", late_budget=True),
    OverlapConfig(reduction="pull_scatter"),  # each rank's share pulled and summed, the sums pulled
    OverlapConfig(reduction="pull_scatter", comm_sms=4, partition=None, cluster_m=2),
]


def operands(seed, rank, m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(seed * 100 + rank)
    return (
        torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16),
        torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16),
    )


def init_rank(rank, world, store_path):
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        device_id=torch.device("cuda", rank),
    )


def spawn(fn, *args, timeout=300):
    """Run fn(rank, world, store_path, *args) on every visible GPU, one process each."""
    spawn_ranks(torch.cuda.device_count(), fn, *args, timeout=timeout)


def repeated(fn, what, replays, missed, nccl, sync=False):
    """Three calls of ``fn`` after its first (which may sync: a plan's agreement check): through NCCL's
    C API the third is replayed natively (enqueue); where it is not, ``what`` goes to ``missed``."""
    fn()
    before = len(replays)
    with contextlib.nullcontext() if sync else no_host_sync():
        outs = [fn() for _ in range(3)]
    if nccl == "direct" and len(replays) == before:
        missed.append(what)
    return outs


def worker(rank, world, store_path, mode, nccl):
    os.environ["FLASHOVERLAP_WAIT"] = mode
    os.environ["FLASHOVERLAP_NCCL"] = nccl
    init_rank(rank, world, store_path)
    replays, missed = count_replays(), []
    try:
        for seed, (m, n, k) in enumerate(SHAPES):
            expected = torch.zeros(m, n, device="cuda")
            for r in range(world):
                ar, wr = operands(seed, r, m, n, k)
                expected += ar.float() @ wr.float().t()
            a, w = operands(seed, rank, m, n, k)
            for cfg in filter(runs_on_this_gpu, CONFIGS):
                torch.full((2 * m * n,), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison the cache
                what = f"{(m, n, k)} {cfg}"
                outs = repeated(partial(flashoverlap.gemm_all_reduce, a, w, config=cfg), what, replays, missed, nccl)
                seq = sequential(a, w, "nk", comm.exchange("all_reduce", m, world), None)
                for out in outs:
                    assert not torch.isnan(out).any(), f"{what}: unwritten elements"
                    rel = rel_err(out, expected)
                    assert rel < 1e-2, f"{what}: rel err {rel:.2e}"
                    assert rel_err(out, seq.float()) < 1e-2
        torch.cuda.synchronize()
        assert not missed, f"not replayed: {missed}"
    finally:
        dist.destroy_process_group()
        signal.forget_probes()


@pytest.mark.parametrize("mode, nccl", [("stream", "c10d"), ("spin", "c10d"), ("stream", "direct")])
def test_gemm_all_reduce_on_all_gpus(mode, nccl):
    spawn(worker, mode, nccl)


SPLIT_CONFIGS = [
    OverlapConfig(),  # segments where the call's segments carry them, else cols
    OverlapConfig(layout="cols"),
    OverlapConfig(tile_n=128),
    OverlapConfig(scheduler="streamk", comm_sms=12),
    OverlapConfig(kernel="sm80", tile_n=128),
    OverlapConfig(swizzle=4),
    OverlapConfig(layout="rows"),  # row bands, rotated per rank: grouped send/recv per segment
    OverlapConfig(layout="rows", tile_n=128, epilogue="direct"),
    OverlapConfig(symmetric=True),  # reduce-scatter: symmetric kernels; all-to-all: copy engines
    OverlapConfig(layout="rows", symmetric=True),
    OverlapConfig(layout="segments"),  # each group: the same rows of every segment, one collective
    OverlapConfig(layout="segments", kernel="sm80", tile_n=128),
    OverlapConfig(layout="segments", symmetric=True, comm_sms=4),
    OverlapConfig(layout="segments", late_budget=True),
    OverlapConfig(layout="rows", late_budget=True, comm_sms=24),
    OverlapConfig(layout="segments", reduction="pull", comm_sms=4),  # this rank's rows pulled (comm.peer)
    OverlapConfig(layout="segments", reduction="pull", comm_sms=0),  # (a reduce-scatter's copied, summed after)
    # own rows last, the others' added in the epilogue (each epilogue's variant)
    OverlapConfig(layout="rows", reduction="pull_fused", comm_sms=0),
    OverlapConfig(layout="rows", reduction="pull_fused", comm_sms=0, epilogue="direct"),
    OverlapConfig(layout="rows", reduction="pull_fused", comm_sms=0, tile_n=128, swizzle=1),
]


def uneven_splits(seed, rank, m, world):
    """Rank ``rank``'s rows per destination (zeros allowed), known to every rank."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    cuts = torch.sort(torch.randint(0, m + 1, (world - 1,), generator=gen)).values.tolist()
    return [b - a for a, b in zip([0, *cuts], [*cuts, m])]


def split_worker(rank, world, store_path, nccl):
    """gemm_reduce_scatter and gemm_all_to_all (even, uneven, exchanged counts) vs fp32 and torch."""
    os.environ["FLASHOVERLAP_NCCL"] = nccl
    init_rank(rank, world, store_path)
    replays, missed = count_replays(), []
    try:
        for seed, (m, n, k) in enumerate(SHAPES):
            products = []
            for r in range(world):
                ar, wr = operands(seed, r, m, n, k)
                products.append(ar.float() @ wr.float().t())
            a, w = operands(seed, rank, m, n, k)
            calls = []
            if m % world == 0:
                rows = m // world
                calls.append(("reduce_scatter", {}, sum(products)[rank * rows : (rank + 1) * rows]))
                even = [torch.chunk(p, world)[rank] for p in products]
                calls.append(("all_to_all", {}, torch.cat(even)))
            splits = [uneven_splits(seed, s, m, world) for s in range(world)]
            parts = [products[s][sum(splits[s][:rank]) : sum(splits[s][: rank + 1])] for s in range(world)]
            mine = {"splits": splits[rank], "output_splits": [splits[s][rank] for s in range(world)]}
            calls.append(("all_to_all", mine, torch.cat(parts)))
            calls.append(("all_to_all", {"splits": splits[rank]}, torch.cat(parts)))  # counts exchanged
            for collective, kwargs, expected in calls:
                fn = getattr(flashoverlap, f"gemm_{collective}")
                ex = comm.exchange(collective, m, world, kwargs.get("splits"), kwargs.get("output_splits"))
                for cfg in (c for c in SPLIT_CONFIGS if runs_on_this_gpu(c, collective)):
                    what = f"{collective} {(m, n, k)} {kwargs} {cfg}"
                    if cfg.layout in comm.EQUAL_SEGMENTS and not comm.rows_carry(ex, rotation_unit(cfg, (m, n, k))):
                        # uneven splits, or segments not whole tile rows: refused before any launch
                        with pytest.raises(ValueError, match=f"layout '{cfg.layout}' runs"):
                            fn(a, w, config=cfg, **kwargs)
                        continue
                    if cfg.symmetric and not ex.even:
                        with pytest.raises(ValueError, match="symmetric windows need"):
                            fn(a, w, config=cfg, **kwargs)
                        continue
                    torch.full((2 * m * n,), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison the cache
                    exchanged = "splits" in kwargs and "output_splits" not in kwargs  # counts: a sync per call
                    outs = repeated(partial(fn, a, w, config=cfg, **kwargs), what, replays, missed, nccl, exchanged)
                    for out in outs:
                        assert out.shape == expected.shape, what
                        assert not torch.isnan(out).any(), f"{what}: unwritten elements"
                        if expected.numel():
                            rel = rel_err(out, expected)
                            assert rel < 1e-2, f"{what}: rel err {rel:.2e}"
                seq = sequential(a, w, "nk", ex, None).float()  # matmul then the torch collective
                assert seq.shape == out.shape, what
                if seq.numel():
                    assert rel_err(out, seq) < 1e-2, what
        # ranks with different M (MoE experts), the counts exchanged or every rank's M given: groups
        # on the largest M's columns
        sizes, n, k = [4096 >> r for r in range(world)], 2048, 512
        splits = [[s // world] * (world - 1) + [s - (world - 1) * (s // world)] for s in sizes]
        parts = []
        for s in range(world):
            a_s, w_s = operands(50, s, sizes[s], n, k)
            start = sum(splits[s][:rank])
            parts.append((a_s.float() @ w_s.float().t())[start : start + splits[s][rank]])
        a, w = operands(50, rank, sizes[rank], n, k)
        given = {"output_splits": [row[rank] for row in splits], "rows_per_rank": sizes}
        for cfg in (None, OverlapConfig(), OverlapConfig(kernel="sm80", tile_n=128)):
            if cfg is None or runs_on_this_gpu(cfg, "all_to_all"):
                for counts in ({}, given):
                    for _ in range(2):
                        torch.full((4 * sizes[0] * n,), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison
                        out = flashoverlap.gemm_all_to_all(a, w, splits=splits[rank], config=cfg, **counts)
                    assert rel_err(out, torch.cat(parts)) < 1e-2, f"M {sizes} {cfg} {sorted(counts)}"
        torch.cuda.synchronize()
        assert not missed, f"not replayed: {missed}"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("nccl", ["c10d", "direct"])
def test_gemm_reduce_scatter_and_all_to_all_on_all_gpus(nccl):
    spawn(split_worker, nccl)


FP8_CONFIGS = {
    "all_reduce": [
        OverlapConfig(),
        OverlapConfig(reduction="pull_scatter"),
        OverlapConfig(late_budget=True),
        OverlapConfig(kernel="sm80"),  # Ada's FP8 kernels, forced here
        None,
    ],
    "reduce_scatter": [
        OverlapConfig(layout="segments", reduction="pull"),
        OverlapConfig(reduction="pull_fused", comm_sms=0),
        OverlapConfig(layout="cols"),
        None,
    ],
    "all_to_all": [OverlapConfig(layout="rows"), None],
}


def fp8_worker(rank, world, store_path):
    """FP8 operands with per-tensor scales, each rank's own: every collective against the float32
    sum of the scaled products, explicit configs and an untuned call (timed on first use); the same
    with rowwise scales (scale_a [M, 1], scale_b [1, N]); then flashoverlap.nn's FP8 row-parallel
    layer (all-reduce, reduce-scatter)."""
    os.environ["FLASHOVERLAP_NCCL"] = "direct"
    init_rank(rank, world, store_path)
    try:
        m, n, k = 4096, 4096, 2048
        products, operands = [], []
        for r in range(world):
            gen = torch.Generator(device="cuda").manual_seed(r)
            a, w = (torch.randn(rows, k, device="cuda", generator=gen) for rows in (m, n))
            scale_a, scale_b = a.abs().max() / 448, w.abs().max() / 448
            a8, w8 = (a / scale_a).to(torch.float8_e4m3fn), (w / scale_b).to(torch.float8_e4m3fn)
            operands.append((a8, w8))
            scale_b = scale_b * (r + 1)  # (scales that differ by rank)
            products.append((a8.float() * scale_a) @ (w8.float() * scale_b).t())
            if r == rank:
                mine = a8, w8, {"scale_a": scale_a.reshape(1), "scale_b": scale_b.reshape(1)}
        total = sum(products)
        rows = slice(rank * m // world, (rank + 1) * m // world)
        expected = {"all_reduce": total, "reduce_scatter": total[rows]}
        expected["all_to_all"] = torch.cat([p[rows] for p in products])
        a8, w8, scales = mine
        for collective, configs in FP8_CONFIGS.items():
            fn = getattr(flashoverlap, f"gemm_{collective}")
            for cfg, fast in [(cfg, False) for cfg in configs] + [(None, True)]:  # (fast: unpromoted sums)
                for _ in range(3):  # (the third replayed natively)
                    out = fn(a8, w8, config=cfg, use_fast_accum=fast, **scales)
                torch.cuda.synchronize()
                rel = rel_err(out, expected[collective])
                assert out.dtype == torch.bfloat16 and rel < 2e-2, f"{collective} {cfg} {fast}: rel err {rel:.2e}"
        # rowwise: every row of a and of W scaled apart (the direct epilogue multiplies them in), each
        # rank's own scales
        row_a = [torch.linspace(0.5, 2.0, m, device="cuda").reshape(m, 1) / 64 * (r + 1) for r in range(world)]
        row_w = [torch.linspace(2.0, 0.5, n, device="cuda").reshape(1, n) / 64 for _ in range(world)]
        parts = [(x.float() * row_a[r]) @ (y.float() * row_w[r].t()).t() for r, (x, y) in enumerate(operands)]
        rowwise = {"scale_a": row_a[rank], "scale_b": row_w[rank]}
        total = sum(parts)
        want = {"all_reduce": total, "reduce_scatter": total[rows], "all_to_all": torch.cat([p[rows] for p in parts])}
        for collective, configs in FP8_CONFIGS.items():
            fn = getattr(flashoverlap, f"gemm_{collective}")
            for cfg in [c for c in configs if c is None or c.kernel != "sm80"]:  # (Ada's kernels: per tensor)
                if cfg is not None and cfg.reduction == "pull_fused":  # (its epilogue scales by one alpha)
                    with pytest.raises(ValueError, match="'pull_fused' takes per-tensor FP8 scales"):
                        fn(a8, w8, config=cfg, **rowwise)
                    continue
                for i in range(3):  # new scale tensors every call (the third replayed natively: substituted)
                    out = fn(a8, w8, config=cfg, scale_a=rowwise["scale_a"] * 2**i, scale_b=rowwise["scale_b"])
                    torch.cuda.synchronize()
                    rel = rel_err(out, want[collective] * 2**i)
                    assert out.dtype == torch.bfloat16 and rel < 2e-2, f"rowwise {collective} {cfg} {i}: {rel:.2e}"
        # the same through flashoverlap.nn's FP8 layer, its input FP8 already (with a static scale)
        from flashoverlap.nn import RowParallelLinear

        for sequence_parallel in (False, True):
            layer = RowParallelLinear.from_fp8(
                w8, scales["scale_b"], input_scale=scales["scale_a"], sequence_parallel=sequence_parallel
            )
            with torch.inference_mode():
                out = layer(a8)
            want = expected["reduce_scatter" if sequence_parallel else "all_reduce"]
            assert rel_err(out, want) < 2e-2, f"layer, sequence_parallel={sequence_parallel}"
        # channel weight scales (per output feature), FP8 input with a static scale: rowwise calls
        x_scale = torch.tensor(1 / 64, device="cuda")
        channel = RowParallelLinear.from_fp8(w8, row_w[rank].reshape(n, 1), input_scale=x_scale)
        with torch.inference_mode():
            out = channel(a8)
        want = sum((x.float() * x_scale) @ (y.float() * row_w[r].t()).t() for r, (x, y) in enumerate(operands))
        assert rel_err(out, want) < 2e-2, "layer, channel scales"
    finally:
        dist.destroy_process_group()


def test_fp8_calls_on_all_gpus():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8 signal GEMMs are Hopper (sm_90a) kernels")
    spawn(fp8_worker, timeout=240)


def nn_worker(rank, world, store_path, part):
    """RowParallelLinear (all-reduce and sequence parallel) vs fp32 on the unsharded layer:
    ``autograd`` forward and gradients, ``compile`` torch.compile, ``graph`` CUDA-graph replay."""
    from flashoverlap.nn import RowParallelLinear

    init_rank(rank, world, store_path)
    try:
        t, k, n = 2048, 1024 * world, 2048
        gen = torch.Generator(device="cuda").manual_seed(0)  # same full problem on every rank
        x, w = torch.randn(t, k, device="cuda", generator=gen), torch.randn(n, k, device="cuda", generator=gen)
        b, g = torch.randn(n, device="cuda", generator=gen), torch.randn(t, n, device="cuda", generator=gen)
        x, w, b, g = (v.bfloat16().float() for v in (x, w, b, g))  # exactly representable in bf16
        cols = slice(rank * k // world, (rank + 1) * k // world)

        def close(got, want, what):
            err = rel_err(got, want)
            assert err < 1e-2, f"{what}: rel err {err:.2e}"

        for sp in (False, True):
            # config={}: the overlapped path even where the registry would pick sequential
            layer = RowParallelLinear(k // world, n, sequence_parallel=sp, config={}, device="cuda")
            with torch.no_grad():
                layer.weight.copy_(w[:, cols])
                layer.bias.copy_(b)
            rows = slice(rank * t // world, (rank + 1) * t // world) if sp else slice(None)
            if part == "autograd":
                xr = x[:, cols].bfloat16().requires_grad_()
                y = layer(xr)
                close(y, (x @ w.t() + b)[rows], f"forward sp={sp}")
                (y.float() * g[rows]).sum().backward()
                close(xr.grad, (g @ w)[:, cols], f"grad x sp={sp}")
                close(layer.weight.grad, (g.t() @ x)[:, cols], f"grad w sp={sp}")
                close(layer.bias.grad, g.sum(0), f"grad b sp={sp}")
            elif part == "compile":  # one graph (fullgraph): the overlapped call is one operator in it
                torch._dynamo.reset()
                xr = x[:, cols].bfloat16().requires_grad_()
                y = torch.compile(layer, fullgraph=True)(xr)
                close(y, (x @ w.t() + b)[rows], f"torch.compile sp={sp}")
                (y.float() * g[rows]).sum().backward()
                close(xr.grad, (g @ w)[:, cols], f"torch.compile grad x sp={sp}")
            else:
                with torch.no_grad():
                    static = x[:, cols].bfloat16().clone()
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):  # warm-up: plan, agreement, communicators
                        layer(static)
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        out = layer(static)
                    try:
                        for scale in (0.5, -2.0):
                            static.copy_((scale * x[:, cols]).bfloat16())
                            graph.replay()
                            torch.cuda.synchronize()
                            close(out, (scale * x @ w.t() + b)[rows], f"CUDA graph replay sp={sp}")
                    finally:
                        # NCCL's communicator teardown waits for every graph that captured one of
                        # its collectives to be destroyed (pytorch/pytorch#115388): a live graph
                        # would hang destroy_process_group below
                        graph.reset()
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("part", ["autograd", "compile", "graph"])
def test_row_parallel_linear_on_all_gpus(part):
    spawn(nn_worker, part, timeout=180)


def graphs_worker(rank, world, store_path):
    """FLASHOVERLAP_TIMING=graphs: an untuned call's first use times its candidates as captured
    graphs (NCCL inside them); its answer then runs eagerly and in the caller's own capture, as
    does a pull (its memory claimed across eager calls and replays)."""
    from flashoverlap import state

    os.environ["FLASHOVERLAP_TIMING"] = "graphs"
    init_rank(rank, world, store_path)
    try:
        m, n, k = 2304, 4096, 3072  # no registry entry of this shape: timed on first use
        expected = torch.zeros(m, n, device="cuda")
        for r in range(world):
            ar, wr = operands(11, r, m, n, k)
            expected += ar.float() @ wr.float().t()
        a, w = operands(11, rank, m, n, k)
        out = flashoverlap.gemm_all_reduce(a, w)
        assert [key[0] for key in state.of(None).trials] == [True], "timed as CUDA graphs"
        assert rel_err(out, expected) < 1e-2

        def replayed(config) -> None:
            """A call captured, replayed between eager calls, nothing waited for in between (a
            pull's claim of the memory for the next call is still pending as that call starts)."""
            static = a.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                flashoverlap.gemm_all_reduce(static, w, config=config)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = flashoverlap.gemm_all_reduce(static, w, config=config)
            try:
                for scale in (0.5, -2.0):
                    static.copy_(scale * a)
                    before = flashoverlap.gemm_all_reduce(a, w, config=config)
                    graph.replay()
                    after = flashoverlap.gemm_all_reduce(-a, w, config=config)
                    torch.cuda.synchronize()
                    for got, want, what in (
                        (before, expected, "before"),
                        (captured, scale * expected, "replay"),
                        (after, -expected, "after"),
                    ):
                        assert rel_err(got, want) < 1e-2, f"{what} the replay x{scale}, config {config}"
            finally:
                graph.reset()  # (a live graph holding NCCL work would hang the teardown)

        replayed(None)  # the timed answer
        replayed({"reduction": "pull"})
        replayed({"reduction": "pull_scatter"})
    finally:
        dist.destroy_process_group()


def test_calls_replayed_as_graphs_are_timed_as_graphs_on_all_gpus():
    spawn(graphs_worker, timeout=180)


def column_worker(rank, world, store_path):
    init_rank(rank, world, store_path)
    try:
        check_column_parallel(rank, world)
    finally:
        dist.destroy_process_group()


def test_column_parallel_linear_on_all_gpus():
    spawn(column_worker, timeout=180)


def mismatch_worker(rank, world, store_path):
    init_rank(rank, world, store_path)
    try:
        a, w = operands(0, rank, 1024, 2048, 512)
        cfg = OverlapConfig() if rank == 0 else OverlapConfig(layout="tiles", partition=None, tile_n=128)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="ranks planned different calls"):
            flashoverlap.gemm_all_reduce(a, w, config=cfg)
        assert time.monotonic() - start < 60, "the mismatch must be reported within seconds"
    finally:
        dist.destroy_process_group()


def test_mismatched_configs_fail_on_every_rank_instead_of_hanging():
    spawn(mismatch_worker)


def gradient_worker(rank, world, store_path):
    init_rank(rank, world, store_path)
    try:

        def overlapped(a, weight, collective, **kwargs):  # config={}: overlapped even where one wave
            return getattr(flashoverlap, f"gemm_{collective}")(a, weight, config={}, **kwargs)

        check_gradients(rank, world, overlapped, "cuda", size=16, tol=1e-2)
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


def test_gradients_on_all_gpus():
    """The public calls with autograd over NCCL: every collective, every way all-to-all takes its counts."""
    spawn(gradient_worker, timeout=180)
