"""The tuner's cost model and partition search on synthetic problems, and its predictions from
constants at any world size (CPU)."""

import dataclasses

import numpy as np
import pytest

from flashoverlap import tune_predict
from flashoverlap.tune_model import (
    CommModel,
    HostModel,
    Problem,
    best_partition,
    choose,
    fit_comm,
    fit_host,
    makespan,
    partitions,
    pick_finalists,
    wave_bytes,
    with_local_adds,
)
from flashoverlap.tune_predict import H200, nccl_comm, predict, pull_comm, pull_counts, ring_share


def problem(rng, waves=None, latency=None, bandwidth=None) -> Problem:
    waves = waves or int(rng.integers(1, 10))
    wave_bytes = [8e6] * (waves - 1) + [float(rng.uniform(1e6, 8e6))]
    during = CommModel(latency if latency is not None else rng.uniform(0.005, 0.05), bandwidth or rng.uniform(2e7, 2e8))
    return Problem(tuple(wave_bytes), float(rng.uniform(0.05, 0.2)), during, CommModel(during.latency_ms, 2.5e8))


def test_dynamic_programming_finds_the_brute_force_optimum():
    rng = np.random.default_rng(0)
    for _ in range(40):
        p = problem(rng)
        partition, best = best_partition(p)
        brute = min(makespan(p, c) for c in partitions(p.num_waves))
        assert best == pytest.approx(brute) and makespan(p, partition) == pytest.approx(best)


def test_finalists_hedge_each_measured_candidate_with_its_default_partition():
    rng = np.random.default_rng(5)
    problems = [problem(rng, waves=6) for _ in range(5)]
    choices = [(choose(p, 10.0), j) for j, p in enumerate(problems)]
    defaults = [(2, 2, 2), (3, 3), (1, 5), (6,), (4, 2)]
    ranked = sorted(choices, key=lambda cj: cj[0].overlap_ms)
    top = [j for _, j in ranked[:2]]
    picked = pick_finalists(choices, problems, defaults, top=2, plain=ranked[-1][1])
    assert picked[:2] == ranked[:2]  # the predicted best first, as predicted
    pairs = [(c.partition, j) for c, j in picked]
    assert len(pairs) == len(set(pairs))  # each (partition, candidate) measured once
    expected = {(ranked[i][0].partition, ranked[i][1]) for i in range(2)}
    expected |= {(defaults[j], j) for j in [*top, ranked[-1][1]]}  # hedges: the top's and the defaults'
    assert set(pairs) == expected
    for c, j in picked:  # each priced by its own problem
        assert c.overlap_ms == pytest.approx(makespan(problems[j], c.partition))
        assert (c.sequential_ms, c.margin) == (10.0, 0.02)
    # a default partition that is the model's pick already is not measured twice
    same = [(choose(problems[0], 10.0), 0)]
    assert len(pick_finalists(same, problems, [same[0][0].partition], top=4, plain=0)) == 1


def test_finalists_take_the_best_predicted_of_every_way_of_communicating():
    """pick_finalists with ``kinds``: the top, then the best predicted candidate of each kind the
    top lacks (the model errs by kind), each hedged with its default partition as the top's are."""
    rng = np.random.default_rng(7)
    problems = [problem(rng, waves=6) for _ in range(6)]
    choices = [(choose(p, 10.0), j) for j, p in enumerate(problems)]
    ranked = sorted(choices, key=lambda cj: cj[0].overlap_ms)
    order = [j for _, j in ranked]
    kinds = ["all_reduce"] * 6
    kinds[order[4]] = kinds[order[5]] = "pull"  # the two predicted worst pull
    defaults = [(6,)] * 6
    picked = pick_finalists(choices, problems, defaults, top=2, plain=None, kinds=kinds)
    assert picked[:3] == ranked[:2] + [ranked[4]]  # the best pull, not the worse one
    assert {j for _, j in picked} == {order[0], order[1], order[4]}
    assert ((6,), order[4]) in [(c.partition, j) for c, j in picked]  # hedged too
    assert pick_finalists(choices, problems, defaults, top=2, plain=None)[:2] == ranked[:2]  # no kinds: the top


def test_the_search_stays_exact_with_host_time_per_group():
    rng = np.random.default_rng(2)
    for _ in range(40):
        p = problem(rng)
        host = HostModel(float(rng.uniform(0, 0.3)), float(rng.uniform(0, 0.1)))
        hosted = Problem(p.wave_bytes, p.wave_ms, p.during, p.tail, host)
        partition, best = best_partition(hosted)
        brute = min(makespan(hosted, c) for c in partitions(p.num_waves))
        assert best == pytest.approx(brute) and makespan(hosted, partition) == pytest.approx(best)


def test_the_search_stays_exact_when_collectives_wait_for_a_late_budget():
    rng = np.random.default_rng(6)
    for _ in range(40):
        p = problem(rng)
        late = dataclasses.replace(p, start_wave=int(rng.integers(0, p.num_waves + 1)))
        partition, best = best_partition(late)
        brute = min(makespan(late, c) for c in partitions(p.num_waves))
        assert best == pytest.approx(brute) and makespan(late, partition) == pytest.approx(best)
        assert best >= best_partition(p)[1] - 1e-12  # waiting never helps the communication
    # one wave per group, 1 ms each of GEMM and of collective: the first group's collective waits
    # for the end of wave 2 instead of 1, and pushes the rest (1 ms per group from then on)
    paced = Problem((1.0,) * 4, 1.0, CommModel(0.0, 1.0), CommModel(0.0, 1.0))
    assert makespan(paced, (1, 1, 1, 1)) == pytest.approx(5.0)
    assert makespan(dataclasses.replace(paced, start_wave=2), (1, 1, 1, 1)) == pytest.approx(6.0)


def test_the_search_stays_exact_with_the_last_collective_beside_the_backlog():
    rng = np.random.default_rng(9)
    for _ in range(40):
        p = problem(rng)
        apart = dataclasses.replace(p, start_wave=int(rng.integers(0, p.num_waves + 1)), tail_apart=True)
        partition, best = best_partition(apart)
        brute = min(makespan(apart, c) for c in partitions(p.num_waves))
        assert best == pytest.approx(brute) and makespan(apart, partition) == pytest.approx(best)
        behind = dataclasses.replace(apart, tail_apart=False)
        assert all(makespan(apart, c) <= makespan(behind, c) + 1e-12 for c in partitions(p.num_waves, 3))
    # 1 ms per wave and per collective, none before wave 2: three groups queue behind one another
    # until 5 ms; the last starts at the GEMM's end (4 ms) beside them instead of at 5
    paced = Problem((1.0,) * 4, 1.0, CommModel(0.0, 1.0), CommModel(0.0, 1.0), start_wave=2)
    assert makespan(paced, (1, 1, 1, 1)) == pytest.approx(6.0)
    assert makespan(dataclasses.replace(paced, tail_apart=True), (1, 1, 1, 1)) == pytest.approx(5.0)


def test_the_search_stays_exact_with_rows_kept_locally():
    """The rows layout of reduce-scatter / all-to-all: the last waves are the rank's own rows, added
    or copied locally instead of communicated."""
    rng = np.random.default_rng(4)
    for _ in range(40):
        p = problem(rng)
        own = int(rng.integers(0, p.num_waves + 1))
        sent = tuple(0.0 if w >= p.num_waves - own else b for w, b in enumerate(p.wave_bytes))
        kept = tuple(b if w >= p.num_waves - own else 0.0 for w, b in enumerate(p.wave_bytes))
        local = CommModel(float(rng.uniform(0.001, 0.01)), float(rng.uniform(2e8, 2e9)))
        rows = Problem(sent, p.wave_ms, p.during, p.tail, p.host, kept, local)
        partition, best = best_partition(rows)
        brute = min(makespan(rows, c) for c in partitions(p.num_waves))
        assert best == pytest.approx(brute) and makespan(rows, partition) == pytest.approx(best)


def test_work_after_the_last_collective_adds_to_every_partition_and_competes_with_the_host():
    """Work after the last collective (a local all-reduce's adds where the GEMM leaves them no SM)
    costs every partition the same; the host's enqueue time still bounds a call from below."""
    rng = np.random.default_rng(5)
    for _ in range(20):
        p = problem(rng)
        finish = float(rng.uniform(0.01, 0.5))
        host = HostModel(float(rng.uniform(0, 1.5)), float(rng.uniform(0, 0.1)))
        local = Problem(p.wave_bytes, p.wave_ms, p.during, p.tail, host, finish_ms=finish)
        for c in partitions(p.num_waves, 3):
            plain = makespan(Problem(p.wave_bytes, p.wave_ms, p.during, p.tail), c)
            assert makespan(local, c) == pytest.approx(max(plain + finish, host.time_ms(len(c))))
        partition, best = best_partition(local)
        assert best == pytest.approx(min(makespan(local, c) for c in partitions(p.num_waves)))


def test_a_local_all_reduce_adds_group_by_group_with_sms_left_else_after_the_gemm():
    rng = np.random.default_rng(6)
    adds = CommModel(0.002, 3e9)
    for _ in range(10):
        p = problem(rng)
        spared, starved = with_local_adds(p, adds, 4), with_local_adds(p, adds, 0)
        for c in partitions(p.num_waves, 3):
            done, end = 0, 0.0
            for g, waves in enumerate(c):
                nbytes = sum(p.wave_bytes[done : done + waves])
                done += waves
                model = p.tail if g == len(c) - 1 else p.during
                end = max(end, done * p.wave_ms) + model.time_ms(nbytes) + adds.time_ms(nbytes)
            assert makespan(spared, c) == pytest.approx(end)
            assert makespan(starved, c) == pytest.approx(makespan(p, c) + adds.time_ms(sum(p.wave_bytes)))
        assert best_partition(spared)[1] == pytest.approx(min(makespan(spared, c) for c in partitions(p.num_waves)))


def test_a_local_all_reduce_is_modelled_as_an_all_gather():
    from flashoverlap.rules import comm_pattern

    assert comm_pattern("all_reduce", "rows", "local") == "all_gather"
    assert comm_pattern("all_reduce", "tiles") == "all_reduce"
    assert comm_pattern("reduce_scatter", "rows") == "exchange"


def test_kept_rows_cost_their_local_operation_and_a_group_of_only_kept_rows_no_collective():
    during = CommModel(0.05, 1e7)
    local = CommModel(0.0, 4e6)
    # three waves sent, one kept: the kept wave costs 1e6 / 4e6 = 0.25 ms after the GEMM, no latency
    p = Problem((1e6, 1e6, 1e6, 0.0), 1.0, during, during, HostModel(), (0.0, 0.0, 0.0, 1e6), local)
    assert makespan(p, (1, 1, 1, 1)) == pytest.approx(4.0 + 0.25)
    assert makespan(p, (4,)) == pytest.approx(4.0 + 0.05 + 0.3 + 0.25)


def test_host_bound_calls_take_fewer_groups():
    # the paced problem below wants a group per wave; at 0.2 ms of host time per group, fewer pay
    paced = Problem((1.0,) * 5, 0.1, CommModel(0.0, 10.0), CommModel(0.0, 10.0))
    assert len(best_partition(paced)[0]) == 5
    hosted = Problem(paced.wave_bytes, 0.1, paced.during, paced.tail, HostModel(0.0, 0.2))
    partition, t = best_partition(hosted)
    assert len(partition) < 5 and t == pytest.approx(max(makespan(paced, partition), 0.2 * len(partition)))
    # a host slower than the whole GEMM: the call costs the host time whatever the partition
    assert best_partition(Problem(paced.wave_bytes, 0.1, paced.during, paced.tail, HostModel(5.0, 0.0)))[1] == 5.0


def test_host_model_fit():
    model = fit_host([1, 3, 9], [0.1 + 0.03 * g for g in (1, 3, 9)])
    assert model.base_ms == pytest.approx(0.1) and model.per_group_ms == pytest.approx(0.03)
    assert model.time_ms(4) == pytest.approx(0.22)
    with pytest.raises(ValueError, match="two different group counts"):
        fit_host([2, 2], [0.1, 0.1])


def test_known_optima():
    # no latency, each wave's output takes exactly a wave to send: one group per wave keeps the
    # communication one wave behind the GEMM (any merged group ends later)
    paced = Problem((1.0,) * 5, 0.1, CommModel(0.0, 10.0), CommModel(0.0, 10.0))
    assert best_partition(paced) == ((1, 1, 1, 1, 1), pytest.approx(0.6))
    # latency dominates: every extra group costs more than it hides, so one group
    slow = Problem((1.0,) * 5, 0.1, CommModel(10.0, 1e30), CommModel(10.0, 1e30))
    assert best_partition(slow) == ((5,), pytest.approx(10.5))


def test_more_bandwidth_never_predicts_a_slower_call():
    rng = np.random.default_rng(1)
    for _ in range(20):
        base = problem(rng, waves=8)
        previous = np.inf
        for bandwidth in (1e7, 3e7, 1e8, 3e8, 1e9):
            during = CommModel(base.during.latency_ms, bandwidth)
            _, t = best_partition(Problem(base.wave_bytes, base.wave_ms, during, base.tail))
            assert t <= previous + 1e-12
            previous = t


def test_choose_falls_back_to_sequential_where_overlap_cannot_pay():
    # communication a fraction of the GEMM: overlap hides it
    p = Problem((8e6,) * 8, 0.1, CommModel(0.01, 1e8), CommModel(0.01, 2.5e8))
    pays = choose(p, 0.75 + p.tail.time_ms(64e6))
    assert pays.overlap_pays and pays.overlap_ms < pays.sequential_ms
    # the SM budget slows the GEMM more than the communication it could hide
    small = Problem((8e6,) * 8, 0.1, CommModel(0.01, 1e8), CommModel(0.01, 1e10))
    assert not choose(small, 0.5 + small.tail.time_ms(64e6)).overlap_pays


def test_comm_model_fit_recovers_latency_and_bandwidth():
    sizes = [1e6, 4e6, 16e6, 64e6]
    model = fit_comm(sizes, [0.02 + s / 2e8 for s in sizes])
    assert model.latency_ms == pytest.approx(0.02) and model.bytes_per_ms == pytest.approx(2e8)
    assert model.time_ms(8e6) == pytest.approx(0.06)
    assert model.time_ms(np.array([0.5e6, 8e6, 128e6])) == pytest.approx([0.0225, 0.06, 0.66])


def test_comm_model_follows_a_protocol_switch_between_measured_sizes():
    # a slow small-message regime up to 4 MB, then bandwidth-bound: a line misses both ends
    sizes = [1e6, 2e6, 4e6, 8e6, 16e6]
    times = [0.05, 0.06, 0.08, 0.06, 0.10]
    model = fit_comm(sizes + [4e6], times + [0.2])  # repeated size: its median (0.14)
    assert model.time_ms(4e6) == pytest.approx(0.14) and model.time_ms(3e6) == pytest.approx(0.10)
    assert model.time_ms(12e6) == pytest.approx(0.08)
    outside = 64e6  # beyond the measured sizes: the fitted line
    assert model.time_ms(outside) == pytest.approx(model.latency_ms + outside / model.bytes_per_ms)
    with pytest.raises(ValueError, match="at least two different sizes"):
        fit_comm([1e6, 1e6], [0.1, 0.1])
    with pytest.raises(ValueError, match="do not grow with size"):
        fit_comm([1e6, 2e6], [0.2, 0.1])


def test_makespan_rejects_partitions_that_do_not_cover_the_waves():
    p = Problem((1.0,) * 3, 0.1, CommModel(0.0, 1.0), CommModel(0.0, 1.0))
    for bad in ((1, 1), (2, 2), (3, 0)):
        with pytest.raises(ValueError, match="sum to 3 waves"):
            makespan(p, bad)


def test_wave_bytes_cover_the_output_once():
    from flashoverlap.plan import make_plan

    plan = make_plan(1000, 1032, tile_m=128, tile_n=256, cluster_m=1, ctas=7)
    per_wave = wave_bytes(plan, 2)
    assert len(per_wave) == plan.num_waves and sum(per_wave) == 1000 * 1032 * 2
    # raster along N: the first wave is row 0 (four whole tiles and the 8-column edge tile), then
    # two whole tiles of row 1
    assert per_wave[0] == (6 * 128 * 256 + 128 * 8) * 2


def test_wave_bytes_of_rotated_rows_count_what_each_rank_sends():
    """Reduce-scatter / all-to-all in the rows layout: the other ranks' segments go whole to one
    rank (the bytes this rank sends), the own segment, last, stays (counted apart)."""
    from flashoverlap.plan import make_plan

    plan = make_plan(3 * 256, 512, tile_m=128, tile_n=256, cluster_m=1, ctas=2)  # a wave per tile row
    assert wave_bytes(plan, 2, world=3) == (128 * 512 * 2,) * 4 + (0.0,) * 2
    assert wave_bytes(plan, 2, world=3, own=True) == (0.0,) * 4 + (128 * 512 * 2,) * 2
    assert wave_bytes(plan, 2) == (128 * 512 * 2,) * 6
    cols = make_plan(3 * 256, 512, tile_m=128, tile_n=256, cluster_m=1, ctas=2, layout="cols")
    assert wave_bytes(cols, 2, world=3) == (2 * 128 * 256 * 2,) * 6  # a collective over all ranks' rows


def test_partitions_enumerate_every_split_once():
    from math import comb

    for waves in range(1, 9):
        for most in (None, 1, 2, 3):
            found = list(partitions(waves, most))
            groups = waves if most is None else min(most, waves)
            assert len(found) == len(set(found)) == sum(comb(waves - 1, g - 1) for g in range(1, groups + 1))
            assert all(sum(p) == waves and min(p) >= 1 and len(p) <= groups for p in found)


# --- the model fed from constants at any world size (tune_predict) --------------------------------


def test_ring_bytes_per_rank_grow_with_the_world():
    assert [ring_share("all_reduce", w) for w in (2, 4, 8)] == [1.0, 1.5, 1.75]
    assert [ring_share(c, 8) for c in ("reduce_scatter", "all_to_all")] == [0.875, 0.875]
    # pull_scatter moves a ring's bytes (half read in place by the sums, half copied), pull every
    # other rank's whole group; reduce-scatter / all-to-all copy this rank's share of every other
    # rank's group: the ring's bytes too
    for w in (2, 4, 8):
        scatter = pull_counts("all_reduce", "pull_scatter", w)
        assert scatter.copied + scatter.read == pytest.approx(ring_share("all_reduce", w))
        assert scatter.copied == scatter.read and scatter.copies == w - 1 and scatter.added == 0.0
        assert pull_counts("all_reduce", "pull", w)[:3] == (w - 1, w - 1, 0.0)
        rs, a2a = (pull_counts(c, "pull", w) for c in ("reduce_scatter", "all_to_all"))
        assert rs.copied == a2a.copied == pytest.approx(ring_share("reduce_scatter", w))
        assert rs.copies == a2a.copies == w - 1 and rs.read == a2a.read == a2a.added == 0.0
        assert rs.added == pytest.approx((w + 1) / w)  # a reduce-scatter's copies summed locally: w in, 1 out


def test_nccl_is_the_measured_fit_where_measured_and_extrapolated_beyond():
    nbytes = 64 << 20
    for world, (latency, bus) in H200.nccl["all_reduce"].items():
        expected = latency + ring_share("all_reduce", world) * nbytes / bus
        assert nccl_comm(H200, "all_reduce", world).time_ms(nbytes) == pytest.approx(expected)
    # eight ranks: four's bus bandwidth, 1.75 / 1.5 of its bytes, and a hop more per extra ring step
    latency, bus = H200.nccl["all_reduce"][4]
    eight = nccl_comm(H200, "all_reduce", 8)
    assert eight.latency_ms == pytest.approx(latency + 8 * H200.hop_ms)
    assert eight.time_ms(nbytes) == pytest.approx(eight.latency_ms + 1.75 * nbytes / bus)
    assert eight.time_ms(nbytes) > nccl_comm(H200, "all_reduce", 4).time_ms(nbytes)
    # on fewer CTAs, the measured share of the bus bandwidth (16 CTAs: 0.82)
    assert nccl_comm(H200, "all_reduce", 8, 16).bytes_per_ms == pytest.approx(0.82 * eight.bytes_per_ms)
    with pytest.raises(ValueError, match="no measured"):
        nccl_comm(H200, "all_reduce", 1)


def test_pulls_serialize_on_one_copy_engine():
    nbytes = 8 << 20
    for w in (2, 4, 8):
        tail = pull_comm(H200, "all_reduce", "pull", w)
        assert tail.latency_ms == pytest.approx((w - 1) * H200.copy_gap_ms)  # one copy after another
        copies = (w - 1) * nbytes / H200.copy_bytes_per_ms
        adds = (w + 1) * nbytes / H200.add_bytes_per_ms
        assert tail.time_ms(nbytes) == pytest.approx(tail.latency_ms + copies + adds)
        # beside the GEMM the adds on 4 SMs overlap the next copies: the slower sets the pace
        during = pull_comm(H200, "all_reduce", "pull", w, 4)
        slower = max(copies, (w + 1) * nbytes / (4 * H200.add_bytes_per_ms_per_sm))
        assert during.time_ms(nbytes) == pytest.approx(tail.latency_ms + slower)
    # on eight ranks pull_scatter's reads in place and 7 copies of shares beat pull's 7 whole groups
    scatter = pull_comm(H200, "all_reduce", "pull_scatter", 8)
    assert scatter.latency_ms == pytest.approx(tail.latency_ms) and scatter.time_ms(nbytes) < tail.time_ms(nbytes)


def test_sums_read_in_place_at_the_rate_of_their_sms():
    """pull_scatter's sums read the other ranks' memory at the rate measured for that many SMs beside
    the GEMM (interpolated, flat beyond), on every SM after it; beside the GEMM its copies of the sums
    overlap the reads (the slower sets the pace)."""
    nbytes, share = 64 << 20, 3 / 4
    for sms, rate in H200.peer_read:
        reads, copies = share * nbytes / rate, share * nbytes / H200.copy_bytes_per_ms
        scatter = pull_comm(H200, "all_reduce", "pull_scatter", 4, sms)
        assert scatter.time_ms(nbytes) == pytest.approx(3 * H200.copy_gap_ms + max(reads, copies))
    assert H200.read_bytes_per_ms(12) == pytest.approx((H200.read_bytes_per_ms(8) + H200.read_bytes_per_ms(16)) / 2)
    assert H200.read_bytes_per_ms(64) == H200.read_bytes_per_ms(16)  # flat beyond the last measured count
    assert H200.read_bytes_per_ms(0) == H200.peer_read_alone
    reads, copies = share * nbytes / H200.read_bytes_per_ms(8), share * nbytes / H200.copy_bytes_per_ms
    during = pull_comm(H200, "all_reduce", "pull_scatter", 4, 8)
    assert during.time_ms(nbytes) == pytest.approx(3 * H200.copy_gap_ms + max(reads, copies))
    after = pull_comm(H200, "all_reduce", "pull_scatter", 4)
    assert after.time_ms(nbytes) == pytest.approx(3 * H200.copy_gap_ms + share * nbytes / H200.peer_read_alone + copies)


def test_a_pull_with_no_sm_beside_the_gemm_adds_after_it():
    """A reduce-scatter pull with ``comm_sms`` 0: its groups' copies beside the GEMM, every group's
    adds after its end (the GEMM's CTAs hold every SM), as the tuner models it; with SMs left, each
    group's adds beside the GEMM."""
    from flashoverlap.tune_predict import after_gemm_ms, candidate

    shape, nbytes = (8192, 8192, 4096), 8192 * 8192 * 2
    _, none, _ = candidate(H200, shape, "reduce_scatter", 4, {"layout": "segments", "reduction": "pull", "comm_sms": 0})
    copies = pull_comm(H200, "reduce_scatter", "pull", 4, 0, adds=False)
    assert none.during == none.tail == copies and copies.time_ms(1 << 20) < pull_comm(
        H200, "reduce_scatter", "pull", 4
    ).time_ms(1 << 20)
    assert none.finish_ms > 0 and none.finish_ms == pytest.approx(
        after_gemm_ms(H200, "reduce_scatter", "pull", 4, nbytes)
    )
    assert none.finish_ms == pytest.approx((4 + 1) / 4 * nbytes / H200.add_bytes_per_ms)
    _, four, _ = candidate(H200, shape, "reduce_scatter", 4, {"layout": "segments", "reduction": "pull", "comm_sms": 4})
    assert four.finish_ms == 0 and four.during == pull_comm(H200, "reduce_scatter", "pull", 4, 4)


def test_prediction_per_world():
    shape = (4096, 8192, 8192)
    two, eight = (predict(H200, shape, "all_reduce", w) for w in (2, 8))
    assert two.gemm_ms == eight.gemm_ms == pytest.approx(2 * 4096 * 8192 * 8192 / H200.gemm_flops_per_ms)
    assert eight.comm_ms > two.comm_ms and eight.sequential_ms == pytest.approx(eight.gemm_ms + eight.comm_ms)
    paths = {p.name: p for p in eight.paths}
    assert set(paths) == {"nccl", "pull", "pull_scatter"}
    assert paths["pull_scatter"].call_ms < paths["pull"].call_ms  # a ring's bytes against 7 groups
    assert max(eight.gemm_ms, eight.comm_ms) <= eight.call_ms < eight.sequential_ms
    assert eight.efficiency == pytest.approx((eight.sequential_ms - eight.call_ms) / min(eight.gemm_ms, eight.comm_ms))
    hopeless = predict(H200, shape, "all_reduce", 8, margin=0.99)  # nothing beats sequential by 99 %
    assert hopeless.chosen is None and hopeless.speedup == 1.0 and hopeless.efficiency == 0.0
    assert {p.name for p in predict(H200, shape, "reduce_scatter", 8).paths} == {"nccl", "pull", "pull_fused"}
    assert {p.name for p in predict(H200, shape, "all_to_all", 8).paths} == {"nccl", "pull"}  # (no sums to fuse)


def test_predict_cli(capsys):
    assert tune_predict.main(["--world", "8", "--shapes", "4096x8192x8192", "--collective", "all_reduce"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200 x8" in out and "| 4096x8192x8192 | all_reduce |" in out
    assert "all_reduce: mean speedup" in out
    with pytest.raises(SystemExit):
        tune_predict.main(["--world", "1", "--shapes", "4096x8192x8192"])
    with pytest.raises(SystemExit):
        tune_predict.main(["--world", "8"])  # no shapes
