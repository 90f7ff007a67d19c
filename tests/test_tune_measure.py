"""What the tuner measures on GPUs, with the timing stubbed (CPU)."""

import pytest
import torch

from flashoverlap import comm, tune_measure


def test_size_models_name_their_variants_and_fit_what_was_timed(monkeypatch):
    """The measured models' common part, with time_variants stubbed: one variant per size, named by
    the label (what the ranks' agreement check compares), fitted to the times it returns."""

    seen = []

    def timed(variants, rounds, block, warmup):
        seen.append(list(variants))
        return {name: 0.01 + nbytes / 1e8 for name, nbytes in zip(variants, sizes)}

    sizes = [mb << 20 for mb in tune_measure.COMM_SIZES_MB]
    monkeypatch.setattr(tune_measure, "time_variants", timed)
    model = tune_measure.fit_sizes("exchange", lambda mb: (lambda i: None, mb << 20), 3)
    assert seen == [[f"exchange {mb}MB" for mb in tune_measure.COMM_SIZES_MB]]
    assert model.latency_ms == pytest.approx(0.01) and model.bytes_per_ms == pytest.approx(1e8)


def test_the_pull_model_claims_and_releases_each_measurement_as_a_call_does(monkeypatch):
    """Without Peers.claim / copied around each measured pull a rank ran ahead, one of its ready
    signals was lost and the other rank waited forever (the tuner hung so on two GPUs); and the
    pulls wait for the other rank's counter, which no GEMM bumps here (Peers.mark)."""

    steps = []

    class Recorder:
        world = 2

        def __init__(self, group, device):
            pass

        def buffer(self, numel, dtype):
            return torch.empty(numel, dtype=dtype)

        def claim(self):
            steps.append("claim")

        def mark(self, g):
            steps.append(f"mark {g}")

        def copied(self):
            steps.append("copied")

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch, "randn", lambda n, device=None: torch.zeros(n))
    monkeypatch.setattr(torch, "empty", lambda *shape, dtype=None, device=None: torch.zeros(*shape, dtype=dtype))
    monkeypatch.setattr(comm.peer, "Peers", Recorder)
    monkeypatch.setattr(comm, "_pull", lambda peers, g, chunk, into: steps.append(f"pull {g}"))
    call, nbytes = tune_measure._pulls(torch.bfloat16)(1)
    assert nbytes == 1 << 20
    call(0)
    call(1)
    assert steps == ["mark 0", "pull 0", "copied", "claim"] * 2
