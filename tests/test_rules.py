"""What a call may take: layouts for a collective and a call, kernels for a device, the configs an
untuned call times beside its own."""

import dataclasses

import pytest
import torch

from flashoverlap import comm
from flashoverlap.config import OverlapConfig
from flashoverlap.rules import (
    FEWEST_COMM_SMS,
    READ_SMS,
    alternative,
    carries,
    check_layout,
    for_call,
    for_collective,
    for_device,
    for_rowwise,
    fused_pull,
    fused_tiles,
    kernel_spec,
    one_wave,
    pulled,
    reads_in_place,
    resolutions,
    rotation_unit,
    takes_every_call,
    wider_reads,
)


@pytest.mark.parametrize(
    ("m", "n", "late"),
    [
        (4096, 8192, True),  # 1024 tiles: 9 waves on the defaults' 116 SMs, 8 on all 132
        (128 * 33, 1024, True),  # 132 tiles: one wave on 132 SMs, 2 on 116
        (128 * 29, 1024, False),  # 116 tiles: one wave either way
        (128 * 60, 1024, True),  # 240 tiles: 3 waves on 116 SMs, 2 on 132
        (128 * 50, 1024, False),  # 200 tiles: 2 waves either way
    ],
)
def test_the_hopper_alternative_is_the_config_with_its_budget_late_where_that_saves_a_wave(m, n, late):

    cfg = OverlapConfig(partition=(1,) * 99)  # a partition belongs to its waves: dropped
    assert alternative(cfg, (m, n, 64), 132, (9, 0)) == (OverlapConfig(late_budget=True) if late else None)
    if not late:
        return
    assert alternative(OverlapConfig(comm_sms=24), (m, n, 64), 132, (9, 0)).comm_sms == 24
    others = ({"late_budget": True}, {"comm_sms": 0}, {"scheduler": "streamk"}, {"cluster_m": 2})
    for other in others:
        assert alternative(OverlapConfig(**other), (m, n, 64), 132, (9, 0)) is None


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0)])
def test_the_ampere_ada_alternative_leaves_nccl_fewer_sms(capability):
    """The Ampere/Ada kernels cannot stop CTAs early: an untuned call times NCCL on fewer SMs instead,
    whatever the shape, where the config leaves it more."""

    cfg = OverlapConfig(kernel="sm80" if capability == (9, 0) else "auto", partition=(1,) * 99)
    fewer = alternative(cfg, (4096, 8192, 64), 132, capability)
    assert fewer == OverlapConfig(kernel=cfg.kernel, comm_sms=FEWEST_COMM_SMS)
    assert alternative(cfg, (128 * 29, 1024, 64), 132, capability) == fewer  # one wave either way
    for sms in (0, FEWEST_COMM_SMS):
        assert alternative(dataclasses.replace(cfg, comm_sms=sms), (4096, 8192, 64), 132, capability) is None


@pytest.mark.parametrize(
    ("m", "spare"),  # 128 x 256 tiles, N 8192: 32 tiles per tile row
    [(4096, 4), (128 * 33, 0), (128 * 45, 1), (128 * 15, 4), (1024, 4)],  # 1024, 1056, 1440, 480, 256 tiles
)
def test_a_pull_candidate_leaves_the_adds_what_the_grid_spares(m, spare):
    """rules.pulled: as many SMs as the GEMM spares at its whole grid's wave count, at most 4."""

    cfg = for_collective(OverlapConfig(symmetric=True, late_budget=True), "all_reduce")
    pull = pulled(cfg, "all_reduce", (m, 8192, 64), 132)
    assert (pull.reduction, pull.comm_sms, pull.symmetric, pull.late_budget) == ("pull", spare, False, False)
    assert pulled(pull, "all_reduce", (m, 8192, 64), 132) is None  # that pull already
    # a pull hint tuned for another shape: its reduction, the spare SMs (None where it has them)
    hint = dataclasses.replace(pull, comm_sms=pull.comm_sms + 8, partition=(1,) * 3)
    assert pulled(hint, "all_reduce", (m, 8192, 64), 132, 4) == pull
    # a hint in another layout (NCCL's rows for a reduce-scatter) pulls in the pulls' layout, where
    # that layout can run the hint's kernel (not stream-K's schedule)
    found = pulled(cfg, "reduce_scatter", (m, 8192, 64), 132)
    assert (found.reduction, found.layout, found.comm_sms) == ("pull", "segments", spare)
    streamk = for_collective(OverlapConfig(scheduler="streamk"), "reduce_scatter")
    assert streamk.layout == "cols" and pulled(streamk, "reduce_scatter", (m, 8192, 64), 132) is None
    # four ranks: each pulls and sums its share (two ranks' pull would copy three groups per rank)
    assert pulled(cfg, "all_reduce", (m, 8192, 64), 132, 4).reduction == "pull_scatter"
    segments = for_collective(OverlapConfig(layout="segments"), "reduce_scatter")
    for collective in ("reduce_scatter", "all_to_all"):  # their own segment's rows, on any world size
        found = pulled(segments, collective, (m, 8192, 64), 132, 4)
        assert (found.reduction, found.layout, found.comm_sms) == ("pull", "segments", spare)


def test_a_reduce_scatter_s_pull_is_also_timed_with_its_sums_in_the_epilogue_on_hopper():
    """rules.fused_pull: the reduce-scatter's copied pull again as pull_fused (rows, no SM), on Hopper
    only; none for other collectives, other GPUs or none; a fused hint's pull is the copied one."""
    cfg = for_collective(OverlapConfig(), "reduce_scatter")
    pull = pulled(cfg, "reduce_scatter", (4096, 8192, 64), 132, 4)
    fused = fused_pull(pull, "reduce_scatter", (9, 0))
    assert (fused.reduction, fused.layout, fused.comm_sms) == ("pull_fused", "rows", 0)
    assert fused_pull(pull, "reduce_scatter", (8, 9)) is None  # (Ada: its kernels cannot add them)
    assert fused_pull(pull, "all_to_all", (9, 0)) is None and fused_pull(None, "reduce_scatter", (9, 0)) is None
    assert pulled(fused, "reduce_scatter", (4096, 8192, 64), 132, 4) == pull


def test_sums_that_read_in_place_are_also_timed_with_more_sms():
    """rules.wider_reads: a pull_scatter's pull (sums reading the other ranks' memory) again with
    READ_SMS SMs; nothing for copies (a pull all-reduce, a reduce-scatter, an all-to-all) or none."""
    shape = (4096, 8192, 64)
    cfg = for_collective(OverlapConfig(), "all_reduce")
    scatter = pulled(cfg, "all_reduce", shape, 132, 4)
    wider = wider_reads(scatter)
    assert (wider.reduction, wider.comm_sms) == ("pull_scatter", READ_SMS) and scatter.comm_sms < READ_SMS
    assert wider_reads(wider) is None  # as many already
    assert wider_reads(pulled(cfg, "all_reduce", shape, 132, 2)) is None  # copies
    segments = for_collective(OverlapConfig(layout="segments"), "reduce_scatter")
    for collective in ("reduce_scatter", "all_to_all"):
        assert wider_reads(pulled(segments, collective, shape, 132, 4)) is None
    assert wider_reads(None) is None
    assert [reads_in_place(r) for r in ("nccl", "local", "pull", "pull_scatter")] == [False, False, False, True]


HOPPER, ADA, AMPERE, BLACKWELL = (9, 0), (8, 9), (8, 0), (12, 0)


def test_auto_layout_epilogue_kernel_and_tile_k_follow_collective_and_device():
    def resolved(collective, capability=HOPPER, **fields):
        cfg, arch = for_device(for_collective(OverlapConfig(**fields), collective), capability)
        return cfg.layout, cfg.epilogue, cfg.kernel, cfg.tile_k, arch

    assert resolved("all_reduce") == ("rows", "tma", "sm90", 64, "sm_90a")
    assert resolved("all_reduce", layout="tiles") == ("tiles", "direct", "sm90", 64, "sm_90a")
    assert resolved("all_reduce", layout="cols") == ("cols", "direct", "sm90", 64, "sm_90a")
    assert resolved("all_reduce", epilogue="direct") == ("rows", "direct", "sm90", 64, "sm_90a")
    assert resolved("reduce_scatter") == ("cols", "direct", "sm90", 64, "sm_90a")
    assert resolved("all_to_all") == ("cols", "direct", "sm90", 64, "sm_90a")
    # Ampere / Ada get the sm80 kernels, which Hopper can be told to use too
    assert resolved("all_reduce", ADA) == ("rows", "direct", "sm80", 32, "sm_89")
    assert resolved("reduce_scatter", AMPERE) == ("cols", "direct", "sm80", 32, "sm_80")
    assert resolved("all_reduce", HOPPER, kernel="sm80") == ("rows", "direct", "sm80", 32, "sm_90")
    # reduce-scatter / all-to-all take row bands too (the fast raster, in-place TMA stores)
    assert resolved("reduce_scatter", layout="rows") == ("rows", "tma", "sm90", 64, "sm_90a")
    # ... and segments: the same rows of every rank's segment per group (TMA stores, rows remapped)
    assert resolved("all_to_all", layout="segments") == ("segments", "tma", "sm90", 64, "sm_90a")
    assert resolved("reduce_scatter", AMPERE, layout="segments") == ("segments", "direct", "sm80", 32, "sm_80")
    with pytest.raises(ValueError, match="reduce_scatter needs layout 'cols', 'rows' or 'segments'.*got .*'tiles'"):
        for_collective(OverlapConfig(layout="tiles"), "reduce_scatter")
    with pytest.raises(ValueError, match="layout 'segments' splits rows into per-rank segments"):
        for_collective(OverlapConfig(layout="segments"), "all_reduce")
    for layout in ("rows", "segments"):
        with pytest.raises(ValueError, match=f"all_to_all in layout '{layout}' rotates or interleaves the persistent"):
            for_collective(OverlapConfig(layout=layout, scheduler="streamk"), "all_to_all")
    assert for_collective(OverlapConfig(scheduler="streamk"), "all_reduce").layout == "rows"  # not rotated
    with pytest.raises(ValueError, match="epilogue 'tma' stores whole rows .* got layout 'cols'"):
        for_collective(OverlapConfig(epilogue="tma"), "all_to_all")
    with pytest.raises(ValueError, match="reduction 'local' is not reduce_scatter's"):
        for_collective(OverlapConfig(reduction="local"), "reduce_scatter")
    with pytest.raises(ValueError, match="reduction 'pull' runs all_to_all in layout 'segments', not 'rows'"):
        for_collective(OverlapConfig(reduction="pull", layout="rows"), "all_to_all")
    with pytest.raises(ValueError, match="runs reduce_scatter in layout 'segments', not 'rows'"):
        for_collective(OverlapConfig(reduction="pull", layout="rows"), "reduce_scatter")
    # sums in the epilogue: a reduce-scatter's, in row bands (own rows last), either Hopper epilogue
    fused = for_collective(OverlapConfig(reduction="pull_fused"), "reduce_scatter")
    assert fused.layout == "rows" and for_device(fused, (9, 0))[0].epilogue == "tma"
    assert [c.layout for c in resolutions(OverlapConfig(reduction="pull_fused"), "reduce_scatter")] == ["rows"]
    with pytest.raises(ValueError, match="reduction 'pull_fused' is not all_to_all's"):
        for_collective(OverlapConfig(reduction="pull_fused"), "all_to_all")
    with pytest.raises(ValueError, match="runs reduce_scatter in layout 'rows', not 'segments'"):
        for_collective(OverlapConfig(reduction="pull_fused", layout="segments"), "reduce_scatter")
    with pytest.raises(ValueError, match="'pull_fused' adds in the Hopper"):
        for_device(for_collective(OverlapConfig(reduction="pull_fused", kernel="sm80"), "reduce_scatter"), ADA)
    assert for_collective(OverlapConfig(reduction="pull", layout="segments"), "all_to_all").layout == "segments"
    assert for_collective(OverlapConfig(reduction="pull"), "all_reduce").layout == "rows"
    assert for_collective(OverlapConfig(reduction="pull", layout="segments"), "reduce_scatter").layout == "segments"
    assert [c.layout for c in resolutions(OverlapConfig(reduction="pull"), "reduce_scatter")] == ["segments"]
    with pytest.raises(ValueError, match="the sm90 kernels need a Hopper GPU"):
        for_device(OverlapConfig(kernel="sm90", layout="rows"), ADA)
    with pytest.raises(ValueError, match=r"no flashoverlap kernels for sm_120"):
        for_device(OverlapConfig(layout="rows"), BLACKWELL)
    # valid for one family, not the other: rejected where it would run
    with pytest.raises(ValueError, match=r"cannot run on sm_90a: tile_m 64 not in \(128, 256\)"):
        for_device(OverlapConfig(tile_m=64, layout="rows"), HOPPER)
    with pytest.raises(ValueError, match=r"cannot run on sm_86: scheduler 'streamk' not in"):
        for_device(OverlapConfig(scheduler="streamk", layout="rows"), (8, 6))
    # a late budget is the Hopper kernels': on an Ampere GPU no family takes it
    assert for_device(OverlapConfig(late_budget=True, layout="rows"), HOPPER)[0].kernel == "sm90"
    with pytest.raises(ValueError, match="late_budget is for the Hopper"):
        for_device(OverlapConfig(late_budget=True, layout="rows"), (8, 0))


def test_an_auto_layout_takes_segments_where_they_carry_the_call():
    """Your config, a registry entry and the defaults alike: ``config={}`` runs what a call without
    config starts from."""

    auto, shape = OverlapConfig(), (4096, 4096, 1024)
    even = comm.exchange("reduce_scatter", 4096, 2)
    assert for_call(auto, even, shape).layout == "segments"
    assert for_call(OverlapConfig(comm_sms=24, kernel="sm80"), even, shape) == OverlapConfig(
        comm_sms=24, kernel="sm80", layout="segments"
    )
    assert for_call(auto, comm.exchange("all_to_all", 4096, 4), shape).layout == "segments"
    assert for_call(auto, comm.exchange("reduce_scatter", 4000, 2), (4000, 4096, 1024)).layout == "cols"
    uneven = comm.exchange("all_to_all", 4096, 2, splits=[1024, 3072], output_splits=[1024, 1024])
    assert for_call(auto, uneven, shape).layout == "cols"
    assert for_call(auto, comm.exchange("all_reduce", 4096, 2), shape).layout == "rows"
    # even here, but other ranks' splits unknown: what all ranks choose alike cannot rest on it
    given = comm.exchange("all_to_all", 4096, 2, splits=[2048, 2048], output_splits=[2048, 2048])
    assert for_call(auto, given, shape).layout == "cols"
    assert for_call(OverlapConfig(scheduler="streamk"), even, shape).layout == "cols"  # no interleaved schedule
    for layout in ("cols", "rows", "segments"):  # a layout given is kept
        assert for_call(OverlapConfig(layout=layout), even, shape).layout == layout
    # the TMA epilogue stores rows: an auto layout with it runs segments alone, and a call that
    # segments cannot carry is refused before any launch (comm.check_layout) instead of as a config
    tma = OverlapConfig(epilogue="tma")
    assert for_call(tma, even, shape) == OverlapConfig(epilogue="tma", layout="segments")
    assert for_call(tma, uneven, shape).layout == "segments"
    with pytest.raises(ValueError, match="layout 'segments' runs"):
        check_layout(uneven, "segments", rotation_unit(tma, shape))


def test_an_auto_layout_that_no_layout_can_run_names_both():

    with pytest.raises(
        ValueError, match="neither takes it: as 'segments': .*persistent.*; as 'cols': .*epilogue 'tma'"
    ):
        resolutions(OverlapConfig(epilogue="tma", scheduler="streamk"), "all_to_all")
    # what a registry entry's config must be to stand in for every call
    assert takes_every_call(OverlapConfig(), "all_to_all")  # cols where segments cannot carry
    assert not takes_every_call(OverlapConfig(epilogue="tma"), "all_to_all")  # segments or nothing


def test_one_wave_counts_tiles_against_the_sms_left(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    cfg = OverlapConfig()  # 128x256 tiles, 16 SMs for NCCL: 116 tiles a wave
    assert one_wave(cfg, 128, 256 * 116, None) and one_wave(cfg, 1, 1, None)
    assert not one_wave(cfg, 129, 256 * 116, None) and not one_wave(cfg, 128, 256 * 116 + 1, None)
    assert one_wave(OverlapConfig(comm_sms=0), 128, 256 * 132, None)


def test_rows_layout_takes_equal_segments_of_whole_rotation_steps_only():
    check_layout(comm.exchange("all_to_all", 12, 3), "rows", 4)
    check_layout(comm.exchange("reduce_scatter", 12, 3), "rows", 2)
    check_layout(comm.exchange("all_reduce", 12, 5), "rows", 128)  # not rotated
    uneven = comm.exchange("all_to_all", 10, 2, splits=[3, 7], output_splits=[3, 4])
    check_layout(uneven, "cols", 1)
    with pytest.raises(ValueError, match=r"multiple of 1 rows .* got \[3, 7\] rows sent and \[3, 4\] received"):
        check_layout(uneven, "rows", 1)
    unequal_in = comm.exchange("all_to_all", 10, 2, output_splits=[5, 6])
    with pytest.raises(ValueError, match=r"\[5, 5\] rows sent and \[5, 6\] received"):
        check_layout(unequal_in, "rows", 1)
    # the segments layout needs the same: equal segments of whole units
    check_layout(comm.exchange("reduce_scatter", 12, 3), "segments", 4)
    with pytest.raises(ValueError, match=r"layout 'segments' runs all_to_all .* multiple of 1 rows"):
        check_layout(uneven, "segments", 1)
    with pytest.raises(ValueError, match=r"layout 'segments' runs reduce_scatter .* multiple of 8 rows"):
        check_layout(comm.exchange("reduce_scatter", 12, 3), "segments", 8)
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        check_layout(comm.exchange("reduce_scatter", 24, 2), "rows", 8)  # segments of 12 rows


def test_rowwise_fp8_scales_take_the_direct_epilogue_of_the_sm90_kernels():
    """rules.for_rowwise: a row broadcast needs each stored row's own row of C (the direct epilogue
    stores tiles by hand; the TMA one where the slots say) and Hopper's kernels (Ada's take an alpha)."""
    assert for_rowwise(OverlapConfig(), HOPPER).epilogue == "direct"
    assert for_rowwise(OverlapConfig(epilogue="direct", tile_n=128), HOPPER).tile_n == 128
    with pytest.raises(ValueError, match="need epilogue 'direct'"):
        for_rowwise(OverlapConfig(epilogue="tma"), HOPPER)
    for cfg, capability in [(OverlapConfig(), ADA), (OverlapConfig(kernel="sm80"), HOPPER)]:
        with pytest.raises(ValueError, match="need the sm90 kernels"):
            for_rowwise(cfg, capability)


def test_fused_sums_run_whole_tiles_with_per_tensor_scales_in_kernels_of_their_own():
    """pull_fused: its kernel is its epilogue's sums variant; its epilogue adds into whole tiles (N a
    multiple of tile_n: a call that is not is not carried, and refused where named) and scales by
    one alpha (rowwise FP8 scales refused before any launch)."""
    fused = for_collective(OverlapConfig(reduction="pull_fused", comm_sms=0), "reduce_scatter")
    _, spec = kernel_spec(fused, "bfloat16", "nk", (9, 0))
    assert spec.sums and spec.name.endswith("_tma_sums_sm_90a")
    direct = kernel_spec(dataclasses.replace(fused, epilogue="direct"), "bfloat16", "nk", (9, 0))[1]
    assert direct.name.endswith("_direct_sums_sm_90a")
    assert not kernel_spec(for_collective(OverlapConfig(), "reduce_scatter"), "bfloat16", "nk", (9, 0))[1].sums
    ex = comm.exchange("reduce_scatter", 8192, 4, reduction="pull_fused")
    assert carries(fused, ex, (8192, 8192, 4096)) and not carries(fused, ex, (8192, 8192 + 64, 4096))
    fused_tiles(fused, 8192)
    with pytest.raises(ValueError, match="N=8256 must be a multiple of tile_n=256"):
        fused_tiles(fused, 8256)
    with pytest.raises(ValueError, match="'pull_fused' takes per-tensor FP8 scales"):
        for_rowwise(fused, (9, 0))
