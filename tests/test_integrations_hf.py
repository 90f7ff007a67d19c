"""flashoverlap.patch on transformers' own tensor parallelism: the patched model against the same
model unpatched (forward, generate, training), on the CPU over gloo (2 ranks, the plain path) and
on every visible GPU (NCCL, the overlapped call)."""

import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import flashoverlap
from flashoverlap.integrations import hf

from .helpers import rel_err, spawn_ranks

transformers = pytest.importorskip("transformers")

LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attention_bias=True,  # o_proj's bias: replicated, added once after the all-reduce
    mlp_bias=True,
)
ROW_PARALLEL = [f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.o_proj", "mlp.down_proj")]


def init(rank: int, world: int, store_path: str, backend: str = "gloo") -> torch.device:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # (read by transformers' TP)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    return device


def calls() -> list:
    """A list that grows by one for each overlapped call a patched module makes in this process."""
    made, call = [], flashoverlap.with_gradients
    flashoverlap.with_gradients = lambda *args, **kwargs: made.append(1) or call(*args, **kwargs)
    return made


def grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (this rank's shard), taken and cleared."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = hf._local(p.grad).clone()
        p.grad = None
    return out


def check_model(model, ids: torch.Tensor, close, config=None) -> None:
    """Patched against unpatched: eval forward, greedy generate, a training step's loss and every
    gradient; then unpatch and without_collectives."""
    made = calls()
    with torch.no_grad():
        want = model(ids).logits
    want_tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert flashoverlap.patch(model, config=config) == ROW_PARALLEL
    with torch.no_grad():
        close(model(ids).logits, want, "forward")
    assert len(made) == len(ROW_PARALLEL)
    tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert tokens.shape == want_tokens.shape
    if close.exact:
        assert torch.equal(tokens, want_tokens)
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    got = grads(model)
    assert hf.unpatch(model) == ROW_PARALLEL
    want_loss = model(ids, labels=ids).loss
    want_loss.backward()
    close(loss, want_loss, "loss")
    for name, want_grad in grads(model).items():
        close(got[name], want_grad, f"grad {name}")
    model.eval()
    with torch.no_grad():
        close(model(ids).logits, want, "unpatched")
        assert hf.without_collectives(model) == ROW_PARALLEL
        assert not torch.allclose(model(ids).logits, want)  # (each rank's partial sums alone)
    hf.unpatch(model)


class _Close:
    def __init__(self, tol: float | None):
        self.tol, self.exact = tol, tol is None

    def __call__(self, got, want, what):
        if self.exact:
            torch.testing.assert_close(got, want, msg=what)
        else:
            assert rel_err(got.float(), want.float()) < self.tol, what


def pretrained_worker(rank: int, world: int, store_path: str, checkpoint: str):
    """A checkpoint loaded with from_pretrained's own tensor parallelism (tp_size = world)."""
    init(rank, world, store_path)
    try:
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
        from transformers.distributed import DistributedConfig

        if rank == 0:
            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(checkpoint)
        dist.barrier()
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, distributed_config=DistributedConfig(tp_size=world), dtype=torch.float32
        )
        ids = torch.randint(0, LLAMA["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
        check_model(model, ids, _Close(None))
    finally:
        dist.destroy_process_group()


def config_worker(rank: int, world: int, store_path: str):
    """Models built from a config (tensor_parallel_from_config): Qwen2 (q/k/v biases), an MoE
    (Mixtral: its experts left alone, with a warning), and the refusals."""
    init(rank, world, store_path)
    try:
        from transformers import LlamaConfig, LlamaModel, MixtralConfig, Qwen2Config

        ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
        small = {k: LLAMA[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
        heads = dict(num_attention_heads=4, num_key_value_heads=2)
        qwen = hf.tensor_parallel_from_config(Qwen2Config(**small, **heads), dtype=torch.float32)
        with torch.no_grad():
            want = qwen(ids).last_hidden_state
            assert flashoverlap.patch(qwen) == [n.removeprefix("model.") for n in ROW_PARALLEL]
            torch.testing.assert_close(qwen(ids).last_hidden_state, want)

        mixtral_config = MixtralConfig(**small, **heads, num_local_experts=4, num_experts_per_tok=2)
        moe = hf.tensor_parallel_from_config(mixtral_config, dtype=torch.float32)
        with torch.no_grad():
            want = moe(ids).last_hidden_state
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert flashoverlap.patch(moe) == ["layers.0.self_attn.o_proj", "layers.1.self_attn.o_proj"]
            assert any("2 MoE experts modules (e.g. layers.0.mlp.experts)" in str(w.message) for w in caught)
            torch.testing.assert_close(moe(ids).last_hidden_state, want)

        # a bad config raises when patching, not at the first forward (where the CPU's plain path ignores it)
        with pytest.raises(ValueError, match=r"unknown key\(s\) \['comm_smz'\]"):
            flashoverlap.patch(qwen, config={"comm_smz": 4})
        with pytest.raises(FileNotFoundError, match="config file not found"):
            flashoverlap.patch(qwen, config="no/such/config.yaml")
        with pytest.raises(ValueError, match="LlamaModel is not tensor-parallel: load it with"):
            flashoverlap.patch(LlamaModel(LlamaConfig(**small, **heads)))
        moe.layers[0].self_attn.o_proj = torch.nn.Identity()  # a planned row-parallel module of another kind
        with pytest.raises(ValueError, match="layers.0.self_attn.o_proj: a Identity, not an nn.Linear"):
            flashoverlap.patch(moe)
    finally:
        dist.destroy_process_group()


def test_patched_checkpoint_loaded_tensor_parallel_matches_unpatched(tmp_path):
    pytest.importorskip("accelerate")  # (from_pretrained's tensor parallelism asks for it)
    spawn_ranks(2, pretrained_worker, str(tmp_path / "checkpoint"))


def test_patched_models_from_configs_match_and_refusals():
    spawn_ranks(2, config_worker)


def test_a_missing_transformers_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers.distributed", None)
    with pytest.raises(ImportError, match=r"needs transformers >=5.17,<5.18 \(DTensor tensor parallelism\)"):
        flashoverlap.patch(torch.nn.Linear(8, 8))


def gpu_worker(rank: int, world: int, store_path: str):
    """bf16 on every visible GPU, long enough a prefill (4096 tokens) for several waves, the
    overlapped call forced (config={}): patched against unpatched."""
    device = init(rank, world, store_path, "nccl")
    try:
        from transformers import LlamaConfig

        config = LlamaConfig(**{**LLAMA, "hidden_size": 2048, "intermediate_size": 4096, "num_attention_heads": 16})
        config.num_key_value_heads = 8
        model = hf.tensor_parallel_from_config(config, device=device, head=True)
        ids = torch.randint(0, LLAMA["vocab_size"], (1, 4096), generator=torch.Generator().manual_seed(3))
        check_model(model, ids.to(device), _Close(5e-2), config={})
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


@pytest.mark.multigpu
def test_patched_model_matches_unpatched_on_all_gpus():
    spawn_ranks(torch.cuda.device_count(), gpu_worker, timeout=600)
