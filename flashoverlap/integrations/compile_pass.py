"""torch.compile: an inductor pass that runs a matmul and the collective of its result as one
overlapped call.

DTensor tensor parallelism (``RowwiseParallel``, torchtitan) and functional collectives compile to
graphs where a GEMM's partial sums go straight into a collective::

    mm(a, b) -> [view / reshape ...] -> _c10d_functional.all_reduce(x, "sum", group) -> wait_tensor
    mm(a, b) -> [view / reshape ...] -> _c10d_functional.reduce_scatter_tensor(x, "sum", world, group) -> wait_tensor

in the forward graph (a row-parallel linear) and in the backward graph (the input gradient of a
column-parallel linear). After AOT autograd has split them, this post-grad pass replaces each such
chain with the operator ``flashoverlap::gemm_collective`` (the call ``gemm_all_reduce`` /
``gemm_reduce_scatter`` makes), its config the registry's for each shape. Opt in with
:func:`install` (or set ``torch._inductor.config.post_grad_custom_post_pass`` to an
:class:`OverlapPass`; another pass of yours can call :func:`rewrite` on its graph).

A chain is left as it is where the overlapped call could not take it: operands not bf16 / fp16,
N or K not a multiple of 8 or not known when compiling, a reduction other than a sum, a
reduce-scatter whose rows do not split evenly, or a GEMM result (or a view of it on the way) that
something else also reads. The reduce-scatter scatters dimension 0 of the collective's input: the
views between it and the GEMM are row-major reshapes of the [M, N] result, so its rows stay whole
blocks of the GEMM's rows.
"""

from __future__ import annotations

import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, Node

import flashoverlap  # noqa: F401  (defines the operator)

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
COLLECTIVES = {_c10d.all_reduce.default: "all_reduce", _c10d.reduce_scatter_tensor.default: "reduce_scatter"}
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
TRANSPOSES = (aten.permute.default, aten.t.default)
DTYPES = (torch.bfloat16, torch.float16)


class OverlapPass(CustomGraphPass):
    """The pass as inductor takes it; ``rewritten`` lists what it replaced in every graph so far,
    as ``"<collective>(<mm node>)"``."""

    def __init__(self) -> None:
        self.rewritten: list[str] = []

    def __call__(self, graph: Graph) -> None:
        self.rewritten += rewrite(graph)

    def uuid(self) -> bytes:  # inductor's cache key: this file's text
        return get_hash_for_files((__file__,))


def install() -> OverlapPass:
    """Rewrite the graphs inductor compiles from now on; returns the pass. Refuses to replace a
    post-grad pass of another kind (call :func:`rewrite` from it instead)."""
    current = inductor_config.post_grad_custom_post_pass
    if current is not None and not isinstance(current, OverlapPass):
        raise RuntimeError(
            f"torch._inductor.config.post_grad_custom_post_pass is already {current!r}: call "
            "flashoverlap.integrations.compile_pass.rewrite(graph) from it instead"
        )
    inductor_config.post_grad_custom_post_pass = OverlapPass()
    return inductor_config.post_grad_custom_post_pass


def uninstall() -> None:
    """Stop rewriting graphs compiled from now on (those compiled already keep the operator)."""
    if isinstance(inductor_config.post_grad_custom_post_pass, OverlapPass):
        inductor_config.post_grad_custom_post_pass = None


def _val(node) -> torch.Tensor | None:
    return node.meta.get("val") if isinstance(node, Node) else None


def _only_user(node: Node, user: Node) -> bool:
    return len(node.users) == 1 and user in node.users


def _call(graph: Graph, target, *args, **kwargs) -> Node:
    """A new node with its fake value (what inductor's lowering reads), from its arguments'."""
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = target(*[a.meta["val"] if isinstance(a, Node) else a for a in args], **kwargs)
    return node


def _contiguous(graph: Graph, node: Node) -> Node:
    if node.meta["val"].is_contiguous():
        return node
    return _call(graph, aten.clone.default, node, memory_format=torch.contiguous_format)


def _weight(graph: Graph, b: Node) -> tuple[Node, str]:
    """The GEMM's [K, N] operand as the operator takes it: the [N, K] tensor it is a transpose of
    ("nk", e.g. a linear's weight), else itself, contiguous ("kn")."""
    if b.target in TRANSPOSES and (b.target is aten.t.default or list(b.args[1]) == [1, 0]):
        w = b.args[0]
        if isinstance(w, Node) and _val(w) is not None and _val(w).dim() == 2 and _val(w).is_contiguous():
            return w, "nk"
    return _contiguous(graph, b), "kn"


def _static(*sizes) -> bool:
    return all(isinstance(s, int) for s in sizes)


def _match(wait: Node) -> tuple[Node, Node, list[Node], str, str] | None:
    """(collective, mm, views from mm on, collective kind, group) of a chain the operator can
    replace, ending in ``wait``; else None."""
    coll = wait.args[0] if wait.args else None
    if not isinstance(coll, Node) or coll.target not in COLLECTIVES or not _only_user(coll, wait):
        return None
    kind, reduce_op, group = COLLECTIVES[coll.target], coll.args[1], coll.args[-1]
    if reduce_op != "sum" or not isinstance(group, str):
        return None
    views, node, user = [], coll.args[0], coll
    while isinstance(node, Node) and node.target in VIEWS and _only_user(node, user):
        views.append(node)
        node, user = node.args[0], node
    if not isinstance(node, Node) or node.target is not aten.mm.default or not _only_user(node, user):
        return None
    a, b, out = _val(node.args[0]), _val(node.args[1]), _val(node)
    if a is None or b is None or a.dtype not in DTYPES or b.dtype != a.dtype:
        return None
    (m, k), n = a.shape, b.shape[1]
    if not _static(n, k) or n % 8 or k % 8:
        return None
    if kind == "reduce_scatter":
        world, scattered = coll.args[2], _val(coll.args[0]).shape
        # (the call scatters the GEMM's rows: M must split too, not only the viewed tensor's first dim)
        if not _static(m, world, *scattered) or scattered[0] % world or m % world or out.numel() == 0:
            return None
    return coll, node, views[::-1], kind, group


def rewrite(graph: Graph) -> list[str]:
    """Replace every GEMM + all-reduce / reduce-scatter chain of ``graph`` that the overlapped call
    takes with ``flashoverlap::gemm_collective``; returns what it replaced (see :class:`OverlapPass`)."""
    done = []
    for wait in list(graph.find_nodes(op="call_function", target=_c10d.wait_tensor.default)):
        found = _match(wait)
        if found is None:
            continue
        coll, mm, views, kind, group = found
        with graph.inserting_before(mm):
            a = _contiguous(graph, mm.args[0])
            weight, layout = _weight(graph, mm.args[1])
            op = torch.ops.flashoverlap.gemm_collective.default
            fused = _call(graph, op, a, weight, kind, group, "", layout, None, None)  # ("": the registry's config)
            result = fused
        if kind == "all_reduce" and views:  # the same views, now of the reduced rows
            views[0].replace_input_with(mm, fused)
            result = views[-1]
        elif views:  # [d0, ...] scattered on d0: [d0 / world, ...], whole blocks of the GEMM's rows
            shape = list(_val(coll.args[0]).shape)
            shape[0] //= coll.args[2]
            with graph.inserting_after(fused):
                result = _call(graph, aten.reshape.default, fused, shape)
        wait.replace_all_uses_with(result)
        for node in [wait, coll, *(views[::-1] if kind == "reduce_scatter" else []), mm, mm.args[1]]:
            if not node.users and node.op == "call_function":
                graph.erase_node(node)
        done.append(f"{kind}({mm.name})")
    return done
