"""When a ``pull`` all-reduce can run (comm.peer.unavailable) and what a call does where it cannot."""

import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from flashoverlap import OverlapConfig, comm, overlap
from flashoverlap.comm import peer


@pytest.fixture
def gloo_group():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "s"), 1), rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_pulls_need_p2p_and_an_nccl_group(gloo_group, monkeypatch):
    device = torch.device("cuda", 0)
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert "NCCL_P2P_DISABLE=1" in peer.unavailable(gloo_group, device)
    monkeypatch.delenv("NCCL_P2P_DISABLE")
    assert "a gloo group" in peer.unavailable(gloo_group, device)


@pytest.mark.parametrize(
    "views, why",
    [
        ([("a", "GPU-0", True), ("a", "GPU-1", True)], None),
        ([("a", "GPU-0", True), ("b", "GPU-1", True)], "several hosts"),
        ([("a", "GPU-0", True), ("a", "GPU-0", True)], "sharing a GPU"),
        ([("a", "GPU-0", True), ("a", "GPU-1", False)], "without peer access"),
    ],
)
def test_every_rank_s_view_decides_alike(monkeypatch, views, why):
    """The ranks' (host, GPU, peer access) views, gathered: one answer for all of them."""

    def gather(out, mine, group):
        assert mine == ("a", "GPU-0", True)  # this rank's own view, as asked of CUDA
        out[:] = views

    monkeypatch.setattr(dist, "get_world_size", lambda group: len(views))
    monkeypatch.setattr(dist, "all_gather_object", gather)
    monkeypatch.setattr(peer.socket, "gethostname", lambda: "a")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: (i, j) == (0, 1))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-0"))
    found = peer._ask_every_rank(None, torch.device("cuda", 0))
    assert found is None if why is None else why in found


def test_a_tuned_pull_falls_back_where_it_cannot_run():
    """A registry entry (or the nearest one) that pulls becomes NCCL's all-reduce with its other
    choices kept; a config given by the caller raises instead (overlap._decide)."""
    cfg = OverlapConfig(reduction="pull", comm_sms=4, partition=(1, 2, 1))
    assert overlap.without_pull(cfg) == OverlapConfig(comm_sms=4, partition=(1, 2, 1))
    assert comm.comm_pattern("all_reduce", "rows", overlap.without_pull(cfg).reduction) == "all_reduce"
