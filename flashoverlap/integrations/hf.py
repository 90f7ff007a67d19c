"""Hugging Face transformers: overlap the row-parallel projections of a tensor-parallel model.

transformers (5.x) shards a model with its ``tp_plan`` through DTensor: every planned module's
parameters become DTensors and its ``forward`` is replaced by one that wraps the module's own
(``TensorParallelLayer.install_forward``). A ``"rowwise"`` linear (attention ``o_proj``, MLP
``down_proj``) holds the [out, in / world] shard of its weight and ends in an all-reduce: under
``torch.no_grad`` a local ``F.linear`` then ``dist.all_reduce``, with autograd a DTensor matmul
whose Partial result is redistributed to Replicate. :func:`patch` replaces that forward with one
overlapped call on the local shard (:func:`flashoverlap.with_gradients`: ``gemm_all_reduce`` on
CUDA with its autograd, the plain matmul + all-reduce on the CPU), keeping the style's own input
handling and output layout, so the model runs as before (``generate``, training) with the same
parameters and gradients (DTensors, sharded as the plan says).

Not patched: an MoE experts module (``"moe_tp_experts"``): its all-reduce follows a scatter-add of
per-expert GEMMs weighted by the router, not one GEMM, so there is no single matmul to overlap it
with; the plan's attention and dense MLP projections around it are patched. Row-parallel styles
whose output is not replicated (a sequence-parallel reduce-scatter) are refused.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from importlib import metadata
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

import flashoverlap  # (its names are read at call time: flashoverlap imports this module while it initialises)

from ..config import resolve
from ..rules import resolutions

if TYPE_CHECKING:
    from flashoverlap import OverlapConfig

SUPPORTED = (">=5.17", "<5.18")  # the transformers releases whose tensor parallelism this module follows
_ORIGINAL = "_flashoverlap_original_forward"  # where a patched module keeps transformers' forward


def _tensor_parallel():
    """transformers' tensor-parallel module, or a clear error where it is missing or of an unknown kind."""
    try:
        from transformers.distributed import tensor_parallel
    except ImportError as e:
        try:
            found = f"transformers {metadata.version('transformers')} is installed"
        except metadata.PackageNotFoundError:
            found = "transformers is not installed"
        raise ImportError(
            f"flashoverlap.patch needs transformers {','.join(SUPPORTED)} (DTensor tensor parallelism): {found}; "
            "pip install 'flashoverlap[hf]'"
        ) from e
    return tensor_parallel


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a DTensor parameter (differentiable: its gradient lands on the DTensor)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def row_parallel_linears(model: nn.Module) -> tuple[object, list[tuple[str, nn.Linear, object]]]:
    """The tensor-parallel mesh of ``model`` and its modules whose plan style is row-parallel
    (name, module, style). Refuses a model that is not sharded, and row-parallel modules this
    module cannot overlap (not an ``nn.Linear``, output not replicated, weight not sharded on its
    input features); warns of the MoE experts it leaves as they are."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tp = _tensor_parallel()
    mesh = getattr(model, "_device_mesh", None)
    plan = getattr(model, "tp_plan", None) if mesh is not None else None
    if mesh is None or not plan:
        raise ValueError(
            f"{type(model).__name__} is not tensor-parallel: load it with transformers' own plan, e.g. "
            "from_pretrained(..., tp_plan='auto') or distributed_config=DistributedConfig(tp_size=N)"
        )
    mesh = mesh["tp"] if mesh.ndim > 1 else mesh
    found, experts, refused = [], [], []
    for name, module in model.named_modules():
        style_name = plan.get(tp.replace_layer_number_by_wildcard(name)) if name else None
        style = tp.ALL_PARALLEL_STYLES.get(style_name) if style_name is not None else None
        if isinstance(style, tp.MoeExpertsParallel):
            experts.append(name)
        if not isinstance(style, tp.RowwiseParallel) or isinstance(module, nn.Embedding):
            continue  # (a row-parallel embedding is a lookup, no GEMM)
        weight = getattr(module, "weight", None)
        if type(module) is not nn.Linear:
            refused.append(f"{name}: a {type(module).__name__}, not an nn.Linear")
        elif style.output_layouts != Replicate():
            refused.append(f"{name}: its output is {style.output_layouts}, not replicated (all-reduced)")
        elif not (isinstance(weight, DTensor) and weight.placements == (Shard(1),)):
            refused.append(f"{name}: its weight is not sharded on its input features (DTensor Shard(1))")
        else:
            found.append((name, module, style))
    if refused:
        raise ValueError("row-parallel modules flashoverlap cannot overlap:\n  " + "\n  ".join(refused))
    if experts:
        warnings.warn(
            f"left as transformers runs them: {len(experts)} MoE experts modules (e.g. {experts[0]}); their "
            "all-reduce follows a scatter-add of per-expert GEMMs, not one GEMM",
            stacklevel=4,  # (the caller of patch)
        )
    if not found:
        raise ValueError(f"no row-parallel nn.Linear in the tensor-parallel plan of {type(model).__name__}")
    return mesh, found


def _check_shard(name: str, weight: torch.Tensor) -> None:
    """Refuse at patch time what the overlapped call would refuse at the first forward (CUDA)."""
    if weight.device.type != "cuda":
        return  # the plain path takes any dtype and shape
    n, k = weight.shape
    if weight.dtype not in (torch.bfloat16, torch.float16) or n % 8 or k % 8 or not weight.is_contiguous():
        raise ValueError(
            f"{name}: a weight shard {tuple(weight.shape)} of {weight.dtype}; the overlapped call needs bf16 or fp16, "
            "both dimensions multiples of 8 and a contiguous shard"
        )


def _forward(module: nn.Linear, style, mesh, matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """A row-parallel forward: the style's own input handling (this rank's shard of the input
    features, local), ``matmul(x [M, in/world], weight shard)`` for the reduced [M, out], the bias
    once, the output as the style hands it on (local, or a replicated DTensor)."""
    from torch.distributed.tensor import DTensor, Replicate

    def forward(x: torch.Tensor) -> torch.Tensor:
        (x,), _ = style.transform_inputs_pre_forward(module, (x,), {}, mesh)
        x = _local(x)
        weight = _local(module.weight)
        y = matmul(x.reshape(-1, x.shape[-1]).contiguous(), weight).view(*x.shape[:-1], weight.shape[0])
        if module.bias is not None:
            y = y + _local(module.bias)
        return y if style.use_local_output else DTensor.from_local(y, mesh, [Replicate()], run_check=False)

    return forward


def _replace(model: nn.Module, make_matmul: Callable[[object], Callable], check: bool) -> list[str]:
    mesh, found = row_parallel_linears(model)
    if check:
        for name, module, _ in found:
            _check_shard(name, _local(module.weight))
    matmul = make_matmul(mesh.get_group())
    for _, module, style in found:
        if not hasattr(module, _ORIGINAL):
            setattr(module, _ORIGINAL, module.forward)
        module.forward = _forward(module, style, mesh, matmul)
    return [name for name, _, _ in found]


def patch(model: nn.Module, *, config: OverlapConfig | dict | str | os.PathLike | None = None) -> list[str]:
    """Overlap the all-reduce of every row-parallel ``nn.Linear`` of a tensor-parallel transformers
    model with its GEMM; returns the patched module names (e.g. ``model.layers.0.self_attn.o_proj``).

    ``model``: loaded with transformers' own tensor parallelism (``from_pretrained(...,
    tp_plan="auto")``, ``distributed_config=DistributedConfig(tp_size=N)``, or
    :func:`tensor_parallel_from_config`). ``config``: the overlapped calls' config (None: the
    registry's for each shape), resolved and checked once, here: a bad one raises before the model
    runs, and every call takes the one config object (as a decided call's fast path needs). Patching
    again replaces the patch; :func:`unpatch` undoes it."""
    resolved = None if config is None else resolve(config)
    if resolved is not None:
        resolutions(resolved, "all_reduce")  # (raises where the config cannot run an all-reduce)
    return _replace(model, lambda group: _overlapped(group, resolved), check=True)


def _overlapped(group, config) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda x, weight: flashoverlap.with_gradients(x, weight, "all_reduce", group, config)


def without_collectives(model: nn.Module) -> list[str]:
    """Make every row-parallel linear skip its all-reduce (the local partial sums go on as they
    are): the results are wrong, the time is that of the model with its collectives all hidden,
    the bound an overlap approaches. For benchmarks; :func:`unpatch` undoes it."""
    return _replace(model, lambda group: F.linear, check=False)


def unpatch(model: nn.Module) -> list[str]:
    """Give the modules :func:`patch` or :func:`without_collectives` changed their transformers
    forward back; returns their names."""
    names = []
    for name, module in model.named_modules():
        if hasattr(module, _ORIGINAL):
            module.forward = getattr(module, _ORIGINAL)
            delattr(module, _ORIGINAL)
            names.append(name)
    return names


def tensor_parallel_from_config(
    config,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    seed: int = 0,
    head: bool = False,
) -> nn.Module:
    """A model built from ``config`` with random weights, sharded over every rank of the default
    group by transformers' own tensor parallelism (its ``base_model_tp_plan``), as
    ``from_pretrained(..., tp_plan="auto")`` would load a checkpoint of it: every rank builds the
    same full model (``seed``) on ``device``, then keeps its shard. ``head``: the causal-LM model
    (with ``lm_head``, for ``generate``), else the decoder stack alone."""
    import torch.distributed as dist
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    _tensor_parallel()
    world = dist.get_world_size()
    device = torch.device(device if device is not None else "cpu")
    torch.manual_seed(seed)
    with torch.device(device):
        model = (AutoModelForCausalLM if head else AutoModel).from_config(config, dtype=dtype)
    mesh = dist.init_device_mesh(device.type, (world,))
    model = type(model).maybe_distribute_model(model, DistributedConfig(tp_size=world), mesh)
    return model.eval()
