"""What the tuner measures on GPUs, with the timing stubbed (CPU)."""

import pytest
import torch

from flashoverlap import comm, tune_measure


def test_size_models_name_their_variants_and_fit_what_was_timed(monkeypatch):
    """The measured models' common part, with time_variants stubbed: one variant per size, named by
    the label (what the ranks' agreement check compares), fitted to the times it returns."""

    seen, uncapturable = [], []

    def timed(variants, rounds, block, warmup, graphs=False):
        seen.append((list(variants), graphs))
        if graphs and uncapturable[-1]:  # (a variant some rank could not capture: NaN on every rank)
            return dict.fromkeys(variants, float("nan"))
        return {name: 0.01 + nbytes / 1e8 for name, nbytes in zip(variants, sizes)}

    sizes = [mb << 20 for mb in tune_measure.COMM_SIZES_MB]
    names = [f"exchange {mb}MB" for mb in tune_measure.COMM_SIZES_MB]
    monkeypatch.setattr(tune_measure, "time_variants", timed)
    for graphs, fails, timings in [(False, False, [False]), (True, False, [True]), (True, True, [True, False])]:
        seen.clear()
        uncapturable.append(fails)
        model = tune_measure.fit_sizes("exchange", lambda mb: (lambda i: None, mb << 20), 3, graphs=graphs)
        assert seen == [(names, g) for g in timings]  # graph replays, eagerly where they could not be captured
        assert model.latency_ms == pytest.approx(0.01) and model.bytes_per_ms == pytest.approx(1e8)


def test_the_pull_model_is_per_group_of_a_call(monkeypatch):
    """pull_model: measured as PULL_GROUPS groups a call (one claim), as CUDA-graph replays; the
    model is one group's: the call's latency and times shared by its groups, at the call's rate."""
    from flashoverlap.tune_model import CommModel

    groups = tune_measure.PULL_GROUPS
    calls = CommModel(0.08, 1e8, ((8e6, 0.16), (16e6, 0.24)))
    asked = []
    monkeypatch.setattr(tune_measure, "_pulls", lambda dtype, reduction: reduction)
    monkeypatch.setattr(tune_measure, "fit_sizes", lambda label, make, rounds, graphs: asked.append(graphs) or calls)
    tune_measure.pull_model.cache_clear()
    try:
        group = tune_measure.pull_model(torch.bfloat16, 3)
    finally:
        tune_measure.pull_model.cache_clear()
    assert asked == [True]
    assert group.latency_ms == pytest.approx(0.08 / groups) and group.bytes_per_ms == calls.bytes_per_ms
    assert group.time_ms(8e6 / groups) == pytest.approx(0.16 / groups)
    assert group.time_ms(12e6 / groups) == pytest.approx(0.20 / groups)


def test_measured_pulls_split_each_size_into_equal_groups():
    """tune_measure.pull_plan: every measured size (of the 16-bit results pulls move) in equal groups."""
    for mb in tune_measure.COMM_SIZES_MB:
        numel = (mb << 20) // 2
        bounds = tune_measure.pull_plan(numel).bounds
        assert len(bounds) == tune_measure.PULL_GROUPS + 1 and bounds[0] == 0 and bounds[-1] == numel
        assert len({hi - lo for lo, hi in zip(bounds, bounds[1:])}) == 1


def test_the_pull_model_claims_and_releases_each_measurement_as_a_call_does(monkeypatch):
    """Without Peers.claim / copied around each measured call a rank ran ahead, one of its ready
    signals was lost and the other rank waited forever (the tuner hung so on two GPUs); and the
    pulls wait for the other rank's counter of each group, which no GEMM bumps here (Peers.mark)."""

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
    pulled = []

    def pull(peers, g, chunk, into):
        steps.append(f"pull {g}")
        pulled.append((chunk.numel(), tuple(into.shape)))

    monkeypatch.setattr(comm, "_pull", pull)
    call, nbytes = tune_measure._pulls(torch.bfloat16)(1)
    assert nbytes == 1 << 20
    call(0)
    call(1)
    groups = tune_measure.PULL_GROUPS
    assert steps == [*(step for g in range(groups) for step in (f"mark {g}", f"pull {g}")), "copied", "claim"] * 2
    share = (1 << 20) // 2 // groups  # each group's share of the call's elements, from each of 2 ranks
    assert pulled == [(share, (2, share))] * 2 * groups
