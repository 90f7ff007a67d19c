"""flashoverlap.bench_model without GPUs: its arguments, the model shapes, its refusal to run
without CUDA, and one pass of its loop on a tiny model over gloo (the timing replaced)."""

import argparse

import pytest
import torch
import torch.distributed as dist

from flashoverlap import bench_model

from .helpers import spawn_ranks

pytest.importorskip("transformers")


def test_defaults_and_bad_arguments(capsys):
    args = bench_model.build_parser().parse_args([])
    assert (args.models, args.tokens, args.layers) == (["llama3-70b", "qwen2.5-72b"], [2048, 8192, 32768], 4)
    assert args.config is None and args.transport == "nvlink" and args.rounds == 18
    args = bench_model.build_parser().parse_args(["--tokens", "512", "--layers", "2", "--config", '{"comm_sms": 8}'])
    assert (args.tokens, args.layers, args.config) == ([512], 2, {"comm_sms": 8})
    for bad in (["--tokens", "0"], ["--layers", "two"], ["--models", "gpt-5"], ["--transport", "pigeon"]):
        with pytest.raises(SystemExit):
            bench_model.build_parser().parse_args(bad)
    assert "expected a positive integer, got '0'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(bench_model.MODELS))
def test_model_shapes_split_over_two_and_four_ranks_not_three(name):
    for world in (2, 4):
        config = bench_model.model_config(name, 3, world)
        assert config.num_hidden_layers == 3 and config.hidden_size == 8192
    with pytest.raises(ValueError, match=f"{name}: num_attention_heads=64 does not split over 3 ranks"):
        bench_model.model_config(name, 3, 3)


def test_row_parallel_shapes_are_the_patched_projections_gemms():
    """Llama-3-70B at TP 4: attention output K = 64 heads / 4 x 128, MLP down K = 28672 / 4."""
    assert bench_model.row_parallel_shapes("llama3-70b", 4, [2048, 8192]) == [
        (2048, 8192, 2048),
        (2048, 8192, 7168),
        (8192, 8192, 2048),
        (8192, 8192, 7168),
    ]
    assert bench_model.row_parallel_shapes("qwen2.5-72b", 2, [512]) == [(512, 8192, 4096), (512, 8192, 14784)]
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        bench_model.row_parallel_shapes("qwen2.5-72b", 3, [512])


def test_shapes_for_tp_print_a_tuner_shapes_file_without_gpus(capsys, tmp_path):
    from flashoverlap import bench

    args = ["--models", "llama3-70b", "qwen2.5-72b", "--tokens", "2048", "--shapes-for-tp", "4"]
    assert bench_model.main(args) == 0
    path = tmp_path / "shapes.yaml"
    path.write_text(capsys.readouterr().out)
    assert bench.load_shapes(str(path)) == [(2048, 8192, 2048), (2048, 8192, 7168), (2048, 8192, 7392)]
    assert bench_model.main(["--models", "llama3-70b", "--shapes-for-tp", "3"]) == 2
    assert "does not split over 3 ranks" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where no GPU is visible")
def test_without_gpus_it_says_so(capsys):
    assert bench_model.main(["--tokens", "128"]) == 2
    assert "needs CUDA GPUs (one per rank): none is visible here" in capsys.readouterr().err


def loop_worker(rank: int, world: int, store_path: str):
    """bench_model's loop on the CPU: a tiny Llama under the "llama3-70b" name, each variant run
    once in place of the timing; flashoverlap's output as plain's, the bound's not."""
    from transformers import LlamaConfig

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        tiny = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
        bench_model.model_config = lambda name, layers, world: LlamaConfig(**tiny, num_hidden_layers=layers)
        outputs = {}

        def time_variants(variants, rounds, block, warmup):
            for mode, fn in variants.items():
                outputs[mode] = fn(0)
            return {"plain": 4.0, "flashoverlap": 3.0, "bound": 2.0}

        import flashoverlap.timing

        flashoverlap.timing.time_variants = time_variants
        args = bench_model.build_parser().parse_args(["--tokens", "16", "--layers", "2", "--rounds", "8"])
        (row,) = bench_model.bench_model("llama3-70b", args, torch.device("cpu"))
        assert float(row["rel_err"]) < 1e-6 and row["patched"] == 4
        assert row["rounds"] == 12  # (what was timed: whole cycles of the three variants' six orders)
        assert (row["speedup"], row["bound_speedup"], row["hidden"]) == (1.3333, 2.0, 0.5)
        assert row["plain_tok_s"] == 4000 and row["flashoverlap_tok_s"] == round(16000 / 3)
        torch.testing.assert_close(outputs["flashoverlap"], outputs["plain"])
        assert not torch.allclose(outputs["bound"], outputs["plain"])
        assert "llama3-70b TP2     16 tokens" in bench_model.format_row(row)
    finally:
        dist.destroy_process_group()


def test_the_loop_runs_each_variant_on_a_tiny_model():
    spawn_ranks(2, loop_worker)


def test_positive_rejects_what_is_not_a_count():
    assert bench_model.positive("3") == 3
    with pytest.raises(argparse.ArgumentTypeError):
        bench_model.positive("-1")
