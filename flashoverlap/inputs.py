"""A call's inputs: the operand checks every entry point makes, and its group's size."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .comm.nccl import group_fact

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
# FP8 operands (with scales; the result bf16 / fp16): torch._scaled_mm's semantics
FP8_DTYPES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}
OPERAND_DTYPES = {**DTYPES, **FP8_DTYPES}


WEIGHT_LAYOUTS = ("nk", "kn")


ALIGNMENT = 8  # elements: TMA needs 16-byte aligned rows
FP8_ALIGNMENT = 16  # (16 bytes of FP8; torch._scaled_mm asks the same of N and K)


class Scales(NamedTuple):
    """An FP8 call's float32 scales, as ``torch._scaled_mm(a, W.T, scale_a=a_scale, scale_b=b_scale)``
    takes them: one each per tensor, C = (a_scale * b_scale) * (a @ W^T); or ``rowwise``, a_scale
    [M, 1] per row of a and b_scale [1, N] per row of W, C[i, j] = a_scale[i] * b_scale[j] * (a @ W^T)[i, j].
    They stay on the device: the overlapped call's epilogue reads them there, so a scale computed on
    the GPU needs no host sync and a CUDA graph reads each replay's values."""

    a: torch.Tensor
    b: torch.Tensor
    rowwise: bool = False

    def alpha(self) -> torch.Tensor:
        """Per-tensor scales' product, the GEMM epilogue's alpha: one float32 on the device, made on
        the current stream (a new tensor each time: a native replay substitutes its address)."""
        return torch.mul(self.a, self.b).reshape(1)

    def epilogue(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """What the GEMM's epilogue reads (SignalGemm.run): (alpha, row scales, column scales), the
        product of per-tensor scales (:meth:`alpha`), or rowwise ones' M and N values."""
        if self.rowwise:
            return None, self.a.reshape(-1), self.b.reshape(-1)
        return self.alpha(), None, None


def epilogue(scales: Scales | None) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """What a call's GEMM epilogue reads (:meth:`Scales.epilogue`); nothing for 16-bit operands."""
    return (None, None, None) if scales is None else scales.epilogue()


class Fp8(NamedTuple):
    """What an FP8 call's kernel and plain path rest on besides its operands: its result's dtype,
    whether the tensor cores' partial sums go unpromoted into fp32 accumulators (torch._scaled_mm's
    ``use_fast_accum``: faster, less accurate over long K), and whether its scales are rowwise
    (:class:`Scales`: the GEMM's direct epilogue multiplies them in)."""

    out_dtype: torch.dtype
    fast_accum: bool = False
    rowwise: bool = False


def check_group(group: object) -> None:
    """Refuse a ``group=`` that is no process group (None: the default group) before anything asks
    torch.distributed about it."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__} {group!r}")


def world_size(group: dist.ProcessGroup | None) -> int:
    check_group(group)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "flashoverlap needs an initialised torch.distributed process group: call "
            "torch.distributed.init_process_group(...) first (a group of one rank works too)"
        )
    return group_fact(group, "size", dist.get_world_size)


def check_inputs(a: object, weight: object, weight_layout: str, device_type: str = "cuda") -> tuple[int, int, int]:
    """Validate the operands of C = a @ W^T ("nk") or a @ W ("kn"); return (m, n, k)."""
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
    for name, t in (("a", a), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        if t.dtype not in OPERAND_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; supported: {', '.join(map(str, OPERAND_DTYPES))}")
    if a.dtype != weight.dtype:
        raise ValueError(f"a and weight dtypes differ: {a.dtype} vs {weight.dtype}")
    m, k = a.shape
    n, wk = weight.shape if weight_layout == "nk" else weight.shape[::-1]
    if wk != k:
        expected = f"[N, {k}]" if weight_layout == "nk" else f"[{k}, N]"
        raise ValueError(
            f"K mismatch: a is {tuple(a.shape)} but weight is {tuple(weight.shape)} "
            f"(weight_layout={weight_layout!r} expects {expected})"
        )
    if n < 1 or k < 1:  # M = 0 is fine: a rank with no rows for this call (an MoE expert without tokens)
        raise ValueError(f"empty problem: N={n}, K={k}")
    align = FP8_ALIGNMENT if a.dtype in FP8_DTYPES else ALIGNMENT
    if n % align or k % align:
        raise ValueError(f"N and K must be multiples of {align} (16-byte rows for TMA), got N={n}, K={k}")
    for name, t in (("a", a), ("weight", weight)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (row-major); call .contiguous() first")
    for name, t in (("a", a), ("weight", weight)):
        if t.device.type != device_type:
            raise ValueError(f"{name} is on {t.device}, expected a {device_type} tensor")
    if a.device != weight.device:
        raise ValueError(f"a is on {a.device} but weight is on {weight.device}")
    return m, n, k


def check_scales(
    a: torch.Tensor,
    weight: torch.Tensor,
    weight_layout: str,
    scale_a: object,
    scale_b: object,
    out_dtype: object,
    use_fast_accum: object = False,
) -> tuple[Scales | None, Fp8 | None]:
    """A call's FP8 arguments checked against its operands (whose dtypes :func:`check_inputs` checks):
    (its :class:`Scales`, its :class:`Fp8`) for FP8 operands, (None, None) for 16-bit ones, which
    take none of them (and for operands of two dtypes, which check_inputs refuses). FP8: float32
    scales on the operands' device, both given, both per tensor or both rowwise (scale_a [M, 1],
    scale_b [1, N], contiguous: torch._scaled_mm's); the result bfloat16 (the default) or float16
    (per-tensor scales only, as torch._scaled_mm); the weight [N, K] (FP8 tensor cores read both
    operands K-major)."""
    if a.dtype != weight.dtype or a.dim() != 2 or weight.dim() != 2:  # (refused by check_inputs, named)
        return None, None
    if a.dtype not in FP8_DTYPES:
        if scale_a is not None or scale_b is not None or out_dtype is not None or use_fast_accum:
            raise ValueError(
                f"scale_a, scale_b, out_dtype and use_fast_accum are for FP8 operands "
                f"({', '.join(map(str, FP8_DTYPES))}); a is {a.dtype}: its result is {a.dtype}, unscaled"
            )
        return None, None
    if not isinstance(use_fast_accum, bool):
        raise TypeError(f"use_fast_accum must be a bool, got {type(use_fast_accum).__name__}")
    if weight_layout != "nk":
        raise ValueError(f"FP8 operands need weight_layout 'nk' (a [N, K] weight), got {weight_layout!r}")
    if a.dtype == weight.dtype == torch.float8_e5m2:  # (torch._scaled_mm, the plain path, refuses them)
        raise ValueError("two float8_e5m2 operands: torch._scaled_mm multiplies none, pass float8_e4m3fn ones")
    if out_dtype is None:
        out_dtype = torch.bfloat16
    if out_dtype not in DTYPES:
        raise ValueError(f"out_dtype must be one of {', '.join(map(str, DTYPES))}, got {out_dtype!r}")
    given = {"scale_a": scale_a, "scale_b": scale_b}
    for name, t in given.items():
        if t is None:
            raise ValueError(
                f"FP8 operands need {name} (float32: one per tensor, or scale_a [M, 1] with scale_b [1, N], "
                "as torch._scaled_mm)"
            )
    rows = {"scale_a": (a.shape[0], 1), "scale_b": (1, weight.shape[0])}  # rowwise: [M, 1] and [1, N]
    rowwise = any(isinstance(t, torch.Tensor) and t.numel() != 1 for t in given.values())
    for name, t in given.items():
        taken = "rowwise scales are scale_a [M, 1] and scale_b [1, N], float32 (or both one value per tensor): "
        shapes = (rows[name],) if rowwise else None
        check_scale(name, t, a.device, shapes=shapes, taken=f"{taken}{name} should be float32 {list(rows[name])}")
    if rowwise and out_dtype != torch.bfloat16:
        raise ValueError(f"rowwise scales give a bfloat16 result (as torch._scaled_mm's), got out_dtype {out_dtype}")
    return Scales(scale_a, scale_b, rowwise), Fp8(out_dtype, use_fast_accum, rowwise)


def check_scale(
    name: str,
    t: object,
    device: torch.device,
    whose: str = "the operands'",
    shapes: tuple[tuple[int, ...], ...] | None = None,
    taken: str = "",
) -> None:
    """One FP8 scale on ``device`` (``whose`` device that is, for the message): a float32 tensor of
    one value (per tensor), or with ``shapes`` a contiguous float32 tensor of one of them (rowwise,
    per channel; ``taken``: what the error says is taken)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shapes is None and (t.dtype != torch.float32 or t.numel() != 1):
        raise ValueError(
            f"{name} must be one float32 value (a per-tensor scale), got {t.dtype} of shape {tuple(t.shape)}"
        )
    if shapes is not None and (t.dtype != torch.float32 or tuple(t.shape) not in shapes):
        raise ValueError(f"{taken}, got {t.dtype} of shape {tuple(t.shape)}")
    if shapes is not None and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} ({whose} device)")
