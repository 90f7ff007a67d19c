"""Two and three ranks on one GPU (gloo, which carries CUDA tensors through host memory): the
overlapped calls with the real kernels, counters and streams, several ranks exchanging what the
plan laid out, against the sequential path (cuBLAS + the same collective). Every collective and
layout whose collectives gloo has: all but the send/receive of the ``rows`` layout for
reduce-scatter / all-to-all (gloo cannot send CUDA tensors point to point); NCCL's own features
(symmetric windows, capped communicators, its C API) need the multi-GPU tests. Correctness only:
the ranks share the GPU, and gloo waits on the host for every collective."""

import pytest
import torch
import torch.distributed as dist

import flashoverlap
from flashoverlap import OverlapConfig, comm
from flashoverlap.rules import rotation_unit
from flashoverlap.runtime import sequential

from .helpers import check_column_parallel, check_gradients, rel_err, runs_on_this_gpu, spawn_ranks

pytestmark = pytest.mark.gpu

CASES = [  # collective, config, keyword arguments
    ("all_reduce", {}, {}),
    ("all_reduce", {"layout": "tiles"}, {}),
    ("all_reduce", {"layout": "cols"}, {}),
    ("all_reduce", {"reduction": "local"}, {}),
    ("all_reduce", {"reduction": "local", "layout": "tiles", "comm_sms": 0}, {}),
    ("all_reduce", {"kernel": "sm80"}, {}),
    ("all_reduce", {"scheduler": "streamk", "comm_sms": 12}, {}),
    ("reduce_scatter", {"layout": "cols"}, {}),
    ("reduce_scatter", {"layout": "segments"}, {}),
    ("reduce_scatter", {"layout": "segments", "kernel": "sm80"}, {}),
    ("all_to_all", {"layout": "cols"}, {}),
    ("all_to_all", {"layout": "segments"}, {}),
    ("all_to_all", {"layout": "cols"}, {"uneven": True}),
    # without config=: the registry's entry (two ranks of an H200) or the defaults, timed first
    ("all_reduce", None, {}),
    ("reduce_scatter", None, {}),
    ("all_to_all", None, {}),
    ("all_to_all", None, {"uneven": True}),
    # ranks with different M (MoE experts): groups on the largest M's columns; one rank with none:
    # the plain collective on every rank
    ("all_to_all", None, {"ragged": True}),
    ("all_to_all", {"layout": "cols"}, {"ragged": True}),
    ("all_to_all", {"layout": "cols", "kernel": "sm80"}, {"ragged": True}),
    ("all_to_all", None, {"ragged": True, "empty": True}),
]
SHAPES = [(4608, 2048, 512), (1000, 1032, 264)]


def worker(rank, world, store_path):
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        for collective, config, kwargs in CASES:
            if config is not None and not runs_on_this_gpu(OverlapConfig(**config), collective):
                continue
            fn = getattr(flashoverlap, f"gemm_{collective}")
            for m, n, k in SHAPES:
                if collective != "all_reduce" and m % world:
                    continue
                # uneven: a third of the rows to the last rank but one, the rest to the last (none to others)
                splits = [0] * (world - 2) + [m // 3, m - m // 3] if kwargs.get("uneven") else None
                if kwargs.get("ragged"):  # rank r has M / 2^r rows (the last rank none where "empty")
                    m = 0 if kwargs.get("empty") and rank == world - 1 else m >> rank
                    splits = [m // world] * (world - 1) + [m - (world - 1) * (m // world)]
                call = {"splits": splits} if splits else {}
                what = f"{collective} {config} {kwargs} {m}x{n}x{k} world {world} rank {rank}"
                ex = comm.exchange(collective, m, world, splits, group=None, device=torch.device("cuda", 0))
                assert ex.ragged == bool(kwargs.get("ragged")), what
                segments = config is not None and config.get("layout") == "segments"
                if segments and not comm.rows_carry(ex, rotation_unit(OverlapConfig(**config), (m, n, k))):
                    continue  # equal segments of whole tile rows
                gen = torch.Generator(device="cuda").manual_seed(m + rank)
                a = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
                w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
                for _ in range(2):  # back to back: counters reset, buffers reused
                    out = fn(a, w, config=config, **call)
                seq = sequential(a, w, "nk", ex, None).float()
                assert out.shape == seq.shape, what
                assert not torch.isnan(out).any(), f"{what}: unwritten elements"
                if seq.numel():
                    assert rel_err(out, seq) < 1e-2, what
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_several_ranks_on_one_gpu(world):
    spawn_ranks(world, worker, timeout=600)


def column_worker(rank, world, store_path):
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        check_column_parallel(rank, world)
    finally:
        dist.destroy_process_group()


def test_column_parallel_backward_on_two_ranks_of_one_gpu():
    spawn_ranks(2, column_worker, timeout=300)


def compile_worker(rank, world, store_path, part):
    """Under torch.compile (``fullgraph=True``), the real kernels between ranks: ``calls`` every
    collective (a second M recompiles with M dynamic), ``layers`` both layers forward and backward
    through inductor."""
    import faulthandler

    from flashoverlap.nn import ColumnParallelLinear, RowParallelLinear

    faulthandler.enable()
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    torch._dynamo.config.capture_dynamic_output_shape_ops = True  # the ragged all-to-all's rows
    try:
        n, k = 2048, 512
        gen = torch.Generator(device="cuda").manual_seed(rank)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
        cases = [
            ("all_reduce", {}, {}),
            ("reduce_scatter", {"layout": "segments"}, {}),
            ("all_to_all", {"layout": "cols"}, {"uneven": True}),
            ("all_to_all", None, {"ragged": True}),
        ]
        for collective, config, kwargs in cases if part == "calls" else ():
            fn = getattr(flashoverlap, f"gemm_{collective}")
            torch._dynamo.reset()
            for m in (4608, 6144):
                if kwargs.get("ragged"):
                    m >>= rank
                splits = [m // 3, m - m // 3] if kwargs else None
                call = {"splits": splits} if splits else {}

                def doubled(a, w, fn=fn, config=config, call=call):
                    return fn(a, w, config=config, **call) * 2

                compiled = torch.compile(doubled, fullgraph=True, backend="aot_eager")
                a = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
                ex = comm.exchange(collective, m, world, splits, group=None, device=a.device)
                what = f"{collective} {config} {kwargs} M={m} rank {rank}"
                out, seq = compiled(a, w), 2 * sequential(a, w, "nk", ex, None).float()
                assert out.shape == seq.shape and rel_err(out, seq) < 1e-2, what
        x = torch.randn(4096, k, device="cuda", generator=gen).bfloat16()
        # (without sequence parallelism: the all-gathers torch traces crash over gloo with CUDA
        # tensors, eagerly too; the multi-GPU test compiles those layers over NCCL)
        for cls in (RowParallelLinear, ColumnParallelLinear) if part == "layers" else ():
            torch._dynamo.reset()
            layer = cls(k, n, config={}, device="cuda")
            runs = []
            for run in (layer, torch.compile(layer, fullgraph=True)):
                xr = x.clone().requires_grad_()
                y = run(xr)
                y.float().pow(2).sum().backward()
                runs.append((y, xr.grad, layer.weight.grad))
                layer.zero_grad(set_to_none=True)
            for eager, traced in zip(*runs):
                assert rel_err(traced, eager.float()) < 1e-2, f"{cls.__name__} rank {rank}"
        torch.cuda.synchronize()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("part", ["calls", "layers"])
def test_compiled_calls_on_two_ranks_of_one_gpu(part):
    spawn_ranks(2, compile_worker, part, timeout=600)


GRADIENT_CONFIGS = {"all_reduce": {}, "reduce_scatter": {"layout": "cols"}, "all_to_all": {"layout": "cols"}}


def overlapped(a, weight, collective, **kwargs):
    return getattr(flashoverlap, f"gemm_{collective}")(a, weight, config=GRADIENT_CONFIGS[collective], **kwargs)


def gradient_worker(rank, world, store_path):
    """The public calls with autograd, overlapped (explicit configs), every collective and way of
    giving all-to-all's counts; and an all-reduce compiled (its backward has no collective, which
    torch would trace and gloo then crash on with CUDA tensors)."""
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        check_gradients(rank, world, overlapped, "cuda", size=16, tol=1e-2)
        compiled = torch.compile(overlapped, fullgraph=True, backend="aot_eager")
        cases = [("all_reduce", "nk"), ("all_reduce", "kn")]
        check_gradients(rank, world, compiled, "cuda", size=16, tol=1e-2, cases=cases)
        torch.cuda.synchronize()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_gradients_on_two_ranks_of_one_gpu():
    spawn_ranks(2, gradient_worker, timeout=300)
