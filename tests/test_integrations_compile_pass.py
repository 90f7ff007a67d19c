"""flashoverlap.integrations.compile_pass: DTensor tensor parallelism under torch.compile, its
GEMM + collective chains rewritten into flashoverlap::gemm_collective (the graphs inspected) and
the results against the model run eagerly, forward and backward: on the CPU over gloo (2 ranks,
the operator's plain path) and on every visible GPU (NCCL, the overlapped call)."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._inductor import config as inductor_config

from flashoverlap.integrations import compile_pass

from .helpers import rel_err, spawn_ranks

OP = "flashoverlap.gemm_collective"


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int, device) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, inner, bias=False, device=device, dtype=torch.bfloat16)
        self.down = nn.Linear(inner, hidden, bias=False, device=device, dtype=torch.bfloat16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@contextlib.contextmanager
def compiling(passes: compile_pass.OverlapPass):
    """Inductor with ``passes``, compiling afresh (a graph from the caches would skip the pass)."""
    torch._dynamo.reset()
    with (
        inductor_config.patch(post_grad_custom_post_pass=passes, fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield


class Recording(compile_pass.OverlapPass):
    """The pass, keeping each graph's code after it ran and the weight layouts its operators take."""

    def __init__(self) -> None:
        super().__init__()
        self.graphs: list[str] = []
        self.layouts: list[list[str]] = []

    def __call__(self, graph) -> None:
        super().__call__(graph)
        self.graphs.append(str(graph))
        ops = graph.find_nodes(op="call_function", target=torch.ops.flashoverlap.gemm_collective.default)
        self.layouts.append([node.args[5] for node in ops])


def check_tensor_parallel_mlp(world: int, device: str, hidden: int, inner: int, tokens: int, tol: float) -> None:
    """Colwise up + rowwise down (DTensor), compiled with the pass: the forward's all-reduce (row-
    parallel) and the backward's (the column-parallel input gradient) become the operator; output
    and gradients as eagerly, within bf16 rounding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device, (world,))
    torch.manual_seed(0)  # the same full layers on every rank
    model = parallelize_module(MLP(hidden, inner, device), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(2, tokens // 2, hidden, device=device, dtype=torch.bfloat16)
    passes = Recording()
    with compiling(passes):
        compiled = torch.compile(model)
        xc = x.clone().requires_grad_()
        y = compiled(xc)
        y.float().square().sum().backward()
    assert [what.split("(")[0] for what in passes.rewritten] == ["all_reduce", "all_reduce"], passes.rewritten
    for graph in passes.graphs:
        assert OP in graph and "_c10d_functional.all_reduce" not in graph, graph
    assert passes.layouts[0] == ["nk"] and len(passes.layouts[1]) == 1  # the forward's: the weight as it is
    grads = [p.grad.to_local().clone() for p in model.parameters()]
    model.zero_grad()
    xe = x.clone().requires_grad_()
    want = model(xe)
    want.float().square().sum().backward()
    assert rel_err(y, want.float()) < tol
    assert rel_err(xc.grad, xe.grad.float()) < tol
    for got, p in zip(grads, model.parameters()):
        assert rel_err(got, p.grad.to_local().float()) < tol


def check_reduce_scatter(world: int, device: str, tol: float) -> None:
    """A [b, s, k] @ W^T (mm and a view) reduce-scattered on b by the functional collective: the
    operator with a reshape of its rows; an fp32 GEMM and a mean are left alone."""
    from torch.distributed import _functional_collectives as funcol

    group = dist.group.WORLD

    def scattered(x, w):
        return funcol.reduce_scatter_tensor(x @ w.t(), "sum", 0, group)

    def left(x, w):
        return funcol.all_reduce(x.float() @ w.float().t(), "sum", group), funcol.all_reduce(x @ w.t(), "avg", group)

    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randn(2 * world, 8, 64, device=device, generator=gen).bfloat16()
    w = torch.randn(32, 64, device=device, generator=gen).bfloat16()
    passes = Recording()
    with compiling(passes):
        got = torch.compile(scattered)(x, w)
        torch.compile(left)(x, w)
    assert [what.split("(")[0] for what in passes.rewritten] == ["reduce_scatter"], passes.rewritten
    assert OP in passes.graphs[0] and OP not in passes.graphs[1]
    want = scattered(x, w)
    assert got.shape == want.shape == (2, 8, 32)
    assert rel_err(got, want.float()) < tol


def cpu_worker(rank: int, world: int, store_path: str):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        check_tensor_parallel_mlp(world, "cpu", hidden=64, inner=128, tokens=16, tol=2e-2)
        check_reduce_scatter(world, "cpu", tol=2e-2)
    finally:
        dist.destroy_process_group()


def test_compiled_tensor_parallel_graphs_are_rewritten_and_match_eager():
    spawn_ranks(2, cpu_worker, timeout=600)


def test_install_sets_and_refuses_a_foreign_pass(monkeypatch):
    monkeypatch.setattr(inductor_config, "post_grad_custom_post_pass", None)
    installed = compile_pass.install()
    assert inductor_config.post_grad_custom_post_pass is installed and isinstance(installed, compile_pass.OverlapPass)
    assert compile_pass.install() is not installed  # (a fresh one replaces ours)
    compile_pass.uninstall()
    assert inductor_config.post_grad_custom_post_pass is None
    monkeypatch.setattr(inductor_config, "post_grad_custom_post_pass", print)
    with pytest.raises(RuntimeError, match="is already <built-in function print>: call"):
        compile_pass.install()
    compile_pass.uninstall()
    assert inductor_config.post_grad_custom_post_pass is print


def gpu_worker(rank: int, world: int, store_path: str):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:  # several waves: 4096 tokens x 2048 features
        check_tensor_parallel_mlp(world, "cuda", hidden=2048, inner=2048 * world, tokens=4096, tol=3e-2)
        check_reduce_scatter(world, "cuda", tol=3e-2)
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


@pytest.mark.multigpu
def test_compiled_tensor_parallel_graphs_on_all_gpus():
    spawn_ranks(torch.cuda.device_count(), gpu_worker, timeout=600)


@pytest.mark.parametrize(("m", "view", "taken"), [(8, (8, 64), True), (6, (12, 32), False)])
def test_a_reduce_scatter_is_taken_only_where_the_gemm_rows_split(m, view, taken):
    """The call scatters the GEMM's M rows over the ranks: a chain whose view splits (12 rows of 32
    over 4 ranks) but whose GEMM's 6 rows do not is left as it is, not rewritten into a call that
    would fail."""
    from torch.fx import Graph

    from flashoverlap.integrations import compile_pass

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    graph = Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    a.meta["val"], b.meta["val"] = torch.empty(m, 16, dtype=torch.bfloat16), torch.empty(16, 64, dtype=torch.bfloat16)
    mm = graph.call_function(aten.mm.default, (a, b))
    mm.meta["val"] = torch.empty(m, 64, dtype=torch.bfloat16)
    shaped = graph.call_function(aten.view.default, (mm, list(view)))
    shaped.meta["val"] = torch.empty(*view, dtype=torch.bfloat16)
    scatter = graph.call_function(c10d.reduce_scatter_tensor.default, (shaped, "sum", 4, "0"))
    wait = graph.call_function(c10d.wait_tensor.default, (scatter,))
    graph.output(wait)
    assert (compile_pass._match(wait) is not None) == taken
