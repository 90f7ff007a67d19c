"""The tuner's cost model and partition search on synthetic problems (CPU)."""

import dataclasses

import numpy as np
import pytest

from flashoverlap.tune import (
    CommModel,
    HostModel,
    Problem,
    best_partition,
    brute_summary,
    choose,
    entry,
    fit_comm,
    fit_host,
    format_summary,
    incumbent,
    makespan,
    partitions,
    pick_finalists,
    read_entries,
    wave_bytes,
    with_local_adds,
    write_registry,
)


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
    from flashoverlap.comm import comm_pattern

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


def test_size_models_name_their_variants_and_fit_what_was_timed(monkeypatch):
    """The measured models' common part, with time_variants stubbed: one variant per size, named by
    the label (what the ranks' agreement check compares), fitted to the times it returns."""
    from flashoverlap import bench, tune

    seen = []

    def timed(variants, rounds, block, warmup):
        seen.append(list(variants))
        return {name: 0.01 + nbytes / 1e8 for name, nbytes in zip(variants, sizes)}

    sizes = [mb << 20 for mb in tune.COMM_SIZES_MB]
    monkeypatch.setattr(bench, "time_variants", timed)
    model = tune._fit_sizes("exchange", lambda mb: (lambda i: None, mb << 20), 3)
    assert seen == [[f"exchange {mb}MB" for mb in tune.COMM_SIZES_MB]]
    assert model.latency_ms == pytest.approx(0.01) and model.bytes_per_ms == pytest.approx(1e8)


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


def test_registry_writing_merges_and_validates(tmp_path):
    from flashoverlap import registry
    from flashoverlap.config import OverlapConfig

    path = tmp_path / "tuned.yaml"
    first = [entry("all_reduce", "nvlink", "bfloat16", (4096, 8192, 8192), {"comm_sms": 8, "partition": [3, 6]}, {})]
    write_registry(str(path), "NVIDIA H200", 2, first)
    again = [
        entry("all_reduce", "nvlink", "bfloat16", (4096, 8192, 8192), {"sequential": True}, {"speedup": 0.97}),
        entry("all_reduce", "nvlink", "bfloat16", (1024, 8192, 8192), {}, {"speedup": 1.05}),
    ]
    write_registry(str(path), "NVIDIA H200", 2, again)
    loaded = registry.load([path])
    assert [(e.shape, e.config.sequential) for e in loaded] == [((1024, 8192, 8192), False), ((4096, 8192, 8192), True)]
    with pytest.raises(ValueError, match="holds configs for 'NVIDIA H200' x2"):
        write_registry(str(path), "NVIDIA H100", 2, again)
    bad = [entry("reduce_scatter", "nvlink", "bfloat16", (8, 8, 8), {"layout": "tiles"}, {})]
    with pytest.raises(ValueError, match="needs layout 'cols'"):
        write_registry(str(path), "NVIDIA H200", 2, bad)
    assert len(registry.load([path])) == 2  # the rejected write left the file as it was
    # an entry timed as CUDA graphs sits beside the eager one of its shape, and is replaced by its own kind
    graphs = entry("all_reduce", "nvlink", "bfloat16", (4096, 8192, 8192), {"symmetric": True}, {}, "graphs")
    write_registry(str(path), "NVIDIA H200", 2, [graphs])
    write_registry(str(path), "NVIDIA H200", 2, [{**graphs, "config": {"comm_sms": 8}}])
    loaded = registry.load([path])
    assert [(e.shape[0], e.timing) for e in loaded] == [(1024, "eager"), (4096, "eager"), (4096, "graphs")]
    assert loaded[1].config.sequential and loaded[2].config == OverlapConfig(comm_sms=8)
    assert "timing" not in again[0]  # eager entries are written as before


def test_a_retune_measures_the_registry_s_entry_and_keeps_it_where_it_wins(tmp_path):
    """tune.incumbent: the entry --output holds for the call (its timing too; none where sequential)
    is measured beside the finalists; written again where it measures fastest, with or without a
    partition of its own; read_entries refuses another GPU's file before anything is measured."""
    from flashoverlap.tune import decide

    path = tmp_path / "tuned.yaml"
    assert read_entries(str(path), "NVIDIA H200", 2) == []
    pull = {"comm_sms": 4, "reduction": "pull", "partition": [1, 2, 1]}
    written = [
        entry("all_reduce", "nvlink", "bfloat16", (4096, 8192, 8192), pull, {"speedup": 1.2}),
        entry("all_reduce", "nvlink", "bfloat16", (4096, 8192, 8192), {"symmetric": True}, {}, "graphs"),
        entry("all_reduce", "nvlink", "bfloat16", (1024, 8192, 8192), {"sequential": True}, {}),
    ]
    write_registry(str(path), "NVIDIA H200", 2, written)
    existing = read_entries(str(path), "NVIDIA H200", 2)
    with pytest.raises(ValueError, match="holds configs for 'NVIDIA H200' x2, not 'NVIDIA H100' x2"):
        read_entries(str(path), "NVIDIA H100", 2)
    assert incumbent(existing, "all_reduce", "nvlink", "bfloat16", (4096, 8192, 8192), "eager") == pull
    assert incumbent(existing, "all_reduce", "nvlink", "bfloat16", (4096, 8192, 8192), "graphs") == {"symmetric": True}
    assert incumbent(existing, "all_reduce", "nvlink", "bfloat16", (1024, 8192, 8192), "eager") is None  # sequential
    assert incumbent(existing, "all_reduce", "pcie", "bfloat16", (4096, 8192, 8192), "eager") is None
    assert incumbent(existing, "reduce_scatter", "nvlink", "bfloat16", (4096, 8192, 8192), "eager") is None

    def row(config, partition, measured_ms, predicted_ms=1.0):
        return {"config": config, "partition": partition, "measured_ms": measured_ms, "seq_ms": 1.2,
                "predicted_ms": predicted_ms, "shape": "4096x8192x8192"}  # fmt: skip

    finalists = [row("{}", [2, 2], 1.05), row('{"comm_sms": 8}', [3, 1], 1.02)]
    registry_s = row('{"comm_sms": 4, "reduction": "pull"}', [1, 2, 1], 1.0, None)
    assert decide([*finalists, registry_s], 0.02)[0] == pull
    assert decide([*finalists, {**registry_s, "config": '{"symmetric": true}', "partition": None}], 0.02)[0] == {
        "symmetric": True
    }
    assert decide([*finalists, {**registry_s, "measured_ms": 1.1}], 0.02)[0] == {"comm_sms": 8, "partition": [3, 1]}
    text = format_summary([*finalists, registry_s])
    assert text.splitlines()[-1].split()[1:3] == ["-", "1.000"]  # no prediction for the registry's entry


def test_an_entry_that_cannot_carry_every_call_gets_the_best_finalist_that_can_as_its_fallback():
    from flashoverlap.tune import measured_entry

    def row(config, measured_ms, partition=(1, 2)):
        return {"config": config, "partition": list(partition), "measured_ms": measured_ms, "seq_ms": 1.0}

    rows = [row('{"layout": "rows"}', 0.85), row("{}", 0.95, (2, 1)), row('{"comm_sms": 24}', 0.9)]
    written = measured_entry("all_to_all", "nvlink", "bfloat16", (8, 8, 8), rows, 0.02)
    assert written["config"] == {"layout": "rows", "partition": [1, 2]}
    assert written["fallback"] == {"comm_sms": 24, "partition": [1, 2]}
    assert written["measured"] == {"speedup": round(1 / 0.85, 3)}
    # the others lose to sequential: so does the fallback
    slow = [row('{"layout": "rows"}', 0.85), row("{}", 1.05)]
    assert measured_entry("reduce_scatter", "pcie", "bfloat16", (8, 8, 8), slow, 0.02)["fallback"] == {
        "sequential": True
    }
    # a symmetric all-to-all (equal splits only) falls back to a finalist without windows; a
    # symmetric reduce-scatter carries every call
    windows = [row('{"symmetric": true}', 0.8), row('{"layout": "rows"}', 0.85), row('{"comm_sms": 24}', 0.9)]
    assert measured_entry("all_to_all", "nvlink", "bfloat16", (8, 8, 8), windows, 0.02)["fallback"] == {
        "comm_sms": 24,
        "partition": [1, 2],
    }
    assert "fallback" not in measured_entry("reduce_scatter", "nvlink", "bfloat16", (8, 8, 8), windows, 0.02)
    # nothing to fall back from
    assert "fallback" not in measured_entry("reduce_scatter", "pcie", "bfloat16", (8, 8, 8), rows[1:], 0.02)
    assert measured_entry("all_to_all", "pcie", "bfloat16", (8, 8, 8), [row("{}", 0.99)], 0.02)["config"] == {
        "sequential": True
    }


def test_summary_and_cli_errors(capsys, monkeypatch):
    from flashoverlap import tune

    rows = [
        {"shape": "8x8x8", "config": "{}", "partition": [1], "predicted_ms": 1.1, "measured_ms": 1.0, "seq_ms": 1.2}
    ]
    text = format_summary(rows)
    assert "+10.0%" in text and "8x8x8" in text
    with pytest.raises(SystemExit):
        tune.main(["--output", "x.yaml"])  # no shapes
    assert "give --shapes" in capsys.readouterr().err
    monkeypatch.delenv("RANK", raising=False)
    assert tune.main(["--shapes", "8x8x8", "--output", "x.yaml", "--graphs"]) == 2
    assert "torchrun" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a candidate the collective cannot take, before anything runs
        tune.main(["--collective", "reduce_scatter", "--shapes", "8x8x8", "--output", "x.yaml",
                   "--candidates", '{"layout": "tiles"}'])  # fmt: skip
    assert 'candidate {"layout": "tiles"}: reduce_scatter needs layout' in capsys.readouterr().err
    with pytest.raises(SystemExit):  # P2P disabled: calls run without windows, nothing left to tune
        tune.main(["--shapes", "8x8x8", "--output", "x.yaml", "--transport", "pcie",
                   "--candidates", '{"symmetric": true}', '{"reduction": "pull"}'])  # fmt: skip
    assert "symmetric windows and pulls need peer access" in capsys.readouterr().err


def test_other_gpus_registry_and_a_world_of_one_are_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    import torch

    from flashoverlap import tune

    path = tmp_path / "tuned.yaml"
    write_registry(str(path), "NVIDIA H200", 2, [entry("all_reduce", "nvlink", "bfloat16", (8, 8, 8), {}, {})])
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (a machine of two GPUs)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: pytest.fail("ran past the registry check"))
    with pytest.raises(SystemExit):
        tune.main(["--shapes", "8x8x8", "--output", str(path)])
    assert "holds configs for 'NVIDIA H200' x2, not 'NVIDIA H100 80GB HBM3' x2" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "1")  # one rank communicates nothing: refused before any GPU work
    with pytest.raises(SystemExit):
        tune.main(["--shapes", "8x8x8", "--output", str(tmp_path / "new.yaml")])
    assert "tuning needs two or more ranks" in capsys.readouterr().err


def test_under_torchrun_without_gpus_the_tuner_says_so(tmp_path, capsys, monkeypatch):
    import torch

    from flashoverlap import tune

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune.main(["--shapes", "8x8x8", "--output", str(tmp_path / "new.yaml")]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().err


def test_the_pull_model_claims_and_releases_each_measurement_as_a_call_does(monkeypatch):
    """Without Peers.claim / copied around each measured pull a rank ran ahead, one of its ready
    signals was lost and the other rank waited forever (the tuner's hangs in stops 30-31); and the
    pulls wait for the other rank's counter, which no GEMM bumps here (Peers.mark)."""
    import torch

    from flashoverlap import comm, tune

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
    call, nbytes = tune._pulls(torch.bfloat16)(1)
    assert nbytes == 1 << 20
    call(0)
    call(1)
    assert steps == ["mark 0", "pull 0", "copied", "claim"] * 2


def test_partitions_enumerate_every_split_once():
    from math import comb

    for waves in range(1, 9):
        for most in (None, 1, 2, 3):
            found = list(partitions(waves, most))
            groups = waves if most is None else min(most, waves)
            assert len(found) == len(set(found)) == sum(comb(waves - 1, g - 1) for g in range(1, groups + 1))
            assert all(sum(p) == waves and min(p) >= 1 and len(p) <= groups for p in found)


def test_brute_force_summary_compares_what_was_written(capsys):
    from flashoverlap import tune

    entries = [
        entry("all_reduce", "nvlink", "bfloat16", (8, 8, 8), {"partition": [1]}, {"speedup": 1.2}),
        entry("all_reduce", "nvlink", "bfloat16", (16, 8, 8), {"sequential": True}, {"speedup": 0.9}),
    ]
    rows = [
        {"shape": "8x8x8", "seq_ms": 1.5, "brute_ms": 1.0, "brute_config": '{"partition": [1]}'},
        {"shape": "16x8x8", "seq_ms": 1.0, "brute_ms": 1.0, "brute_config": '{"sequential": true}'},
    ]
    text = brute_summary(entries, rows)
    assert "80.0%" in text and "100.0%" in text and "mean tuned / brute-force speedup: 90.0%" in text
    with pytest.raises(SystemExit):
        tune.main(["--shapes", "8x8x8", "--output", "x.yaml", "--brute-force", "-1"])
    assert "--brute-force takes" in capsys.readouterr().err
    for top in ("0", "-1"):  # (a negative slice would measure all but the last)
        with pytest.raises(SystemExit):
            tune.main(["--shapes", "8x8x8", "--output", "x.yaml", "--top", top])
        assert "--top takes" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # candidates are configs to measure, not "registry"
        tune.main(["--shapes", "8x8x8", "--output", "x.yaml", "--candidates", "registry"])
    assert "expected a JSON object" in capsys.readouterr().err


def test_default_candidates_are_prebuilt_for_hopper():
    """Every default candidate is a valid config whose H100/H200 kernel bench/kernels.yaml lists,
    so a tuning run times kernels, not compiles."""
    from pathlib import Path

    from flashoverlap import precompile
    from flashoverlap.tune import DEFAULT_CANDIDATES

    items = precompile.load_items(str(Path(__file__).resolve().parent.parent / "bench" / "kernels.yaml"))
    prebuilt = set()
    for item in items:
        call, cfgs = precompile.call_and_configs(item)
        prebuilt |= {precompile.spec_for(call, cfg, (9, 0)) for cfg in cfgs}
    for collective, candidates in DEFAULT_CANDIDATES.items():
        for candidate in candidates:
            call, cfgs = precompile.call_and_configs({**candidate, "collective": collective})
            for cfg in cfgs:
                assert precompile.spec_for(call, cfg, (9, 0)) in prebuilt, (collective, candidate, cfg.layout)


def test_a_model_that_cannot_be_fitted_drops_its_candidates_instead_of_the_run(monkeypatch):
    from flashoverlap import tune

    said = []
    monkeypatch.setattr(tune, "_progress", said.append)

    def flat(pattern, comm_sms):  # a one-rank all-reduce in place: no time grows with size
        return fit_comm([1e6, 2e6], [0.01, 0.009])

    assert tune._fitted(flat, "all_reduce", 4) is None
    assert said and "flat('all_reduce', 4): measured times do not grow with size" in said[0]
    assert tune._fitted(lambda p: fit_comm([1e6, 2e6], [0.01, 0.02]), "x").bytes_per_ms == pytest.approx(1e8)


@pytest.mark.multigpu
def test_a_retune_on_two_gpus_measures_the_registry_s_entry_beside_its_finalists(tmp_path):
    """End to end under torchrun on two GPUs (a tiny shape: the steps run, the numbers mean little):
    the entry --output holds for the shape is measured beside the finalists, and the file keeps one
    valid entry for it. (On one rank the collectives move nothing: the tuner refuses it.)"""
    import subprocess
    import sys

    import torch

    from flashoverlap import registry

    path = tmp_path / "tuned.yaml"
    shape = (1024, 1024, 512)  # 32 tiles: one wave
    held = entry("all_reduce", "nvlink", "bfloat16", shape, {"comm_sms": 8, "partition": [1]}, {"speedup": 1.0})
    write_registry(str(path), torch.cuda.get_device_name(0), 2, [held])
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "flashoverlap.tune",
               "--shapes", "1024x1024x512", "--candidates", "{}", "--rounds", "2", "--output", str(path)]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "the registry's" in run.stdout + run.stderr
    assert [e.shape for e in registry.load([path])] == [shape]
