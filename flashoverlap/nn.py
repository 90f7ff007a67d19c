"""PyTorch modules: tensor-parallel linears whose collective is overlapped with a GEMM.

A row-parallel linear (Megatron's ``RowParallelLinear``; ``o_proj`` / ``down_proj`` of a TP-split
Llama block) computes ``x_local @ W_local.T`` on every rank and then all-reduces (or, with
sequence parallelism, reduce-scatters) the partial sums: :class:`RowParallelLinear` does both in
one overlapped call. A column-parallel linear (``q/k/v_proj``, ``gate/up_proj``) needs its
collective in the backward pass: the input gradient ``grad_y_local @ W_local`` is a partial sum,
all-reduced (reduce-scattered with sequence parallelism), and :class:`ColumnParallelLinear` runs
that GEMM and collective as one overlapped call. :func:`swap_row_parallel` and
:func:`swap_column_parallel` put them in place of the ``nn.Linear`` modules of an existing model.

Gradients (autograd), for a loss of the full output:
* row-parallel, all-reduce: y = sum_r x_r W_r^T + b is replicated, so grad_x_r = grad_y W_r and
  grad_W_r = grad_y^T x_r need no collective; grad_b = sum of grad_y over rows (replicated).
* row-parallel, reduce-scatter (``sequence_parallel=True``): rank r holds rows r of y; backward
  all-gathers grad_y, then grad_x_r = grad_y W_r and grad_W_r = grad_y^T x_r; the bias is added to
  every shard, so its gradient is all-reduced over the group (every rank gets the full gradient).
* column-parallel: y_r = x W_r^T + b_r (x replicated; with ``sequence_parallel=True`` all-gathered
  from the ranks' sequence shards first); grad_x = sum_r grad_y_r W_r (all-reduced, or
  reduce-scattered back to the sequence shards: overlapped), grad_W_r = grad_y_r^T x and
  grad_b_r = grad_y_r summed over rows, no collective.

:meth:`RowParallelLinear.from_fp8` makes an inference layer over an FP8 weight shard quantized per
tensor or per output channel (float8_e4m3fn, ``weight_scale``): the input is quantized as it comes
(per tensor, or per token beside channel scales) or with a static ``input_scale``, and multiplied
as ``torch._scaled_mm`` does (rowwise scales for channel ones), the collective overlapped.

CPU tensors take the plain path (``F.linear`` + the torch collective, e.g. over gloo) with the
same autograd, so models can be debugged without GPUs (FP8 layers: the dequantized operands
multiplied in float32). Under ``torch.compile`` the layers stay in
one graph (the overlapped call is one operator in it); inside CUDA graphs they can be captured and
replayed (see the README).
"""

from __future__ import annotations

import fnmatch
import os
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import overlap
from .comm import gathered_rows
from .config import OverlapConfig, resolve
from .inputs import DTYPES, FP8_DTYPES, check_group, check_inputs, check_scale, world_size
from .overlap import with_gradients
from .rules import resolutions

FP8 = torch.float8_e4m3fn  # FP8 layers' weights and quantized inputs (torch._scaled_mm has no e5m2 x e5m2)
FP8_MAX = torch.finfo(FP8).max


def _collective(sequence_parallel: bool) -> str:
    return "reduce_scatter" if sequence_parallel else "all_reduce"


def _check(group, config, sequence_parallel: bool) -> None:
    """Refuse a group or config the overlapped call would refuse, when the layer is made: on the
    CPU its plain path takes neither (a bad one would fail first on GPUs)."""
    check_group(group)
    if config is not None:
        resolutions(resolve(config), _collective(sequence_parallel))


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, config, sequence_parallel):
        # With sequence parallelism only this rank's shard is kept and gathered again for the
        # weight gradient (as Megatron does): keeping the gathered input would hold world times
        # the activation memory sequence parallelism exists to save.
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.config, ctx.sequence_parallel = group, config, sequence_parallel
        return F.linear(gathered_rows(x, group) if sequence_parallel else x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # weight [out, in] is the [K, N] operand of grad_out @ weight
            grad_x = with_gradients(grad_out, weight, _collective(ctx.sequence_parallel), ctx.group, ctx.config, "kn")
        if ctx.needs_input_grad[1]:
            grad_w = grad_out.t() @ (gathered_rows(x, ctx.group) if ctx.sequence_parallel else x)
        return grad_x, grad_w, None, None, None


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; all-reduces the gradient (a replicated parameter used on every shard)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


_Linear = TypeVar("_Linear", bound="_ParallelLinear")


class _ParallelLinear(nn.Module):
    """What both tensor-parallel linears share: this rank's weight shard [out_features,
    in_features], an optional bias, the group, sequence parallelism and the overlapped call's
    config (None: the registry's, see the README)."""

    _collective_of = ""  # what the collective applies to, for extra_repr

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        config: OverlapConfig | dict | str | os.PathLike | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = torch.bfloat16,
    ) -> None:
        super().__init__()
        if dtype in FP8_DTYPES:
            raise ValueError(
                f"dtype {dtype}: FP8 layers hold quantized weights, made with "
                "RowParallelLinear.from_fp8(weight, weight_scale, ...)"
            )
        _check(group, config, sequence_parallel)
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel, self.config = group, sequence_parallel, config
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    @classmethod
    def from_linear(cls: type[_Linear], linear: nn.Linear, **kwargs) -> _Linear:
        """A module sharing ``linear``'s parameters (its weight is this rank's shard)."""
        group = kwargs.pop("group", None)
        sequence_parallel = kwargs.pop("sequence_parallel", False)
        config = kwargs.pop("config", None)
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        if linear.weight.dtype in FP8_DTYPES:
            raise ValueError("an FP8 weight takes its scale: RowParallelLinear.from_fp8(weight, weight_scale, ...)")
        module = cls._bare(linear.in_features, linear.out_features, group, sequence_parallel, config)
        module.weight, module.bias = linear.weight, linear.bias
        return module

    @classmethod
    def _bare(
        cls: type[_Linear], in_features: int, out_features: int, group, sequence_parallel: bool, config
    ) -> _Linear:
        """A module of these features, group, sequence parallelism and config (checked), without
        parameters yet."""
        _check(group, config, sequence_parallel)
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = in_features, out_features
        module.group, module.sequence_parallel, module.config = group, sequence_parallel, config
        return module

    def _rows(self, x: torch.Tensor, split: bool) -> tuple[torch.Size, int]:
        """Check ``x`` [..., in_features] (with sequence parallelism, a first dimension that is
        ``split`` over the ranks); its leading dimensions and the group's size."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input [..., {self.in_features}], got {tuple(x.shape)}")
        lead, world = x.shape[:-1], world_size(self.group)
        if self.sequence_parallel and (not lead or split and lead[0] % world):
            raise ValueError(
                f"sequence_parallel splits the first dimension over {world} ranks: got input {tuple(x.shape)}"
            )
        return lead, world

    def extra_repr(self) -> str:
        kind = ("reduce-scatter" if self.sequence_parallel else "all-reduce") + self._collective_of
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {kind}"


class RowParallelLinear(_ParallelLinear):
    """``y = collective(x @ weight.T) + bias`` with the collective overlapped with the GEMM.

    weight: this rank's [out_features, in_features] shard (in_features = the local share of the
    input features). ``sequence_parallel=False``: all-reduce, y is [..., out_features] on every
    rank. ``True``: reduce-scatter over the flattened leading dimensions, rank r gets rows
    [r * T / world, (r + 1) * T / world) of the T tokens, shaped [x.shape[0] / world, *x.shape[1:-1],
    out_features] (the first dimension, e.g. the sequence of an [s, b, h] input, is split).
    """

    @classmethod
    def from_fp8(
        cls,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        *,
        input_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        use_fast_accum: bool = False,
        group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        config: OverlapConfig | dict | str | os.PathLike | None = None,
    ) -> RowParallelLinear:
        """An inference layer over this rank's FP8 weight shard: ``weight`` float8_e4m3fn
        [out_features, in_features] (each a multiple of 16) dequantizing as ``weight *
        weight_scale``: one float32 (per tensor), or [out_features, 1] / [out_features] float32 (per
        output channel, as FP8 checkpoints with channel scales store them; a bf16 result). Its input
        is 16-bit activations, quantized as they come (scale ``amax / 448`` of the tensor, or of each
        token's row beside channel scales), or with ``input_scale`` (one float32, static), or
        float8_e4m3fn ones with ``input_scale``. ``y = collective((x8 @ weight.T) * input scale *
        weight_scale)`` in ``out_dtype`` (bf16 / fp16; ``use_fast_accum``: torch._scaled_mm's; with
        channel scales the call's rowwise scales, bf16) plus ``bias`` ([out_features],
        ``out_dtype``). No backward (FP8 calls have none): run it under ``torch.no_grad()`` or
        ``torch.inference_mode()``. The tensors are kept as given (the weight a parameter that needs
        no gradient, the scales buffers, as FP8 checkpoints name them)."""
        if not isinstance(weight, torch.Tensor) or weight.dtype != FP8 or weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D {FP8} tensor [out_features, in_features], got {_described(weight)}")
        out_features, in_features = weight.shape
        if out_features % 16 or in_features % 16:
            raise ValueError(f"FP8 weights need out_features and in_features multiples of 16, got {_described(weight)}")
        if not weight.is_contiguous():
            raise ValueError("weight must be contiguous ([out_features, in_features], row-major)")
        channels = isinstance(weight_scale, torch.Tensor) and weight_scale.numel() != 1
        taken = (
            f"weight_scale must be one float32 value (per tensor) or float32 [{out_features}, 1] / "
            f"[{out_features}] (per output channel)"
        )
        shapes = ((out_features, 1), (out_features,)) if channels else None
        check_scale("weight_scale", weight_scale, weight.device, "the weight's", shapes, taken)
        if input_scale is not None:  # (none: quantized as it comes)
            check_scale("input_scale", input_scale, weight.device, "the weight's")
        if out_dtype not in DTYPES:
            raise ValueError(f"out_dtype must be one of {', '.join(map(str, DTYPES))}, got {out_dtype!r}")
        if channels and out_dtype != torch.bfloat16:
            raise ValueError(f"channel weight scales give a bfloat16 result (rowwise), got out_dtype {out_dtype}")
        if not isinstance(use_fast_accum, bool):
            raise TypeError(f"use_fast_accum must be a bool, got {type(use_fast_accum).__name__}")
        if bias is not None and (
            not isinstance(bias, torch.Tensor) or bias.shape != (out_features,) or bias.dtype != out_dtype
        ):
            raise ValueError(f"bias must be [{out_features}] of {out_dtype}, got {_described(bias)}")
        if bias is not None and bias.device != weight.device:
            raise ValueError(f"bias is on {bias.device}, the weight on {weight.device}")
        module = cls._bare(in_features, out_features, group, sequence_parallel, config)
        module.out_dtype, module.use_fast_accum = out_dtype, use_fast_accum
        module.weight = nn.Parameter(weight, requires_grad=False)
        module.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        module.register_buffer("weight_scale", weight_scale)
        module.register_buffer("input_scale", input_scale)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, world = self._rows(x, split=True)
        x2d = x.reshape(-1, self.in_features).contiguous()
        if self.fp8:
            y = self._fp8(x2d)
        else:
            y = with_gradients(x2d, self.weight, _collective(self.sequence_parallel), self.group, self.config)
        if self.bias is not None:
            bias = _AllReduceGrad.apply(self.bias, self.group) if self.sequence_parallel else self.bias
            y = y + bias
        if self.sequence_parallel:
            return y.view(lead[0] // world, *lead[1:], self.out_features)
        return y.view(*lead, self.out_features)

    @property
    def fp8(self) -> bool:
        """Whether this is an FP8 layer (:meth:`from_fp8`)."""
        return "weight_scale" in self._buffers

    def _fp8(self, x: torch.Tensor) -> torch.Tensor:
        """The FP8 layer's collective of its product (:meth:`from_fp8`) for ``x`` [tokens, in_features]."""
        if self.weight.dtype != FP8 or self.weight_scale.dtype != torch.float32:
            # (module.to(dtype) converts every floating-point tensor, FP8 ones too)
            raise ValueError(
                f"this FP8 layer's weight is {self.weight.dtype} and its weight_scale {self.weight_scale.dtype} now, "
                f"not {FP8} and float32: convert a model's dtype before making its FP8 layers"
            )
        if torch.is_grad_enabled() and x.requires_grad:
            raise ValueError("FP8 layers have no backward: run them under torch.no_grad() or torch.inference_mode()")
        channels = self.weight_scale.numel() != 1
        if x.dtype == FP8:
            if self.input_scale is None:
                raise ValueError(f"{FP8} input needs the layer's input_scale (RowParallelLinear.from_fp8)")
            x8, scale = x, self.input_scale
        elif x.dtype in DTYPES:
            # the largest magnitude (of the tensor; of each row beside channel scales) maps to FP8's
            # largest value (zeros, or no rows, to zeros)
            scale = self.input_scale
            if scale is None and x.numel():
                amax = x.abs().amax(dim=1, keepdim=True) if channels else x.abs().amax()
                scale = (amax.float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
            elif scale is None:
                scale = torch.ones((), device=x.device)
            x8 = x.float().div_(scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)  # (.float() copies a 16-bit x)
        else:
            raise ValueError(f"FP8 layers take {', '.join(map(str, (*DTYPES, FP8)))} input, got {x.dtype}")
        scale_b = self.weight_scale
        if channels:  # the call's rowwise scales: [tokens, 1] and [1, out_features]
            scale = scale.reshape(-1, 1).expand(x8.shape[0], 1).contiguous()
            scale_b = scale_b.reshape(1, -1)
        if not x.is_cuda:  # the plain path, in float32
            dequantized = x8.float() * scale, self.weight.float() * scale_b.reshape(-1, 1)
            return with_gradients(*dequantized, _collective(self.sequence_parallel), self.group).to(self.out_dtype)
        call = overlap.gemm_reduce_scatter if self.sequence_parallel else overlap.gemm_all_reduce
        return call(
            x8,
            self.weight,
            group=self.group,
            config=self.config,
            scale_a=scale,
            scale_b=scale_b,
            out_dtype=self.out_dtype,
            use_fast_accum=self.use_fast_accum,
        )

    def extra_repr(self) -> str:
        fp8 = f", {FP8} weight, {self.out_dtype} out" if self.fp8 else ""
        return super().extra_repr() + fp8


def _described(t: object) -> str:
    """What an argument was, for an error: a tensor's dtype and shape, else its type."""
    return f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ weight.T + bias`` on this rank's output features, the input gradient's collective
    overlapped with its GEMM in the backward pass.

    weight: this rank's [out_features, in_features] shard (out_features = the local share of the
    output features); x: [..., in_features], the same on every rank; y: [..., out_features]. Backward:
    grad x = the all-reduce of grad_y @ weight, one overlapped call (``config`` is that call's).
    ``sequence_parallel=True``: x is this rank's shard of the first dimension (e.g. of the sequence
    in [s / world, b, h]), all-gathered (plainly) before the GEMM, and again in the backward for the
    weight gradient (only the shard is kept), so y is [x.shape[0] * world, *x.shape[1:-1],
    out_features]; grad x is reduce-scattered back to the shards (overlapped).
    """

    _collective_of = " of the input gradient"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, world = self._rows(x, split=False)  # the ranks' shards are gathered
        if x.is_cuda and x.requires_grad and torch.is_grad_enabled():  # refuse here, not midway through backward
            check_inputs(x.new_empty(1, self.out_features), self.weight, "kn")  # the backward's operands
        x2d = x.reshape(-1, self.in_features).contiguous()
        y = _ColumnParallel.apply(x2d, self.weight, self.group, self.config, self.sequence_parallel)
        if self.bias is not None:
            y = y + self.bias
        if self.sequence_parallel:
            return y.view(lead[0] * world, *lead[1:], self.out_features)
        return y.view(*lead, self.out_features)


def swap_row_parallel(
    model: nn.Module,
    match: Sequence[str] | Callable[[str, nn.Module], bool],
    **kwargs,
) -> list[str]:
    """Replace the ``nn.Linear`` modules of ``model`` selected by ``match`` with
    :class:`RowParallelLinear` modules sharing their parameters; returns the replaced names.

    ``match``: glob patterns over qualified module names (e.g. ``["*.o_proj", "*.down_proj"]``)
    or a predicate ``(name, module) -> bool``. The replaced layers now do their own all-reduce
    (or reduce-scatter): remove the collective that followed them in the model's code. ``kwargs``
    go to :meth:`RowParallelLinear.from_linear` (group, sequence_parallel, config).
    """
    return _swap(model, match, RowParallelLinear, kwargs, "swap_row_parallel")


def swap_column_parallel(
    model: nn.Module,
    match: Sequence[str] | Callable[[str, nn.Module], bool],
    **kwargs,
) -> list[str]:
    """Replace the ``nn.Linear`` modules of ``model`` selected by ``match`` (e.g. ``["*.q_proj",
    "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"]``) with :class:`ColumnParallelLinear`
    modules sharing their parameters; returns the replaced names. The replaced layers all-reduce
    their input gradient themselves: remove the model's own (e.g. a hook or an identity whose
    backward all-reduces); with ``sequence_parallel=True`` they also all-gather their input.
    ``match`` as in :func:`swap_row_parallel`; ``kwargs`` go to :meth:`ColumnParallelLinear.from_linear`.
    """
    return _swap(model, match, ColumnParallelLinear, kwargs, "swap_column_parallel")


def _swap(model: nn.Module, match, cls: type[_ParallelLinear], kwargs: dict, caller: str) -> list[str]:
    if callable(match):
        selected = match
    else:
        patterns = [match] if isinstance(match, str) else list(match)

        def selected(name: str, module: nn.Module) -> bool:
            return any(fnmatch.fnmatchcase(name, p) for p in patterns)

    targets = [(name, module) for name, module in model.named_modules() if name and selected(name, module)]
    if not targets:  # a pattern that fits another model's names: its layers keep their own collectives
        linears = [name for name, module in model.named_modules() if type(module) is nn.Linear]
        warnings.warn(
            f"{caller}: no module matched {'the predicate' if callable(match) else patterns}, nothing was replaced "
            f"(the model's nn.Linear modules: {', '.join(linears[:6]) or 'none'}{', ...' * (len(linears) > 6)})",
            stacklevel=3,
        )
    for name, module in targets:
        if type(module) is not nn.Linear:
            raise ValueError(f"{name} is a {type(module).__name__}, not an nn.Linear")
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, cls.from_linear(module, **dict(kwargs)))
    return [name for name, _ in targets]
