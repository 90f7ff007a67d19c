"""The public calls on the CPU: bad input rejected before anything is launched, torch.compile's
operator, autograd, and a repeated call's way past its decision (gloo)."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import flashoverlap
from flashoverlap import registry

from .helpers import ENTRY_POINTS, bf16, spawn_ranks


def fp8(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_uninitialised_process_group_is_reported(monkeypatch, fn):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fn(bf16(64, 64), bf16(64, 64))


@pytest.mark.parametrize(
    "a, w, kwargs, error, message",
    [
        (torch.randn(64, 64), torch.randn(64, 64), {}, ValueError, "dtype torch.float32; supported"),
        (bf16(64, 64), bf16(64, 64).half(), {}, ValueError, "dtypes differ"),
        (bf16(64, 64), bf16(64, 72), {}, ValueError, r"K mismatch: a is \(64, 64\) but weight is \(64, 72\)"),
        (bf16(64, 64), bf16(72, 64), {"weight_layout": "kn"}, ValueError, r"expects \[64, N\]"),
        (bf16(64, 64), bf16(64, 64), {"weight_layout": "t"}, ValueError, "weight_layout must be one of"),
        (bf16(64), bf16(64, 64), {}, ValueError, "a must be 2-D"),
        ([[1.0]], bf16(64, 64), {}, TypeError, "a must be a torch.Tensor"),
        (bf16(64, 60), bf16(64, 60), {}, ValueError, "multiples of 8"),
        (bf16(64, 64), bf16(60, 64), {}, ValueError, "multiples of 8"),
        (bf16(64, 64), bf16(0, 64), {}, ValueError, "empty problem: N=0"),
        (bf16(64, 128)[:, ::2], bf16(64, 64), {}, ValueError, "a must be contiguous"),
        (bf16(64, 64), bf16(64, 128)[:, ::2], {}, ValueError, "weight must be contiguous"),
        (bf16(64, 64), bf16(64, 64), {}, ValueError, "a is on cpu, expected a cuda tensor"),
        (bf16(64, 64), bf16(64, 64), {"config": {"tile_m": 96}}, ValueError, "tile_m 96 not in"),
        (bf16(64, 64), bf16(64, 64), {"config": {"bogus": 1}}, ValueError, "unknown key"),
        (bf16(64, 64), bf16(64, 64), {"scale_a": torch.ones(1)}, ValueError, "are for FP8 operands"),
        (fp8(64, 64), fp8(64, 64), {}, ValueError, "FP8 operands need scale_a"),
        (fp8(64, 64), bf16(64, 64), {}, ValueError, "dtypes differ"),
    ],
)
@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_bad_input_is_rejected(one_rank_group, fn, a, w, kwargs, error, message):
    with pytest.raises(error, match=message):
        fn(a, w, **kwargs)


@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_bad_config_files_are_rejected(one_rank_group, tmp_path, fn):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        fn(bf16(64, 64), bf16(64, 64), config=str(tmp_path / "missing.yaml"))
    broken = tmp_path / "broken.yaml"
    broken.write_text("tile_m: [128\n")
    with pytest.raises(ValueError, match="malformed YAML"):
        fn(bf16(64, 64), bf16(64, 64), config=str(broken))
    typed = tmp_path / "typed.yaml"
    typed.write_text("comm_sms: many\n")
    with pytest.raises(ValueError, match=f"{typed}: .*comm_sms must be an integer"):
        fn(bf16(64, 64), bf16(64, 64), config=str(typed))
    with pytest.raises(TypeError, match="config must be an OverlapConfig"):
        fn(bf16(64, 64), bf16(64, 64), config=42)


@pytest.mark.parametrize(
    "fn, kwargs, message",
    [
        (flashoverlap.gemm_reduce_scatter, {"config": {"layout": "tiles"}}, "reduce_scatter needs layout 'cols'"),
        (flashoverlap.gemm_all_to_all, {"config": {"layout": "tiles"}}, "all_to_all needs layout 'cols'"),
        (flashoverlap.gemm_all_to_all, {"config": {"epilogue": "tma", "scheduler": "streamk"}}, "neither takes it"),
        (
            flashoverlap.gemm_all_to_all,
            {"config": {"epilogue": "tma", "layout": "cols"}},
            "layout 'rows' or 'segments'",
        ),
        (flashoverlap.gemm_reduce_scatter, {}, "a is on cpu"),
        (flashoverlap.gemm_all_to_all, {"splits": [64]}, "a is on cpu"),
    ],
)
def test_every_entry_point_validates(one_rank_group, fn, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fn(bf16(64, 64), bf16(64, 64), **kwargs)


def compiled(fn, *args, grad: bool = False):
    """``fn(*args)`` compiled with ``fullgraph=True`` (a graph break fails) on fake CUDA tensors (no
    GPU needed: the graph is traced, and run on fake tensors), which require gradients where
    ``grad``; its output and the traced graph."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with FakeTensorMode(shape_env=ShapeEnv()):
        fake = [torch.empty(a.shape, dtype=a.dtype, device="cuda", requires_grad=grad) for a in args]
        out = torch.compile(fn, fullgraph=True, backend=keep)(*fake)
    (graph,) = graphs
    return out, graph


def op_calls(graph) -> list[tuple]:
    """The arguments after the tensors of every flashoverlap operator in ``graph``."""
    op = torch.ops.flashoverlap.gemm_collective
    return [node.args[2:] for node in graph.graph.nodes if node.target in (op, op.default)]


def compile_worker(rank: int, world: int, store_path: str):
    from flashoverlap import OverlapConfig
    from flashoverlap.config import resolve
    from flashoverlap.overlap import _config_of

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        torch._dynamo.config.capture_dynamic_output_shape_ops = True  # the ragged all-to-all's rows
        a, w = bf16(64, 32), bf16(48, 32)
        pair = dist.new_group([0, 1])  # not the default group: its name reaches the operator
        assert world == 2
        yaml_path = registry.SHIPPED / "example.yaml"
        cases = [  # every kind of config: a dict, a YAML path, an OverlapConfig
            (flashoverlap.gemm_all_reduce, {"config": {"comm_sms": 4}}, (64, 48)),
            (flashoverlap.gemm_all_reduce, {"config": yaml_path}, (64, 48)),
            (flashoverlap.gemm_reduce_scatter, {"group": pair, "config": OverlapConfig(layout="cols")}, (32, 48)),
            (flashoverlap.gemm_all_to_all, {}, (64, 48)),
            (flashoverlap.gemm_all_to_all, {"splits": [40, 24], "output_splits": [40, 8]}, (48, 48)),
            (flashoverlap.gemm_all_to_all, {"splits": [40, 24]}, None),  # rows known once exchanged
            (
                flashoverlap.gemm_all_to_all,
                {"splits": [40, 24], "output_splits": [40, 8], "rows_per_rank": [64, 48]},
                (48, 48),
            ),
        ]
        for fn, kwargs, shape in cases:
            out, graph = compiled(lambda a, w, fn=fn, kwargs=kwargs: fn(torch.relu(a), w, **kwargs) * 2, a, w)
            if shape is None:
                assert isinstance(out.shape[0], torch.SymInt) and out.shape[1] == 48, out.shape
            else:
                assert tuple(out.shape) == shape and out.device.type == "cuda", (fn.__name__, out.shape)
            ((collective, group, config, layout, *counts, scale_a, scale_b, out_dtype, fast),) = op_calls(graph)
            assert collective == fn.__name__.removeprefix("gemm_") and layout == "nk"
            assert group == (pair if "group" in kwargs else dist.group.WORLD).group_name
            assert counts == [kwargs.get(key) for key in ("splits", "output_splits", "rows_per_rank")]
            assert scale_a is scale_b is out_dtype is None and fast is False
            wanted = kwargs.get("config")
            assert _config_of(config) == (None if wanted is None else resolve(wanted)), config
        with pytest.raises(ValueError, match="FP8 calls run on CUDA devices"):  # (the operator on the CPU)
            a8, w8 = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
            torch.ops.flashoverlap.gemm_collective(a8, w8, "all_reduce", pair.group_name, "", "nk", None, None)
        # FP8 operands: their scales reach the operator as tensors, the result takes out_dtype
        a8, w8, scale = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn), torch.ones(1)
        for out_dtype, fast in ((None, False), (torch.float16, True)):
            out, graph = compiled(
                lambda a, w, sa, sb, dt=out_dtype, fast=fast: flashoverlap.gemm_all_reduce(
                    a, w, scale_a=sa, scale_b=sb, out_dtype=dt, use_fast_accum=fast
                ),
                a8,
                w8,
                scale,
                scale,
            )
            assert tuple(out.shape) == (64, 48) and out.dtype == (out_dtype or torch.bfloat16)
            ((*_, scale_a, scale_b, dtype, accumulation),) = op_calls(graph)
            assert scale_a.op == scale_b.op == "placeholder" and (dtype, accumulation) == (out_dtype, fast)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_compiled_calls_are_one_operator_in_the_graph():
    """Under torch.compile every entry point is one ``flashoverlap::gemm_collective`` node (no graph
    break) with its output's shape, and its group and config reach it intact."""
    spawn_ranks(2, compile_worker, timeout=240)


def test_compiled_configs_are_what_the_eager_call_would_use(one_rank_group, tmp_path):
    from flashoverlap import OverlapConfig
    from flashoverlap.config import resolve
    from flashoverlap.overlap import _config_of, _config_text

    path = tmp_path / "c.yaml"
    path.write_text("comm_sms: 8\npartition: [2, 3]\nlayout: cols\n")
    for config in [{}, {"partition": [1, 2], "tile_k": 32}, OverlapConfig(symmetric=True), str(path), path]:
        assert _config_of(_config_text(config)) == resolve(config)
    assert _config_of(_config_text(None)) is None  # the registry's, decided per call


def test_compiled_calls_refuse_bad_input_while_traced(one_rank_group):
    with pytest.raises(RuntimeError, match="tile_m 96 not in"):
        compiled(lambda a, w: flashoverlap.gemm_all_reduce(a, w, config={"tile_m": 96}), bf16(64, 32), bf16(48, 32))
    with pytest.raises(RuntimeError, match="K mismatch"):
        compiled(flashoverlap.gemm_all_reduce, bf16(64, 32), bf16(48, 40))
    with pytest.raises(RuntimeError, match="needs output_splits"):  # its backward must send rows back
        compiled(lambda a, w: flashoverlap.gemm_all_to_all(a, w, splits=[64]), bf16(64, 32), bf16(48, 32), grad=True)
    # run eagerly on the CPU, the operator takes the plain path (as flashoverlap.nn's layers do there)
    a, w = bf16(64, 32), bf16(48, 32)
    out = torch.ops.flashoverlap.gemm_collective(a, w, "all_reduce", "0", "", "nk", None, None)
    torch.testing.assert_close(out, a @ w.t())


def gradient_worker(rank: int, world: int, store_path: str):
    from flashoverlap.overlap import with_gradients

    from .helpers import check_gradients

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        check_gradients(rank, world, with_gradients, "cpu")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_of_every_collective(world):
    """The calls' autograd (the same Function on CUDA; here its CPU path over gloo): every rank's
    gradients of one global loss against those of the unsharded problem, every collective and
    all-to-all's ways of giving its counts."""
    spawn_ranks(world, gradient_worker, timeout=240)


def test_with_gradients_enters_autograd_only_where_a_gradient_is_wanted(monkeypatch):
    """The layers and patched models call with_gradients on every forward: on CUDA without a
    gradient to compute (inference) it is the plain call, without the autograd function's host time."""
    from flashoverlap import overlap

    said = []
    monkeypatch.setattr(overlap, "_gemm_collective", lambda *call: said.append("call"))
    monkeypatch.setattr(overlap._WithGradients, "apply", lambda *call: said.append("autograd"))

    def operand(cuda: bool, grad: bool):
        return SimpleNamespace(is_cuda=cuda, requires_grad=grad)

    for cuda, grad, enabled, path in (
        (True, False, True, "call"),  # inference weights, no_grad or not
        (True, True, False, "call"),  # under torch.no_grad
        (True, True, True, "autograd"),  # training
        (False, False, True, "autograd"),  # the CPU's plain path
    ):
        said.clear()
        with torch.set_grad_enabled(enabled):
            overlap.with_gradients(operand(cuda, False), operand(cuda, grad), "all_reduce")
        assert said == [path], (cuda, grad, enabled)


def test_a_call_that_needs_gradients_still_refuses_cpu_tensors(one_rank_group):
    a = bf16(64, 64).requires_grad_()
    with pytest.raises(ValueError, match="a is on cpu, expected a cuda tensor"):
        flashoverlap.gemm_all_reduce(a, bf16(64, 64))


def test_a_repeated_call_runs_what_its_first_decided_without_deciding(one_rank_group, monkeypatch, fresh_state):
    """A call like one decided before (same collective, config object, operand shapes, dtypes and
    devices, contiguous) runs the decision's runner straight away; anything that may decide
    otherwise, or needs the checks, decides: another shape, a dict config (resolved per call),
    operands that are not contiguous, counts given per call."""
    from flashoverlap import OverlapConfig, decision

    decided, ran = [], []

    def decide(a, weight, collective, *args):
        decided.append(collective)
        ex = flashoverlap.comm.exchange(collective, a.shape[0], 2)
        return decision.Decision(ex, lambda a, w, scales=None: ran.append(a.shape) or a)

    monkeypatch.setattr(decision, "decide", decide)
    monkeypatch.setattr(decision, "capturing", lambda a: False)
    a, w, cfg = bf16(64, 32), bf16(48, 32), OverlapConfig(comm_sms=8)
    for _ in range(3):
        flashoverlap.gemm_all_reduce(a, w)
        flashoverlap.gemm_all_reduce(a, w, config=cfg)
    assert decided == ["all_reduce"] * 2 and len(ran) == 6
    exchanged = []  # (autograd's forward: the exchange the call made, for the backward)
    assert flashoverlap.overlap._gemm_collective(a, w, "all_reduce", None, cfg, "nk", exchanged=exchanged) is a
    assert [ex.collective for ex in exchanged] == ["all_reduce"] and len(decided) == 2
    flashoverlap.gemm_all_reduce(bf16(32, 32), w)  # another shape
    flashoverlap.gemm_reduce_scatter(a, w)  # another collective
    flashoverlap.gemm_all_reduce(a, w, config={"comm_sms": 8})  # a dict: resolved, and decided, every call
    flashoverlap.gemm_all_reduce(a, w, config={"comm_sms": 8})
    flashoverlap.gemm_all_reduce(bf16(32, 64)[:, ::2], w)  # not contiguous: checked (and refused) in full
    flashoverlap.gemm_all_to_all(a, w, splits=[32, 32], output_splits=[32, 32])  # counts per call
    assert len(decided) == 8


def test_fp8_arguments_are_told_apart_without_comparing_scales():
    """Whether a call passed FP8 arguments is told by identity: a scale is never compared (``==``
    with None on a tensor goes through torch's refusal, about 10 us of host time or more on every
    FP8 call)."""

    class Scale:
        def __eq__(self, other):
            raise AssertionError("a scale was compared")

        __hash__ = object.__hash__

    given = flashoverlap.overlap._fp8_given
    assert not given((None, None, None, False))
    assert given((Scale(), Scale(), None, False)) and given((Scale(), None, None, False))
    assert given((None, None, torch.float16, False)) and given((None, None, None, True))


def test_a_repeated_call_decides_again_once_the_registry_is_reloaded(one_rank_group, monkeypatch, fresh_state):
    from flashoverlap import decision, registry

    decided = []
    monkeypatch.setattr(decision, "check_inputs", lambda a, w, layout: (a.shape[0], *w.shape))
    real = decision._decide
    monkeypatch.setattr(decision, "_decide", lambda *args: decided.append(1) or real(*args))
    a, w = bf16(64, 32), bf16(48, 32)
    for _ in range(2):
        flashoverlap.gemm_all_reduce(a, w)
    registry.reload()
    flashoverlap.gemm_all_reduce(a, w)
    assert len(decided) == 2


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_a_group_that_is_no_process_group_is_named(fn):
    """Not "cannot create weak reference to 'str' object" from deep inside: before any check that
    needs torch.distributed set up."""
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup or None, got str 'tp'"):
        fn(bf16(64, 64), bf16(64, 64), group="tp")
