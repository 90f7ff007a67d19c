"""Shared test helpers."""

import contextlib
import ctypes
import os
import signal
import sys
import tempfile
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import flashoverlap
from flashoverlap.config import OverlapConfig
from flashoverlap.plan import scheduled_tiles, wave_count
from flashoverlap.rules import for_collective, for_device

ENTRY_POINTS = [flashoverlap.gemm_all_reduce, flashoverlap.gemm_reduce_scatter, flashoverlap.gemm_all_to_all]


def bf16(*shape) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


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


def count_replays() -> list:
    """A list that grows by one for each native replay of a call in this process (enqueue.Program)."""
    from flashoverlap import enqueue

    replays, replay = [], enqueue.Program.replay
    enqueue.Program.replay = lambda self, values: replays.append(1) or replay(self, values)
    return replays


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
    stream-K, swizzles, late SM budgets, random or default partitions."""
    tile_m, tile_n = int(rng.choice([128, 256])), int(rng.choice([64, 128, 256]))
    m = int(rng.integers(1, max_tiles * tile_m))
    n = 8 * int(rng.integers(1, max_tiles * tile_n // 8))
    cluster_m, ctas = int(rng.choice([1, 2])), int(rng.choice(ctas_choices))
    padded = scheduled_tiles(m, n, tile_m, tile_n, cluster_m)
    stream_k = int(rng.integers(0, padded + 1)) if rng.random() < stream_k_share else 0
    swizzle = 1 if stream_k else int(rng.choice([1, 2, 4, 8]))
    keep = int(rng.integers(1, ctas)) if ctas > 1 and not stream_k and rng.random() < 0.3 else 0  # late budget
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
        keep=keep,
    )


def runs_on_this_gpu(cfg: OverlapConfig, collective: str = "all_reduce") -> bool:
    """Whether the current GPU has a kernel for ``cfg`` (the sm90 configs need a Hopper GPU)."""
    try:
        for_device(for_collective(cfg, collective), torch.cuda.get_device_capability())
    except ValueError:
        return False
    return True


def _dies_with_parent(rank, fn, *args):
    """``fn(rank, *args)`` in a worker that the kernel kills when the test process ends (Linux): a
    test run cut from outside (a ``timeout`` around pytest) leaves no rank holding the GPUs and the
    communicators that the next run on the machine waits for. (torch's spawn asks for SIGINT on the
    parent's death, which a rank hung inside a CUDA or NCCL call never handles.)"""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # (the parent ended before the call above)
            os._exit(1)
    fn(rank, *args)


def spawn_ranks(world, fn, *args, timeout=300):
    """Run fn(rank, world, store_path, *args) in ``world`` processes, which end with the test
    process (:func:`_dies_with_parent`); a run that has not finished after ``timeout`` seconds (a
    hang) is killed and fails the test."""
    with tempfile.TemporaryDirectory() as tmp:
        spawned = (fn, world, os.path.join(tmp, "store"), *args)
        ctx = mp.start_processes(_dies_with_parent, args=spawned, nprocs=world, join=False)
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


def collective_problem(
    collective: str, world: int, seed: int, ragged: bool = False, uneven: bool = False, size: int = 1
):
    """Every rank's operands of ``collective(a_r @ W_r^T)`` and the gradient of one global loss,
    alike on every rank (float64): a list per rank of (a [M_r, K], w [N, K], splits, output_splits,
    result, g = d loss / d result, grad_a, grad_w). Loss: <g, y> for the all-reduce (its result, held alike
    by every rank, counted once), the sum of the ranks' <g_r, y_r> otherwise. ``size`` scales the
    shapes; a and g are bf16 values, w nearly (scaled by 1 / sqrt(K))."""
    gen = torch.Generator().manual_seed(seed)
    k, n = 24 * size, 16 * size

    def randn(*shape):
        return torch.randn(*shape, generator=gen).bfloat16().double()

    ms = [8 * world * size + (5 * r * (r % 2) if ragged else 0) for r in range(world)]
    a = [randn(m, k) for m in ms]
    w = [randn(n, k) / k**0.5 for _ in range(world)]
    c = [x @ v.t() for x, v in zip(a, w)]
    if collective == "all_to_all":
        if ragged or uneven:  # rank s sends rows to d in proportion (d + 1 + s) % world, some none
            shares = [[(d + 1 + s) % world for d in range(world)] for s in range(world)]
            splits = [[m * x // sum(row) for x in row] for m, row in zip(ms, shares)]
            for s, m in enumerate(ms):
                splits[s][-1] += m - sum(splits[s])
        else:
            splits = [[m // world] * world for m in ms]
        recv = [[splits[s][r] for s in range(world)] for r in range(world)]
        blocks = [list(torch.split(c[s], splits[s])) for s in range(world)]
        y = [torch.cat([blocks[s][r] for s in range(world)]) for r in range(world)]
        g = [randn(*y[r].shape) for r in range(world)]
        g_blocks = [list(torch.split(g[r], recv[r])) for r in range(world)]
        dc = [torch.cat([g_blocks[d][s] for d in range(world)]) for s in range(world)]
    else:
        splits = recv = [None] * world
        total = sum(c)
        if collective == "all_reduce":
            y = [total] * world
            g = [randn(*total.shape)] * world
            dc = g
        else:
            y = list(torch.chunk(total, world))
            g = [randn(total.shape[0] // world, n) for _ in range(world)]
            dc = [torch.cat(g)] * world
    return [(a[r], w[r], splits[r], recv[r], y[r], g[r], dc[r] @ w[r], dc[r].t() @ a[r]) for r in range(world)]


GRADIENT_CASES = [  # collective, how the call is made
    ("all_reduce", "nk"),
    ("all_reduce", "kn"),
    ("reduce_scatter", "nk"),
    ("reduce_scatter", "kn"),
    ("all_to_all", "even"),
    ("all_to_all", "splits"),  # uneven, counts exchanged
    ("all_to_all", "both"),  # uneven, output_splits given
    ("all_to_all", "ragged"),  # ranks of different M, counts exchanged
    ("all_to_all", "ragged_given"),  # ranks of different M, every count given (rows_per_rank)
]


def check_gradients(
    rank: int, world: int, call, device: str, size: int = 1, tol: float | None = None, cases=GRADIENT_CASES
) -> None:
    """``call(a, weight, collective, weight_layout=, splits=, output_splits=, rows_per_rank=)`` with autograd on every
    rank of an initialised group, against :func:`collective_problem`: the result and the gradients
    of a and the weight, every collective and every way all-to-all takes its counts. ``tol``: rel.
    error bound (None: exact to float64 rounding)."""
    for collective, how in cases:
        seed = GRADIENT_CASES.index((collective, how))
        ragged = how in ("ragged", "ragged_given")
        problem = collective_problem(collective, world, seed, ragged=ragged, uneven=how != "even", size=size)
        a, w, splits, output_splits, y, g, grad_a, grad_w = problem[rank]
        dtype = torch.float64 if tol is None else torch.bfloat16
        kn = how == "kn"
        x = a.to(device, dtype).requires_grad_()
        weight = (w.t().contiguous() if kn else w).to(device, dtype).requires_grad_()
        counts = {}
        if collective == "all_to_all" and how != "even":
            counts = {"splits": splits, "output_splits": output_splits if how in ("both", "ragged_given") else None}
        if how == "ragged_given":
            counts["rows_per_rank"] = [len(problem[s][0]) for s in range(world)]
        out = call(x, weight, collective, weight_layout="kn" if kn else "nk", **counts)
        (out.double() * g.to(device)).sum().backward()
        got = {"result": (out, y), "grad a": (x.grad, grad_a), "grad w": (weight.grad, grad_w.t() if kn else grad_w)}
        for what, (value, want) in got.items():
            if tol is None:
                torch.testing.assert_close(value, want, msg=f"{collective} {how}: {what}")
            else:
                err = rel_err(value.cpu(), want)
                assert err < tol, f"{collective} {how} rank {rank}: {what} rel err {err:.2e}"
