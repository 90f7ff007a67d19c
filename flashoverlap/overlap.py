"""GEMM + collective with the collective overlapped, on CUDA devices: the public calls.

Operands of every public entry point: a: [M, K]; weight: [N, K] like ``torch.nn.Linear``
(``weight_layout="nk"``) or [K, N] (``"kn"``); bf16 or fp16, contiguous, on this rank's CUDA
device; N and K multiples of 8. FP8 operands (float8_e4m3fn / float8_e5m2, weight [N, K], N and K
multiples of 16) take ``torch._scaled_mm``'s per-tensor float32 ``scale_a`` and ``scale_b`` (on the
device: C = scale_a * scale_b * a @ weight.T, accumulated in fp32) and give ``out_dtype`` (bf16, the
default, or fp16); Hopper overlaps them, Ada where config= asks; they have no backward. Every rank
passes the same shapes (but M for an all-to-all whose counts are exchanged, ``splits`` without
``output_splits``, or given, ``rows_per_rank``). ``config``: an :class:`OverlapConfig`, a dict of its
fields, or a YAML path (default: the registry's entry nearest the call, see
:mod:`flashoverlap.registry`, else the built-in defaults). The result is a
new tensor, ready on the current stream. Bad input raises ``ValueError``/``TypeError`` before
anything is launched. A group of one rank runs the plain GEMM; so does a call without ``config``
whose GEMM is one group (one wave: nothing to overlap), or that is not tuned for its shape and lost
to sequential when first timed (flashoverlap.decision: the defaults or the nearest tuned shape's
config, and the same with NCCL's SMs taken differently, against the plain call). A repeat of a
call runs what the first decided, the plain path with nothing but the matmul and the collective
(flashoverlap.runtime). Where an operand requires gradients, the call is differentiable
(:func:`with_gradients`). Inside a graph ``torch.compile`` traces, a call is the one operator
``flashoverlap::gemm_collective`` (:func:`_gemm_collective`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import comm, decision, state
from .comm import Exchange
from .config import OverlapConfig, resolve
from .inputs import FP8_DTYPES, check_inputs, check_scales, world_size
from .runtime import sequential


def gemm_all_reduce(
    a: torch.Tensor,
    weight: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    config: OverlapConfig | dict | str | os.PathLike | None = None,
    weight_layout: str = "nk",
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``all_reduce(a @ weight.T)`` over ``group`` -> [M, N], overlapped with the GEMM."""
    fp8_args = (scale_a, scale_b, out_dtype, use_fast_accum)
    return _gemm_collective(a, weight, "all_reduce", group, config, weight_layout, fp8_args=fp8_args)


def gemm_reduce_scatter(
    a: torch.Tensor,
    weight: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    config: OverlapConfig | dict | str | os.PathLike | None = None,
    weight_layout: str = "nk",
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``reduce_scatter_tensor`` of ``a @ weight.T`` over ``group``: rank r gets the summed rows
    [r * M / world, (r + 1) * M / world) -> [M / world, N]; M must be a multiple of the world size."""
    fp8_args = (scale_a, scale_b, out_dtype, use_fast_accum)
    return _gemm_collective(a, weight, "reduce_scatter", group, config, weight_layout, fp8_args=fp8_args)


def gemm_all_to_all(
    a: torch.Tensor,
    weight: torch.Tensor,
    *,
    splits: Sequence[int] | None = None,
    output_splits: Sequence[int] | None = None,
    rows_per_rank: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    config: OverlapConfig | dict | str | os.PathLike | None = None,
    weight_layout: str = "nk",
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``all_to_all_single`` of ``a @ weight.T``: the first ``splits[0]`` rows go to rank 0, the
    next ``splits[1]`` to rank 1, ... (even split when omitted); returns the rows received from
    every rank in rank order -> [sum(output_splits), N]. ``output_splits[s]`` = rows rank s sends
    here; omitted with ``splits``, every rank's splits are exchanged first (a small collective and a
    host sync), and the ranks may then pass different M (MoE experts; none included). Ranks whose M
    differ and that know every rank's M (``rows_per_rank``, e.g. from the dispatcher's token
    counts) pass it with ``splits`` and ``output_splits``: then nothing is exchanged."""
    counts, fp8_args = (splits, output_splits, rows_per_rank), (scale_a, scale_b, out_dtype, use_fast_accum)
    return _gemm_collective(a, weight, "all_to_all", group, config, weight_layout, *counts, fp8_args=fp8_args)


def with_gradients(
    a: torch.Tensor,
    weight: torch.Tensor,
    collective: str,
    group: dist.ProcessGroup | None = None,
    config: OverlapConfig | dict | str | os.PathLike | None = None,
    weight_layout: str = "nk",
    splits: Sequence[int] | None = None,
    output_splits: Sequence[int] | None = None,
    rows_per_rank: Sequence[int] | None = None,
) -> torch.Tensor:
    """``collective(a @ W^T)`` (``weight_layout`` "nk"; ``a @ W`` for "kn") with autograd: on CUDA the
    overlapped call, on the CPU (flashoverlap.nn's plain path, e.g. over gloo) matmul then the collective.
    Backward: the rows' gradient ``comm.adjoint`` of the result's, then plain matmuls for a and W.
    On CUDA where no gradient is wanted (inference: the layers and patched models call this on
    every forward) the call itself, without the autograd function's host time."""
    call = (a, weight, collective, group, config, weight_layout, splits, output_splits, rows_per_rank)
    if a.is_cuda and not _wants_gradients(a, weight):
        return _gemm_collective(*call)
    return _WithGradients.apply(*call)


def _wants_gradients(a: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether autograd records a call on these operands (the one test both entries to it ask)."""
    return torch.is_grad_enabled() and (a.requires_grad or weight.requires_grad)


class _WithGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, weight, collective, group, config, weight_layout, splits, output_splits, rows_per_rank):
        exchanged: list[Exchange] = []
        if a.is_cuda:
            call = (a, weight, collective, group, config, weight_layout, splits, output_splits, rows_per_rank)
            out = _gemm_collective(*call, exchanged)
        else:  # any dtype: a model debugged on the CPU
            given = (splits, output_splits, group, a.device)
            ex = comm.exchange(collective, a.shape[0], world_size(group), *given, rows_per_rank=rows_per_rank)
            exchanged.append(ex)
            out = sequential(a, weight, weight_layout, ex, group)
        counts = None
        if collective == "all_to_all":
            if exchanged:  # eager: what the call exchanged
                ex = exchanged[0]
                counts = None if ex.uniform else (ex.send, ex.recv)
            elif splits is not None:  # traced by torch.compile, where the call is one operator
                if output_splits is None:
                    raise ValueError(
                        "under torch.compile an all-to-all with gradients needs output_splits (its backward sends "
                        "the rows back, and the counts the call exchanges stay inside its operator)"
                    )
                counts = (tuple(splits), tuple(output_splits))
        ctx.save_for_backward(a, weight)
        ctx.call = collective, group, weight_layout, counts
        return out

    @staticmethod
    def backward(ctx, grad):
        a, weight = ctx.saved_tensors
        collective, group, weight_layout, counts = ctx.call
        rows = comm.adjoint(collective, grad, group, counts)  # the gradient of a @ W^T (or a @ W)
        grad_a = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_a = rows @ weight if weight_layout == "nk" else rows @ weight.t()
        if ctx.needs_input_grad[1]:
            grad_w = rows.t() @ a if weight_layout == "nk" else a.t() @ rows
        return grad_a, grad_w, None, None, None, None, None, None, None


_NO_FP8 = (None, None, None, False)  # the public calls' FP8 arguments, left out


def _fp8_given(fp8_args: tuple) -> bool:
    """Whether a call passed any FP8 argument, by identity: comparing the tuple with ``_NO_FP8``
    would put a scale tensor through ``Tensor.__eq__(None)``, which torch refuses with a TypeError it
    catches, 10-30 us of host time on every FP8 call (most of a call decided plain's excess over
    torch's own)."""
    scale_a, scale_b, out_dtype, use_fast_accum = fp8_args
    return scale_a is not None or scale_b is not None or out_dtype is not None or use_fast_accum is not False


def _gemm_collective(
    a: torch.Tensor,
    weight: torch.Tensor,
    collective: str,
    group: dist.ProcessGroup | None,
    config: OverlapConfig | dict | str | os.PathLike | None,
    weight_layout: str,
    splits: Sequence[int] | None = None,
    output_splits: Sequence[int] | None = None,
    rows_per_rank: Sequence[int] | None = None,
    exchanged: list[Exchange] | None = None,
    fp8_args: tuple = _NO_FP8,
) -> torch.Tensor:
    """A call (see the module's docstring): with gradients where autograd asks for them (CUDA
    tensors; others fail the checks below), inside a graph ``torch.compile`` traces the one operator
    ``flashoverlap::gemm_collective`` (no graph break, so ``fullgraph=True`` works; its group and
    config reach it as strings fixed when the graph is traced), else run here: a repeat of a call
    decided before (:func:`_call_key`) runs what it decided straight away. ``exchanged``: where given,
    the call's :class:`Exchange` is appended to it (for the gradients; not where traced); ``fp8_args``:
    (scale_a, scale_b, out_dtype, use_fast_accum) as the public calls take them (inputs.check_scales)."""
    tensors = isinstance(a, torch.Tensor) and isinstance(weight, torch.Tensor)
    # FP8 arguments are checked on every call (a repeat's scales are new tensors); a call without
    # any is 16-bit, or FP8 refused on its first use (below, before deciding: never kept)
    scales = kind = None
    if tensors and _fp8_given(fp8_args):
        scales, kind = check_scales(a, weight, weight_layout, *fp8_args)
    if tensors and _wants_gradients(a, weight) and a.is_cuda:
        if scales is not None:
            raise ValueError("FP8 calls have no backward: pass operands that do not require gradients")
        return with_gradients(a, weight, collective, group, config, weight_layout, splits, output_splits, rows_per_rank)
    if torch.compiler.is_compiling():
        counts = [None if s is None else [int(c) for c in s] for s in (splits, output_splits, rows_per_rank)]
        text = _config_text(config, kind is not None)
        return torch.ops.flashoverlap.gemm_collective(
            a, weight, collective, _group_name(group), text, weight_layout, *counts, *fp8_args
        )
    key = None
    if tensors and splits is None and output_splits is None and rows_per_rank is None:
        key = _call_key(a, weight, collective, config, weight_layout, kind)
        kept = state.kept(group) if key is not None else None
        if kept is not None and (known := kept.runners.get(key)) is not None:
            run, ex = known
            if exchanged is not None:
                exchanged.append(ex)
            return run(a, weight, scales)
    if tensors and scales is None:
        check_scales(a, weight, weight_layout, *fp8_args)  # (FP8 operands without their scales)
    chosen = decision.decide(
        a,
        weight,
        collective,
        group,
        config,
        weight_layout,
        splits,
        output_splits,
        rows_per_rank,
        exchanged,
        scales,
        kind,
    )
    if key is not None and not decision.capturing(a):
        state.of(group).runners.keep(key, (chosen.run, chosen.ex))
    return chosen.run(a, weight, scales)


def _call_key(
    a: torch.Tensor, weight: torch.Tensor, collective: str, config: object, weight_layout: str, fp8: object
) -> tuple | None:
    """What a call is known by once decided, cheap to make (every call makes it): everything its
    checks and its decision rest on (operand shapes, dtypes, devices; contiguous operands only), as
    long as its config is none or an :class:`OverlapConfig` (a dict or YAML path is resolved on every
    call); None where the call must be decided (and checked) in full."""
    if not (config is None or type(config) is OverlapConfig) or not (a.is_contiguous() and weight.is_contiguous()):
        return None
    return (
        collective,
        config,
        weight_layout,
        a.shape,
        weight.shape,
        a.dtype,
        weight.dtype,
        a.device,
        weight.device,
        fp8,
    )


@torch.compiler.assume_constant_result
def _group_name(group: dist.ProcessGroup | None) -> str:
    world_size(group)  # a clear error where no group is initialised, while the graph is traced
    return (group if group is not None else dist.group.WORLD).group_name


@torch.compiler.assume_constant_result
def _config_text(config: OverlapConfig | dict | str | os.PathLike | None, fp8: bool = False) -> str:
    """``config`` as the operator takes it: "" for none (the registry's), else the resolved config's
    fields as JSON (validated, and a YAML file read, once, while the graph is traced; ``fp8``: for
    FP8 operands, config.resolve's)."""
    return "" if config is None else json.dumps(dataclasses.asdict(resolve(config, fp8)))


@functools.lru_cache(maxsize=256)
def _config_of(text: str) -> OverlapConfig | None:
    return None if text == "" else resolve(json.loads(text))


# Defined through torch.library.Library, not custom_op: its wrappers cost a compiled call ~10 us more
# host time (one CPU); the operator has no autograd formula (the overlapped call has none either).
_library = torch.library.Library("flashoverlap", "DEF")
_library.define(
    "gemm_collective(Tensor a, Tensor weight, str collective, str group, str config, str weight_layout, "
    "int[]? splits, int[]? output_splits, int[]? rows_per_rank=None, Tensor? scale_a=None, Tensor? scale_b=None, "
    "ScalarType? out_dtype=None, bool use_fast_accum=False) -> Tensor"
)


def _gemm_collective_op(
    a, weight, collective, group, config, weight_layout, splits, output_splits, rows_per_rank=None, *fp8
):
    pg = dist.distributed_c10d._resolve_process_group(group)
    counts = (splits, output_splits, rows_per_rank)
    if a.device.type == "cpu":  # the plain path, as flashoverlap.nn's layers take there (a graph debugged on gloo)
        if a.dtype in FP8_DTYPES:
            raise ValueError("FP8 calls run on CUDA devices (their plain path is torch._scaled_mm)")
        return with_gradients(a, weight, collective, pg, _config_of(config), weight_layout, *counts)
    fp8_args = _padded(fp8)
    return _gemm_collective(a, weight, collective, pg, _config_of(config), weight_layout, *counts, fp8_args=fp8_args)


def _padded(fp8: tuple) -> tuple:
    """The operator's (scale_a, scale_b, out_dtype, use_fast_accum) as it was given them: the
    dispatcher leaves out trailing arguments at their defaults."""
    return (*fp8, *(None, None, None, False)[len(fp8) :])


_library.impl("gemm_collective", _gemm_collective_op, "CompositeExplicitAutograd")


@torch.library.register_fake("flashoverlap::gemm_collective")
def _(a, weight, collective, group, config, weight_layout, splits, output_splits, rows_per_rank=None, *fp8):
    m, n, _ = check_inputs(a, weight, weight_layout, a.device.type)
    _, kind = check_scales(a, weight, weight_layout, *_padded(fp8))
    if collective == "reduce_scatter":
        rows = m // dist.distributed_c10d._resolve_process_group(group).size()
    elif output_splits is not None:
        rows = sum(output_splits)
    elif splits is not None:  # exchanged on every call: known only then
        rows = torch.library.get_ctx().new_dynamic_size()
    else:
        rows = m
    return a.new_empty((rows, n), dtype=None if kind is None else kind.out_dtype)
