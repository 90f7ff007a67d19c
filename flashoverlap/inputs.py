"""A call's inputs: the operand checks every entry point makes, and its group's size."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm.nccl import group_fact

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


WEIGHT_LAYOUTS = ("nk", "kn")


ALIGNMENT = 8  # elements: TMA needs 16-byte aligned rows


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
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; supported: {', '.join(map(str, DTYPES))}")
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
    if n % ALIGNMENT or k % ALIGNMENT:
        raise ValueError(f"N and K must be multiples of {ALIGNMENT} (16-byte rows for TMA), got N={n}, K={k}")
    for name, t in (("a", a), ("weight", weight)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (row-major); call .contiguous() first")
    for name, t in (("a", a), ("weight", weight)):
        if t.device.type != device_type:
            raise ValueError(f"{name} is on {t.device}, expected a {device_type} tensor")
    if a.device != weight.device:
        raise ValueError(f"a is on {a.device} but weight is on {weight.device}")
    return m, n, k
