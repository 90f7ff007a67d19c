"""flashoverlap.nn on the CPU (gloo, 2 ranks, the plain path with the same autograd)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flashoverlap.nn import (
    FP8,
    FP8_MAX,
    ColumnParallelLinear,
    RowParallelLinear,
    swap_column_parallel,
    swap_row_parallel,
)

from .helpers import check_column_parallel, spawn_ranks

T, K, N = 12, 16, 10  # tokens, input features (split over ranks), output features


def full_problem():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, K, generator=gen, dtype=torch.float64)
    w = torch.randn(N, K, generator=gen, dtype=torch.float64)
    b = torch.randn(N, generator=gen, dtype=torch.float64)
    g = torch.randn(T, N, generator=gen, dtype=torch.float64)  # d loss / d y
    return x, w, b, g


def worker(rank: int, world: int, store_path: str):
    """RowParallelLinear: the unsharded layer's input features split over the ranks."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        x, w, b, g = full_problem()
        cols = slice(rank * K // world, (rank + 1) * K // world)
        for sequence_parallel in (False, True):
            layer = RowParallelLinear(K // world, N, sequence_parallel=sequence_parallel, dtype=torch.float64)
            with torch.no_grad():
                layer.weight.copy_(w[:, cols])
                layer.bias.copy_(b)
            xr = x[:, cols].clone().requires_grad_()
            y = layer(xr)
            rows = slice(rank * T // world, (rank + 1) * T // world) if sequence_parallel else slice(None)
            torch.testing.assert_close(y, (x @ w.t() + b)[rows])
            (y * g[rows]).sum().backward()  # each rank's share of one global loss
            torch.testing.assert_close(xr.grad, (g @ w)[:, cols])
            torch.testing.assert_close(layer.weight.grad, (g.t() @ x)[:, cols])
            torch.testing.assert_close(layer.bias.grad, g.sum(0))
        # [s, b, h] input with sequence parallelism: the sequence is split
        layer = RowParallelLinear(K // world, N, sequence_parallel=True, dtype=torch.float64)
        assert layer(torch.randn(4, 3, K // world, dtype=torch.float64)).shape == (4 // world, 3, N)
        with pytest.raises(ValueError, match="splits the first dimension over 2 ranks"):
            layer(torch.randn(3, K // world, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"expected input \[\.\.\., 8\]"):
            layer(torch.randn(4, K, dtype=torch.float64))
    finally:
        dist.destroy_process_group()


def column_worker(rank: int, world: int, store_path: str):
    """ColumnParallelLinear: the unsharded layer's output features split over the ranks."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        check_column_parallel(rank, world, "cpu", tol=1e-12)
        layer = ColumnParallelLinear(N, N // world, sequence_parallel=True, dtype=torch.float64)
        assert layer(torch.randn(2, 3, N, dtype=torch.float64)).shape == (2 * world, 3, N // world)
        assert "all-reduce of the input gradient" in repr(ColumnParallelLinear(N, 2, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"expected input \[\.\.\., 10\]"):
            layer(torch.randn(4, K, dtype=torch.float64))
    finally:
        dist.destroy_process_group()


def quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` quantized per tensor to FP8 as the layers quantize their input: (values, scale)."""
    scale = (x.abs().amax().float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` quantized per row to FP8 (a weight's output channels, an input's tokens): (values, [rows, 1] scales)."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_worker(rank: int, world: int, store_path: str):
    """RowParallelLinear.from_fp8: each rank's FP8 shard and its input, quantized per tensor (as it
    comes, or with a static scale, or already FP8), summed over the ranks; against every rank's
    dequantized product, and the unquantized layer within FP8's error."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        tokens, k, n = 8, 32 * world, 16
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, k, generator=gen)
        w = torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen).to(torch.bfloat16)
        shard = [slice(r * k // world, (r + 1) * k // world) for r in range(world)]
        weights = [quantized(w[:, cols]) for cols in shard]  # every rank's (values, scale)
        w8, w_scale = weights[rank]

        def dequantized(x8: torch.Tensor, x_scale: torch.Tensor, r: int) -> torch.Tensor:
            return (x8.float() * x_scale) @ (weights[r][0].float() * weights[r][1]).t()

        layer = RowParallelLinear.from_fp8(w8, w_scale, bias=b)
        assert layer.weight.dtype == FP8 and not layer.weight.requires_grad and "float8_e4m3fn weight" in repr(layer)
        with torch.no_grad():
            y = layer(x[:, shard[rank]].to(torch.bfloat16))
            want = sum(dequantized(*quantized(x[:, cols].to(torch.bfloat16)), r) for r, cols in enumerate(shard))
            torch.testing.assert_close(y, want.to(torch.bfloat16) + b)  # (the bias added to the bf16 result)
            assert y.dtype == torch.bfloat16 and ((y.float() - x @ w.t() - b.float()).norm() / y.float().norm()) < 0.1
            # a static input scale, and FP8 input with it
            xh = x.half()
            x_scale = torch.tensor(xh.abs().max().item() / FP8_MAX)
            static = RowParallelLinear.from_fp8(w8, w_scale, input_scale=x_scale, out_dtype=torch.float16)
            x8 = (xh.float() / x_scale).to(FP8)
            want = sum(dequantized(x8[:, cols], x_scale, r) for r, cols in enumerate(shard)).to(torch.float16)
            torch.testing.assert_close(static(xh[:, shard[rank]]), want)
            torch.testing.assert_close(static(x8[:, shard[rank]]), want)
            with pytest.raises(ValueError, match="float8_e4m3fn input needs the layer's input_scale"):
                layer(x8[:, shard[rank]])
            # sequence parallel: this rank's rows of the sum, [s, b, h] split along s, then the bias
            split = RowParallelLinear.from_fp8(w8, w_scale, bias=b, sequence_parallel=True)
            xb = x.to(torch.bfloat16)
            y = split(xb[:, shard[rank]].reshape(4, 2, -1))
            want = sum(dequantized(*quantized(xb[:, cols]), r) for r, cols in enumerate(shard)).to(torch.bfloat16) + b
            torch.testing.assert_close(y, want.view(4, 2, n)[rank * 4 // world : (rank + 1) * 4 // world])
            assert layer(xb[:0, shard[rank]]).shape == (0, n)  # no rows
            # channel weight scales ([n, 1] or [n]): the input quantized per token, rowwise scales
            channels = [quantized_rows(w[:, cols]) for cols in shard]
            for kept in (channels[rank][1], channels[rank][1].reshape(n)):
                rowwise = RowParallelLinear.from_fp8(channels[rank][0], kept, bias=b)
                y = rowwise(xb[:, shard[rank]])
                parts = [quantized_rows(xb[:, cols]) for cols in shard]
                want = sum((p8.float() * ps) @ (c8.float() * cs).t() for (p8, ps), (c8, cs) in zip(parts, channels))
                torch.testing.assert_close(y, want.to(torch.bfloat16) + b)
                assert ((y.float() - x @ w.t() - b.float()).norm() / y.float().norm()) < 0.1
            static = RowParallelLinear.from_fp8(channels[rank][0], channels[rank][1], input_scale=x_scale)
            want = sum((x8[:, c].float() * x_scale) @ (c8.float() * cs).t() for c, (c8, cs) in zip(shard, channels))
            torch.testing.assert_close(static(x8[:, shard[rank]]), want.to(torch.bfloat16))
            assert rowwise(xb[:0, shard[rank]]).shape == (0, n)
            with pytest.raises(ValueError, match="FP8 layers take torch.bfloat16, torch.float16, torch.float8_e4m3fn"):
                layer(x[:, shard[rank]])
        with pytest.raises(ValueError, match="FP8 layers have no backward"):
            layer(xb[:, shard[rank]].requires_grad_())
        layer.to(torch.bfloat16)  # (converts the FP8 weight and its scale too)
        with pytest.raises(ValueError, match="weight is torch.bfloat16 and its weight_scale torch.bfloat16 now"):
            with torch.no_grad():
                layer(xb[:, shard[rank]])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fn", [worker, column_worker, fp8_worker], ids=["row", "column", "fp8"])
def test_parallel_linears_forward_and_backward_match_the_unsharded_layer(fn):
    spawn_ranks(2, fn)


W8, SCALE = torch.zeros(16, 32).to(FP8), torch.ones(())


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        ((W8.bfloat16(), SCALE), {}, ValueError, r"weight must be a 2-D torch.float8_e4m3fn .*got torch.bfloat16"),
        ((W8[:, :24], SCALE), {}, ValueError, r"multiples of 16, got torch.float8_e4m3fn of shape \(16, 24\)"),
        ((W8, SCALE.double()), {}, ValueError, "weight_scale must be one float32 value .*got torch.float64"),
        ((W8, 1.0), {}, TypeError, "weight_scale must be a torch.Tensor, got float"),
        ((W8, SCALE), {"input_scale": torch.ones(2)}, ValueError, r"input_scale must be .* of shape \(2,\)"),
        ((W8, SCALE), {"out_dtype": torch.float32}, ValueError, "out_dtype must be one of torch.bfloat16"),
        ((W8, SCALE), {"bias": torch.zeros(8)}, ValueError, r"bias must be \[16\] of torch.bfloat16"),
        ((W8, SCALE), {"use_fast_accum": 1}, TypeError, "use_fast_accum must be a bool, got int"),
        ((W8, SCALE), {"group": "tp"}, TypeError, "group must be a torch.distributed ProcessGroup"),
        ((W8, torch.ones(16, 1)), {"out_dtype": torch.float16}, ValueError, "channel weight scales give a bfloat16"),
        ((W8, torch.ones(17)), {}, ValueError, r"or float32 \[16, 1\] / \[16\] \(per output channel\)"),
        ((W8, torch.ones(16, 2)), {}, ValueError, r"\[16, 1\] / \[16\] \(per output channel\), got .*\(16, 2\)"),
        ((W8, torch.ones(16, 1, dtype=torch.float64)), {}, ValueError, "per output channel"),
        ((W8, torch.ones(32, 1)[::2]), {}, ValueError, "weight_scale must be contiguous"),
    ],
)
def test_fp8_layers_refuse_what_they_cannot_run(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        RowParallelLinear.from_fp8(*args, **kwargs)


def test_fp8_layers_are_made_from_their_quantized_weights():
    with pytest.raises(ValueError, match=r"RowParallelLinear.from_fp8\(weight, weight_scale"):
        RowParallelLinear(32, 16, dtype=FP8)
    linear = nn.Linear(32, 16)
    linear.weight.data = linear.weight.data.to(FP8)
    with pytest.raises(ValueError, match=r"an FP8 weight takes its scale: RowParallelLinear.from_fp8"):
        RowParallelLinear.from_linear(linear)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        RowParallelLinear.from_fp8(torch.zeros(32, 16).to(FP8).t(), torch.ones(()))


def compile_worker(rank: int, world: int, store_path: str):
    """Both layers compiled whole (``fullgraph=True``: a graph break fails), forward and backward,
    against the same layers run eagerly."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(rank)
        for cls in (RowParallelLinear, ColumnParallelLinear):
            for sequence_parallel in (False, True):
                layer = cls(K, N, sequence_parallel=sequence_parallel, dtype=torch.float64)
                x = torch.randn(T, K, generator=gen, dtype=torch.float64)
                runs = []
                # compiled first: the first call of a fresh process is traced (no group facts cached)
                for run in (torch.compile(layer, fullgraph=True, backend="aot_eager"), layer):
                    xr = x.clone().requires_grad_()
                    y = run(xr)
                    y.pow(2).sum().backward()
                    runs.append((y, xr.grad, layer.weight.grad, layer.bias.grad))
                    layer.zero_grad(set_to_none=True)
                for traced, eager in zip(*runs):
                    torch.testing.assert_close(traced, eager)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_parallel_linears_compile_without_graph_breaks():
    spawn_ranks(2, compile_worker, timeout=240)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.o_proj = nn.Linear(8, 8), nn.Linear(8, 8, bias=False)
        self.mlp = nn.ModuleDict({"up_proj": nn.Linear(8, 16), "down_proj": nn.Linear(16, 8), "act": nn.GELU()})


def test_swap_replaces_matching_linears_and_shares_their_parameters():
    model = nn.ModuleList([Block(), Block()])
    weight = model[1].mlp["down_proj"].weight
    names = swap_row_parallel(model, ["*.o_proj", "*.down_proj"], sequence_parallel=True)
    assert names == ["0.o_proj", "0.mlp.down_proj", "1.o_proj", "1.mlp.down_proj"]
    swapped = model[1].mlp["down_proj"]
    assert isinstance(swapped, RowParallelLinear) and swapped.weight is weight and swapped.sequence_parallel
    assert model[0].o_proj.bias is None and isinstance(model[0].q_proj, nn.Linear)
    assert swap_row_parallel(model, lambda name, m: name == "0.q_proj") == ["0.q_proj"]
    with pytest.raises(ValueError, match="0.mlp.act is a GELU, not an nn.Linear"):
        swap_row_parallel(model, "*.act")
    with pytest.raises(TypeError, match="unexpected arguments"):
        swap_row_parallel(nn.Sequential(nn.Linear(2, 2)), "0", bogus=1)
    up = model[0].mlp["up_proj"]
    assert swap_column_parallel(model, ["*.up_proj"], config={"comm_sms": 8}) == ["0.mlp.up_proj", "1.mlp.up_proj"]
    swapped = model[0].mlp["up_proj"]
    assert isinstance(swapped, ColumnParallelLinear) and swapped.weight is up.weight and swapped.bias is up.bias
    assert swapped.config == {"comm_sms": 8} and not swapped.sequence_parallel


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"config": {"tile_mm": 128}}, ValueError, r"unknown key\(s\) \['tile_mm'\]"),
        ({"config": "no/such/config.yaml"}, FileNotFoundError, "config file not found: no/such/config.yaml"),
        ({"config": {"layout": "segments"}}, ValueError, "all_reduce takes 'rows', 'tiles' or 'cols'"),
        ({"config": {"layout": "tiles"}, "sequence_parallel": True}, ValueError, "reduce_scatter needs layout"),
        ({"group": "tp"}, TypeError, "group must be a torch.distributed ProcessGroup or None, got str 'tp'"),
    ],
)
@pytest.mark.parametrize("cls", [RowParallelLinear, ColumnParallelLinear])
def test_a_bad_group_or_config_is_refused_when_the_layer_is_made(cls, kwargs, error, message):
    """On the CPU the layers run the plain path, which takes no config: what the GPU's call would
    refuse is refused here too, when the layer is made (no process group needed)."""
    with pytest.raises(error, match=message):
        cls(16, 8, **kwargs)
    with pytest.raises(error, match=message):
        cls.from_linear(nn.Linear(16, 8), **kwargs)
    with pytest.raises(error, match=message):
        (swap_row_parallel if cls is RowParallelLinear else swap_column_parallel)(Block(), ["o_proj"], **kwargs)


def test_a_swap_that_replaces_nothing_warns():
    model = Block()
    with pytest.warns(UserWarning, match=r"swap_row_parallel: no module matched \['\*\.o_proj'\].*: q_proj, o_proj"):
        assert swap_row_parallel(model, ["*.o_proj"]) == []  # (top-level modules have no dot)
    with pytest.warns(UserWarning, match="swap_column_parallel: no module matched the predicate"):
        assert swap_column_parallel(model, lambda name, module: False) == []
    assert isinstance(model.o_proj, nn.Linear)
