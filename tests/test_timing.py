"""Timing variants: their orders, their rounds (CUDA faked) and the statistics of their rounds (CPU)."""

import collections
import math
import random

import pytest
import torch

from flashoverlap import timing


def test_rounds_rotate_operand_sets_and_graphs_need_a_warm_up():
    seen = []
    run = timing._eager(seen.append, 3)
    run(0), run(2)
    assert seen == [0, 1, 2, 6, 7, 8]  # round r: calls r * block .. r * block + block - 1
    with pytest.raises(ValueError, match="warm-up"):  # before any CUDA call: capture needs plans made
        timing.time_variants({"x": seen.append}, rounds=1, block=1, warmup=0, graphs=True)


@pytest.mark.parametrize("n", range(1, 10))
def test_balanced_orders_put_every_variant_after_every_other_equally_often(n):
    orders = timing.balanced_orders(n)
    assert len(orders) == (n if n % 2 == 0 or n == 1 else 2 * n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    assert collections.Counter(order[0] for order in orders) == dict.fromkeys(range(n), len(orders) // n)
    pairs = collections.Counter((x, y) for order in orders for x, y in zip(order, order[1:]))
    assert set(pairs) == {(x, y) for x in range(n) for y in range(n) if x != y}
    assert len(set(pairs.values())) <= 1  # each pair as often as any other


def test_statistics():
    assert timing.median_ms([3.0, 1.0, 2.0, 100.0]) == 2.5
    # enough operand sets that consecutive iterations miss a 50 MB L2
    sets = timing.input_sets(1024, 1024, 1024, torch.bfloat16, 50 << 20)
    assert sets * 2 * 1024 * 1024 * 2 >= 3 * (50 << 20) and sets >= 2


def test_a_variant_s_time_is_the_slowest_rank_s_median_and_its_spread_the_widest_rank_s():
    ranks = [[1.0, 1.1, 0.9, 1.05], [1.2, 1.3, 1.0, 1.4]]
    assert timing.slowest(ranks) == pytest.approx(1.25)
    # the widest rank's range without its slowest and fastest round: rank 1's 1.3 - 1.2
    assert timing.spread(ranks) == pytest.approx(0.1 / 2 / 1.25)
    # one stray round of four moves the median little and the spread not at all
    assert timing.spread([[0.2, 0.2, 0.21, 0.62]]) == pytest.approx(0.01 / 2 / 0.205)
    assert timing.spread([[1.0, 1.2, 1.1]]) == pytest.approx(0.2 / 2 / 1.1)  # fewer rounds: the whole range
    not_captured = [[math.nan] * 4, [math.nan] * 4]
    assert math.isnan(timing.slowest(not_captured)) and math.isnan(timing.spread(not_captured))


def test_a_speedup_is_paired_round_by_round_and_the_least_over_ranks():
    # the same work; the host's speed moves between turns (1.0, 2.0, 1.5 ms per call) and one turn
    # of the variant caught 10 % of jitter: both medians are that turn's, 10 % apart, while the
    # turn by turn ratios' median says "the same"
    seq = [[1.0, 1.0, 2.0, 2.0, 1.5]]
    same = [[1.0, 1.0, 2.0, 2.0, 1.35]]
    assert timing.slowest(seq) / timing.slowest(same) == pytest.approx(1.5 / 1.35)
    assert timing.paired_speedup(seq, same) == pytest.approx(1.0)
    assert timing.paired_speedup(seq, [[0.8 * t for t in seq[0]]]) == pytest.approx(1.25)
    # the least over ranks; NaN (a variant some rank could not capture) stays NaN
    assert timing.paired_speedup([[1.0, 1.0], [1.0, 1.0]], [[0.5, 0.5], [0.8, 0.8]]) == pytest.approx(1.25)
    assert math.isnan(timing.paired_speedup([[1.0, 1.0]], [[math.nan, math.nan]]))
    # the noise of a paired speedup: the drift that moves both alike adds none, a ratio that moves does
    assert timing.spread(seq) > 0.3 and timing.paired_spread(seq, [[0.8 * t for t in seq[0]]]) == pytest.approx(0)
    assert timing.paired_spread([[1.0] * 4], [[1.0, 0.5, 1.0, 0.5]]) == pytest.approx(0.5 / 1.5)
    wide = [[1.0] * 4, [1.0, 0.5, 1.0, 0.5]]  # the widest rank's
    assert timing.paired_spread([[1.0] * 4, [1.0] * 4], wide) == pytest.approx(0.5 / 1.5)


def test_a_paired_speedup_s_interval_holds_it_and_narrows_with_rounds():
    """The bootstrap interval of a paired speedup: it holds the speedup, is the same on every ask,
    narrows with more rounds of the same noise and widens with the level, is a point where every
    round agrees, rests on medians (three rounds of 3x move it nowhere), takes the slowest rank's
    view over the rounds every rank has, and is NaN where a round is or no round is."""
    rng = random.Random(1)
    seq = [[1.0] * 200]
    noisy = [[1.0 / rng.gauss(1.02, 0.03) for _ in range(200)]]
    low, high = timing.paired_interval(seq, noisy)
    assert low < timing.paired_speedup(seq, noisy) < high and (low, high) == timing.paired_interval(seq, noisy)
    assert 0.99 < low < 1.02 < high < 1.05
    few = timing.paired_interval([seq[0][:20]], [noisy[0][:20]])
    assert few[1] - few[0] > high - low
    half = timing.paired_interval(seq, noisy, level=0.5)
    assert low < half[0] < half[1] < high
    assert timing.paired_interval(seq, [[0.8] * 200]) == pytest.approx((1.25, 1.25))
    assert timing.paired_interval([[1.0] * 30], [[1.0] * 27 + [1 / 3] * 3])[1] == pytest.approx(1.0)
    slower_rank = timing.paired_interval([seq[0], seq[0]], [noisy[0], [1.0] * 150])
    assert slower_rank[1] == pytest.approx(1.0)
    assert all(math.isnan(x) for x in timing.paired_interval([[1.0, 1.0]], [[math.nan, 1.0]]))
    assert all(math.isnan(x) for x in timing.paired_interval([], []))


def test_an_interval_draws_the_same_rounds_for_every_rank():
    """Two ranks whose rounds swing opposite ways (one slow where the other is fast, as when they
    share a round's host): drawn together, the least of their medians is at most the middle of the
    two ratios (1.01: one rank is at or below it in every draw); drawn apart, both would be at 1.11
    in about a fifth of the draws, and so would the interval's top."""
    swing = [0.9, 1.1] * 15
    assert timing.paired_interval([[1.0] * 30] * 2, [swing, swing[::-1]])[1] == pytest.approx((1 / 0.9 + 1 / 1.1) / 2)


def test_rounds_are_timed_without_garbage_collections():
    """Inside, no collection can pause a timed block; after, the collector is as it was (also when
    the rounds raise, and off where the caller had it off)."""
    import gc

    assert gc.isenabled()
    with timing.without_collections():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), timing.without_collections():
        raise RuntimeError("a round failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with timing.without_collections():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def _fake_gpu(monkeypatch, clock: list[float]) -> None:
    """time_samples on the CPU: CUDA events read ``clock[0]`` (the GPU's time, which each fake call
    advances), one rank, the collectives copies."""

    class Event:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            self.at = clock[0]

        def elapsed_time(self, end):
            return end.at - self.at

    real_empty = torch.empty
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self: self)
    monkeypatch.setattr(torch, "empty", lambda *args, device=None, **kw: real_empty(*args, **kw))
    monkeypatch.setattr(timing.comm, "agree", lambda *args: None)
    monkeypatch.setattr(timing.comm, "all_gather_single", lambda out, table, group=None: out.copy_(table))
    monkeypatch.setattr(timing.dist, "barrier", lambda group=None: None)
    monkeypatch.setattr(timing.dist, "get_world_size", lambda group=None: 1)


def test_time_samples_times_every_variant_s_blocks_without_garbage_collections(monkeypatch):
    """time_samples on the CPU (the CUDA pieces faked, one rank; each call advances a clock by its
    variant's cost): every variant's rounds (whole cycles of the orders) give its ms per call; the
    warm-up runs first with the collector as it was, the timed blocks without it, on rotated operand
    indices, and the collector is back on after."""
    import gc

    clock, calls = [0.0], []

    def variant(name, ms):
        def call(i):
            calls.append((name, i, gc.isenabled()))
            clock[0] += ms

        return call

    _fake_gpu(monkeypatch, clock)
    samples = timing.time_samples({"a": variant("a", 2.0), "b": variant("b", 3.0)}, rounds=3, block=2, warmup=1)
    assert samples == {"a": [[2.0] * 4], "b": [[3.0] * 4]}  # 3 rounds: two whole cycles of two orders
    warm, timed = calls[:2], calls[2:]
    assert warm == [("a", 0, True), ("b", 0, True)] and len(timed) == 16
    assert not any(enabled for *_, enabled in timed) and gc.isenabled()
    for name in "ab":
        assert [i for n, i, _ in timed if n == name] == list(range(8))  # round r: calls 2r, 2r + 1


def test_host_floor_times_a_call_no_faster_than_its_host_enqueues_it(monkeypatch):
    """With ``host_floor`` a round's time per call is the longer of the GPU's (the events) and the
    host's to enqueue it: a call with 1 ms of GPU work and 4 ms of host work per call is 4 ms, one
    whose GPU work outlasts its host's stays at the GPU's; without it, the events alone."""
    clock, host = [0.0], [0.0]

    def variant(gpu_ms, host_ms):
        def call(i):
            clock[0] += gpu_ms
            host[0] += host_ms / 1e3

        return call

    _fake_gpu(monkeypatch, clock)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: host[0])
    variants = {"host-bound": variant(1.0, 4.0), "gpu-bound": variant(3.0, 0.5)}
    floored = timing.time_samples(variants, rounds=2, block=2, warmup=1, host_floor=True)
    assert floored == {"host-bound": [[4.0] * 2], "gpu-bound": [[3.0] * 2]}
    assert timing.time_samples(variants, rounds=2, block=2, warmup=1) == {
        "host-bound": [[1.0] * 2],
        "gpu-bound": [[3.0] * 2],
    }


def test_short_calls_are_timed_in_longer_rounds():
    """Rounds of a few 0.1 ms calls time a host-bound plain call slow against an overlapped one (the
    GPU idles at a round's start): short GEMMs get more calls per round, long ones the fewest."""
    low, high = timing.ROUND_CALLS
    assert timing.round_calls(8, 8192, 2048) == timing.round_calls(1024, 8192, 2048) == high
    assert timing.round_calls(8192, 8192, 8192) == timing.round_calls(16384, 8192, 14336) == low
    sizes = [timing.round_calls(m, 8192, 7168) for m in (256, 1024, 2048, 4096, 8192)]
    assert sizes == sorted(sizes, reverse=True) and low < sizes[2] < high
    assert timing.round_calls(8192, 8192, 8192, fewest=8) == 8 and timing.round_calls(8, 8, 8, most=12) == 12
