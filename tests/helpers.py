"""Shared test helpers."""

import contextlib
import os
import tempfile
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from flashoverlap.config import OverlapConfig, for_collective, for_device
from flashoverlap.plan import scheduled_tiles, wave_count


def rel_err(out, ref) -> float:
    """Relative error of ``out`` against the reference ``ref`` (float32 or float64), in the 2-norm."""
    return ((out.to(ref.dtype) - ref).norm() / ref.norm()).item()


@contextlib.contextmanager
def no_host_sync():
    """Fail on any CUDA call inside that makes the host wait for the GPU (torch's sync debug
    mode: ``.item()``, blocking copies, stream synchronisations)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def random_partition(rng: np.random.Generator, num_waves: int) -> tuple[int, ...]:
    """A random composition of ``num_waves`` into positive group sizes."""
    cuts = sorted(rng.choice(np.arange(1, num_waves), size=int(rng.integers(0, num_waves)), replace=False).tolist())
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, num_waves]))


def random_plan_args(
    rng: np.random.Generator,
    max_tiles: int,
    ctas_choices: tuple[int, ...],
    stream_k_share: float = 0.3,
    default_share: float = 0.3,
) -> dict:
    """make_plan keyword arguments (all but ``layout``) for a random problem: edge tiles, clusters,
    stream-K, swizzles, random or default partitions."""
    tile_m, tile_n = int(rng.choice([128, 256])), int(rng.choice([64, 128, 256]))
    m = int(rng.integers(1, max_tiles * tile_m))
    n = 8 * int(rng.integers(1, max_tiles * tile_n // 8))
    cluster_m, ctas = int(rng.choice([1, 2])), int(rng.choice(ctas_choices))
    padded = scheduled_tiles(m, n, tile_m, tile_n, cluster_m)
    stream_k = int(rng.integers(0, padded + 1)) if rng.random() < stream_k_share else 0
    swizzle = 1 if stream_k else int(rng.choice([1, 2, 4, 8]))
    waves = wave_count(m, n, tile_m, tile_n, cluster_m, ctas, stream_k, swizzle)
    partition = None if rng.random() < default_share else random_partition(rng, waves)
    return dict(
        m=m,
        n=n,
        tile_m=tile_m,
        tile_n=tile_n,
        cluster_m=cluster_m,
        ctas=ctas,
        stream_k_tiles=stream_k,
        partition=partition,
        swizzle=swizzle,
    )


def runs_on_this_gpu(cfg: OverlapConfig, collective: str = "all_reduce") -> bool:
    """Whether the current GPU has a kernel for ``cfg`` (the sm90 configs need a Hopper GPU)."""
    try:
        for_device(for_collective(cfg, collective), torch.cuda.get_device_capability())
    except ValueError:
        return False
    return True


def spawn_ranks(world, fn, *args, timeout=300):
    """Run fn(rank, world, store_path, *args) in ``world`` processes; a run that has not finished
    after ``timeout`` seconds (a hang) is killed and fails the test."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(fn, args=(world, os.path.join(tmp, "store"), *args), nprocs=world, join=False)
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for process in ctx.processes:
                    process.kill()
                pytest.fail(f"{fn.__name__}{args} did not finish within {timeout} s on {world} ranks")


def check_column_parallel(rank: int, world: int, device: str = "cuda", tol: float = 1e-2) -> None:
    """ColumnParallelLinear (all-reduce and sequence parallel) against the unsharded layer in
    float64: the forward, and the gradients (on CUDA the input's through the overlapped backward
    call, "kn" weight, in bf16; on the CPU the plain path, in float64). Run by every rank of an
    initialised group."""
    from flashoverlap.nn import ColumnParallelLinear

    dtype = torch.bfloat16 if device == "cuda" else torch.float64
    t, k, n = 1024, 1024, 512 * world  # tokens, input features, output features (split)
    gen = torch.Generator(device=device).manual_seed(0)  # the same full problem on every rank
    x, w, g = (torch.randn(*s, device=device, generator=gen).to(dtype).double() for s in [(t, k), (n, k), (t, n)])
    b = torch.randn(n, device=device, generator=gen).to(dtype).double()
    out = slice(rank * n // world, (rank + 1) * n // world)
    for sp in (False, True):
        layer = ColumnParallelLinear(k, n // world, sequence_parallel=sp, config={}, device=device, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(w[out])
            layer.bias.copy_(b[out])
        rows = slice(rank * t // world, (rank + 1) * t // world) if sp else slice(None)
        xr = x[rows].to(dtype).requires_grad_()
        saved = []  # what autograd keeps: with sequence parallelism the shard, not the gathered input
        with torch.autograd.graph.saved_tensors_hooks(lambda s, kept=saved: kept.append(s.shape) or s, lambda s: s):
            y = layer(xr)
        assert ((t, k) in saved) == (not sp or world == 1), f"saved {saved} sp={sp}"
        assert rel_err(y, (x @ w.t() + b)[:, out]) < tol, f"forward sp={sp}"
        (y.double() * g[:, out]).sum().backward()
        assert rel_err(xr.grad, (g @ w)[rows]) < tol, f"grad x sp={sp}"
        assert rel_err(layer.weight.grad, (g.t() @ x)[out]) < tol, f"grad w sp={sp}"
        assert rel_err(layer.bias.grad, g.sum(0)[out]) < tol, f"grad b sp={sp}"
    if device == "cuda":
        torch.cuda.synchronize()
