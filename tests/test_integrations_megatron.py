"""flashoverlap.integrations.megatron against Megatron-Core's own row-parallel linear: the layer
(all-reduce, sequence parallelism, bias kept apart, input scattered) and the local GPT spec's MLP
on the CPU over gloo (2 ranks, the plain path); a whole GPT model on every visible GPU."""

import warnings

import pytest
import torch
import torch.distributed as dist

from .helpers import rel_err, spawn_ranks

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
pytest.importorskip("megatron.core")
megatron = pytest.importorskip("flashoverlap.integrations.megatron")

HIDDEN, FFN, SEQ, BATCH = 64, 128, 8, 3


def init(rank: int, world: int, store_path: str, backend: str = "gloo") -> None:
    from megatron.core import parallel_state

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)


def finish() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def transformer_config(**kwargs):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=FFN,
        use_cpu_initialization=True,  # the same full weights on every rank, split
        params_dtype=torch.float64,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return TransformerConfig(**{**base, **kwargs})


def run(layer, x, g):
    """(output, bias returned, grad x, grad of every parameter) of one step on x with d loss / d out = g."""
    x = x.clone().requires_grad_()
    out, bias = layer(x)
    (out * g).sum().backward()
    return out, bias, x.grad, [p.grad for p in layer.parameters()]


def layer_worker(rank: int, world: int, store_path: str):
    """Ours against Megatron's, same weights. Megatron's reduce-scatter allocates on CUDA, so a
    sequence-parallel layer of ours is held against Megatron's all-reducing one: its rows of the
    output, the full output gradient (the adjoint of a reduce-scatter all-gathers it), and the bias
    gradient summed over the ranks (as Megatron's finalize_model_grads does for sequence-parallel
    parameters)."""
    from megatron.core.tensor_parallel import RowParallelLinear

    init(rank, world, store_path)
    try:
        gen = torch.Generator().manual_seed(1)
        full = torch.randn(SEQ, BATCH, FFN, generator=gen, dtype=torch.float64)
        g = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
        cols = slice(rank * FFN // world, (rank + 1) * FFN // world)
        # sequence_parallel, skip_bias_add (input_is_parallel=False: Megatron's scatter gathers its gradient on CUDA)
        for sp, skip in ((False, False), (True, False), (False, True)):
            layers = []
            for cls, seq_par in ((megatron.RowParallelLinear, sp), (RowParallelLinear, False)):
                config = transformer_config(sequence_parallel=seq_par, tensor_model_parallel_size=world)
                torch.manual_seed(0)
                layer = cls(FFN, HIDDEN, config=config, init_method=torch.nn.init.normal_, bias=True,
                            skip_bias_add=skip, input_is_parallel=True)  # fmt: skip
                torch.nn.init.normal_(layer.bias, generator=torch.Generator().manual_seed(2))  # (Megatron zeroes it)
                layers.append(layer)
            ours, theirs = layers
            x = full[:, :, cols]
            rows = slice(rank * SEQ // world, (rank + 1) * SEQ // world) if sp else slice(None)
            got, want = run(ours, x, g[rows]), run(theirs, x, g)
            torch.testing.assert_close(got[0], want[0][rows], msg=f"output {sp, skip}")
            assert (got[1] is ours.bias) == (want[1] is theirs.bias) == skip
            torch.testing.assert_close(got[2], want[2], msg=f"grad x {sp, skip}")
            grad_w, grad_b = got[3]
            if sp:
                dist.all_reduce(grad_b)
            for a, b in zip((grad_w, grad_b), want[3]):
                torch.testing.assert_close(a, b, msg=f"grad parameter {sp, skip}")
    finally:
        finish()


def spec_worker(rank: int, world: int, store_path: str):
    """The local GPT spec substituted: where its row-parallel linears were, ours; its MLP (built
    from the spec) as the original's; a GPT model built from it holds ours."""
    init(rank, world, store_path)
    try:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.spec_utils import build_module

        local = get_gpt_layer_local_spec()
        spec = megatron.flashoverlap_spec(local)
        attention, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
        assert attention.linear_proj is mlp.linear_fc2 is megatron.RowParallelLinear
        assert attention.linear_qkv is mlp.linear_fc1 is ColumnParallelLinear
        assert local.submodules.mlp.submodules.linear_fc2 is RowParallelLinear  # (a copy)

        config = transformer_config(gated_linear_unit=True)
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        outputs = []
        for which in (local, spec):
            torch.manual_seed(0)
            outputs.append(run(build_module(which.submodules.mlp, config=config), x, torch.ones(SEQ, BATCH, HIDDEN)))
        for got, want in zip(outputs[1][::2], outputs[0][::2]):  # output, grad x
            torch.testing.assert_close(got, want)
        for got, want in zip(outputs[1][3], outputs[0][3]):
            torch.testing.assert_close(got, want)

        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=64)
        kinds = {type(m) for m in model.modules()}
        assert megatron.RowParallelLinear in kinds and RowParallelLinear not in kinds
    finally:
        finish()


@pytest.mark.parametrize("fn", [layer_worker, spec_worker], ids=["layer", "spec"])
def test_megatron_row_parallel_matches_megatron_on_gloo(fn):
    spawn_ranks(2, fn)


def test_a_spec_without_megatron_row_parallel_linears_is_refused():
    from megatron.core.transformer.spec_utils import ModuleSpec

    with pytest.raises(ValueError, match="no megatron.core.tensor_parallel.RowParallelLinear in this spec"):
        megatron.flashoverlap_spec(ModuleSpec(module=torch.nn.Linear))


def gpt_worker(rank: int, world: int, store_path: str):
    """A bf16 GPT model (local spec against flashoverlap's) on every visible GPU: logits, and the
    gradients of one step, 4096 tokens (several waves per GEMM)."""
    init(rank, world, store_path, "nccl")
    try:
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.module import Float16Module

        tensor_parallel.model_parallel_cuda_manual_seed(0)  # (Megatron's CUDA RNG tracker)
        config = transformer_config(
            hidden_size=2048,
            ffn_hidden_size=4096,
            num_attention_heads=16,
            params_dtype=torch.bfloat16,
            bf16=True,
            normalization="RMSNorm",
            add_bias_linear=False,
            gated_linear_unit=True,
        )
        ids = torch.randint(0, 128, (1, 4096), generator=torch.Generator().manual_seed(5)).cuda()
        positions = torch.arange(4096, device="cuda").unsqueeze(0)
        results = []
        for spec in (get_gpt_layer_local_spec(), megatron.flashoverlap_spec(get_gpt_layer_local_spec())):
            torch.manual_seed(0)
            # as Megatron trains it: every parameter (Torch's norms too, float32 where Apex is missing) in bf16
            model = Float16Module(
                config, GPTModel(config=config, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=4096)
            ).cuda()
            logits = model(ids, positions, None)
            logits.float().square().mean().backward()
            results.append((logits, [p.grad for p in model.parameters()]))
        (got, got_grads), (want, want_grads) = results[1], results[0]
        assert rel_err(got.float(), want.float()) < 3e-2
        for a, b in zip(got_grads, want_grads):
            assert rel_err(a.float(), b.float()) < 5e-2
        torch.cuda.synchronize()
    finally:
        finish()


@pytest.mark.multigpu
def test_megatron_gpt_model_matches_the_local_spec_on_all_gpus():
    spawn_ranks(torch.cuda.device_count(), gpt_worker, timeout=600)
