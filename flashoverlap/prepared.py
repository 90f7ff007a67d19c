"""An overlapped call's plan, kernel and device tables: what depends only on shape, dtype,
device and config, made once (:func:`prepare`) and kept (state.plans)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from . import state
from .config import OverlapConfig
from .gemm import FusedSums, SignalGemm, get_kernel
from .inputs import DTYPES, FP8_DTYPES, Fp8
from .plan import Plan, make_plan
from .rules import kernel_spec
from .streams import SIDE_ROLES, side_stream


@dataclass(eq=False)
class Prepared:
    """Everything a call needs that depends only on shape, dtype, device and config."""

    plan: Plan
    kernel: SignalGemm
    slots: torch.Tensor  # the plan's slot table on the device
    counters: torch.Tensor  # int32 per group, zero between calls
    workspace: torch.Tensor | None  # stream-K partial sums
    targets: tuple[int, ...]
    sm_count: int
    report: torch.Tensor  # int32[4]: a debug-mode wait that timed out (see flashoverlap.signal)
    symmetric: bool = False  # buffers in NCCL symmetric windows (OverlapConfig.symmetric)
    # exchange -> (the window region, its (out, buffer, recv) there, or a pull's buffer): the same every call
    window_views: dict = field(default_factory=dict)
    group_done: list = field(default_factory=list)  # an event per group (comm.finish_group)
    lane_done: list = field(default_factory=list)  # per pull lane (streams.lanes) an event per group
    pulls_start: torch.cuda.Event | None = None  # where the lanes start
    # the GEMM's end on the caller's stream (a window's copies out; a pull's last add)
    gemm_done: torch.cuda.Event | None = None
    # replay_key -> the call's runtime.Replay; None once seen (noted on the next call like it), False
    # where that call could not be replayed
    programs: dict = field(default_factory=dict)
    # (exchange, group, tail group, the caller's cudaStream_t) -> the runtime.Replay a repeat takes
    # first, found without working out its replay_key
    replays: dict = field(default_factory=dict)

    @functools.cached_property
    def out_dtype(self) -> torch.dtype:
        """The dtype of the GEMM's output (its buffers'): the operands' own, or an FP8 GEMM's result's."""
        return getattr(torch, self.kernel.spec.dtype)

    def launch(
        self,
        a: torch.Tensor,
        weight: torch.Tensor,
        buffer: torch.Tensor,
        stream: torch.cuda.Stream,
        counters: torch.Tensor | None = None,
        alpha: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        cols: torch.Tensor | None = None,
        fused: FusedSums | None = None,
    ) -> None:
        """Enqueue the signal GEMM on ``stream``, writing the plan's slots of ``buffer``, bumping
        ``counters`` (default: the plan's own); ``alpha``, ``rows``, ``cols``: the product's scales
        (SignalGemm.run; inputs.Scales.epilogue); ``fused``: a reduce-scatter's sums in its epilogue."""
        self.kernel.run(
            a,
            weight,
            buffer,
            self.slots,
            self.counters if counters is None else counters,
            self.workspace,
            (self.plan.tiles_m, self.plan.tiles_n),
            self.sm_count,
            self.plan.along_m,
            self.plan.swizzle,
            self.plan.rotate,
            self.plan.interleave,
            (self.plan.keep, self.plan.after),
            stream,
            alpha,
            rows,
            cols,
            fused,
        )


def prepare(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    weight_layout: str,
    device: torch.device,
    cfg: OverlapConfig,
    rotate: int = 0,
    interleave: int = 1,
    columns: tuple[int, ...] | None = None,
    fp8: Fp8 | None = None,
) -> Prepared:
    """The plan, kernel and device tables of one call; ``dtype``: the operands'; ``rotate``: rows of
    C the schedule starts at (comm.rows_rotation); ``interleave``: segments it interleaves
    (comm.interleave; in the ``rows`` layout, segments no group spans); ``columns``: the ``cols``
    groups' tile columns, shared by ranks whose M differ
    (:func:`shared_columns`); ``fp8``: an FP8 GEMM's result dtype and accumulation (None: bf16,
    promoted)."""
    if cfg.layout == "auto":
        raise ValueError("prepare() takes a config resolved for its collective (rules.for_collective)")
    if dtype in FP8_DTYPES:
        fp8 = fp8 or Fp8(torch.bfloat16)
    key = (m, n, k, dtype, weight_layout, device.index, cfg, rotate, interleave, columns, fp8)
    if (found := state.plans.recent(key)) is not None:
        return found
    cfg, kernel, sm_count = _kernel(dtype, fp8, weight_layout, device, cfg)
    plan = _plan(kernel, cfg, sm_count, (m, n, k), device, rotate, interleave, columns)
    slots = torch.from_numpy(plan.slot_table().view("u1")).to(device)
    counters = torch.zeros(plan.num_groups, dtype=torch.int32, device=device)
    workspace_bytes = kernel.workspace_size(m, n, k, sm_count, device.index, plan.along_m, cfg.swizzle)
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device) if workspace_bytes else None
    report = torch.zeros(4, dtype=torch.int32, device=device)
    for role in SIDE_ROLES:  # the side streams use them on every call; the plan may be dropped from any stream
        counters.record_stream(side_stream(device, role))
        report.record_stream(side_stream(device, role))
    targets = plan.counter_targets(kernel.signals_per_tile)
    prepared = Prepared(plan, kernel, slots, counters, workspace, targets, sm_count, report, cfg.symmetric)
    state.plans.keep(key, prepared)
    return prepared


def _kernel(
    dtype: torch.dtype, fp8: Fp8 | None, weight_layout: str, device: torch.device, cfg: OverlapConfig
) -> tuple[OverlapConfig, SignalGemm, int]:
    """``cfg`` completed for the device, its kernel (operands ``dtype``; FP8 ones: result and
    accumulation as ``fp8`` says), and the SMs that kernel's grid gets (every SM under a late
    budget: its plan keeps ``comm_sms`` of them for the last waves only)."""
    capability = torch.cuda.get_device_capability(device)
    if dtype in FP8_DTYPES:
        fp8 = fp8 or Fp8(torch.bfloat16)  # (as prepare's)
        cfg, spec = kernel_spec(cfg, DTYPES[fp8.out_dtype], weight_layout, capability, FP8_DTYPES[dtype], fp8.rowwise)
        # (Ada's FP8 mma.sync accumulates in fp32 itself: its kernels have no fast mode, nor need one)
        spec = dataclasses.replace(spec, fast_accum=fp8.fast_accum and spec.family == "sm90")
    else:
        cfg, spec = kernel_spec(cfg, DTYPES[dtype], weight_layout, capability)
    total_sms = torch.cuda.get_device_properties(device).multi_processor_count
    if total_sms - cfg.comm_sms < 1:
        raise ValueError(f"comm_sms={cfg.comm_sms} leaves no SM for the GEMM on {device} ({total_sms} SMs)")
    return cfg, get_kernel(spec), total_sms if cfg.late_budget else total_sms - cfg.comm_sms


def _plan(
    kernel: SignalGemm,
    cfg: OverlapConfig,
    sm_count: int,
    shape: tuple[int, int, int],
    device: torch.device,
    rotate: int = 0,
    interleave: int = 1,
    columns: tuple[int, ...] | None = None,
) -> Plan:
    """The plan of a GEMM ``shape`` on ``kernel``'s grid (see :func:`prepare`)."""
    m, n, k = shape
    index, along_m = device.index, cfg.layout == "cols"
    keep = kernel.num_ctas(m, n, k, sm_count - cfg.comm_sms, index, along_m, cfg.swizzle) if cfg.late_budget else 0
    return make_plan(
        m,
        n,
        tile_m=cfg.tile_m,
        tile_n=cfg.tile_n,
        cluster_m=cfg.cluster_m,
        ctas=kernel.num_ctas(m, n, k, sm_count, index, along_m, cfg.swizzle),
        stream_k_tiles=kernel.stream_k_tiles(m, n, k, sm_count, index, along_m, cfg.swizzle),
        partition=cfg.partition if columns is None else None,
        layout=cfg.layout,
        swizzle=cfg.swizzle,
        rotate=rotate // cfg.tile_m,
        interleave=1 if cfg.layout == "rows" else interleave,
        column_groups=columns,
        keep=keep,
        split=interleave if cfg.layout == "rows" else 1,
    )


@functools.lru_cache(maxsize=state.MAX_PLANS)
def shared_columns(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    weight_layout: str,
    device: torch.device,
    cfg: OverlapConfig,
    fp8: Fp8 | None = None,
) -> tuple[int, ...]:
    """The ``cols`` groups' tile columns that ranks whose M differ all plan on: those of the plan
    for ``m`` rows, the largest M (that rank's GEMM takes longest, so its waves set the pace)."""
    cfg, kernel, sm_count = _kernel(dtype, fp8, weight_layout, device, cfg)
    return _plan(kernel, cfg, sm_count, (m, n, k), device).column_groups
