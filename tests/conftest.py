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
def fresh_decisions(monkeypatch):
    """Each test decides its calls afresh: tests replace what a kept decision rests on (the
    registry, the trial, the plans) without what a process would change to make it stale."""
    from collections import OrderedDict

    from flashoverlap import overlap

    monkeypatch.setattr(overlap, "_decided", OrderedDict())
