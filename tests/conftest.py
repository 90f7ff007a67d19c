import os

import pytest

# The GPU machines keep NVLink multicast off; tests that start processes inherit these.
for _var, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_var, _value)


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    count = _cuda_count()
    for item in items:
        if "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))


@pytest.fixture(autouse=True)
def fresh_decisions():
    """Each test decides its calls afresh: tests replace what a kept decision rests on (the
    registry, the trial, the plans) without what a process would change to make it stale."""
    from flashoverlap import state

    state.forget_decisions()


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A gloo group of this process alone, for the module's tests."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def fresh_state(monkeypatch):
    """No group state kept from other tests (decisions, trials, agreements, logged lines), and
    none left behind."""
    from flashoverlap import state

    monkeypatch.setattr(state, "_states", {})
    monkeypatch.setattr(state, "_owners", {})


@pytest.fixture
def one_host(monkeypatch):
    """Every rank of a group on one host, on a GPU of its own of one model (comm.peer.this_rank: what
    the ranks gather once per group), for tests whose CPU tensors stand in for CUDA ones."""
    from flashoverlap.comm import peer

    rank = peer.Rank("host", "GPU-0", True, "NVIDIA H100 80GB HBM3", 132)
    monkeypatch.setattr(peer, "this_rank", lambda device: rank)
