"""comm.nccl on the CPU: the C-API calls Direct makes (a recording stand-in for libnccl), and when
an overlapped call uses them."""

import pytest
import torch
import torch.distributed as dist

from flashoverlap import comm, state
from flashoverlap.comm import nccl


class FakeNccl:
    """Records calls as (name, args); returns ``fail[name]`` (an ncclResult_t) where given, else 0."""

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail or {}

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            return self.fail.get(name, 0)

        return call

    def ncclGetErrorString(self, status):
        return b"unhandled cuda error"


@pytest.fixture
def direct(monkeypatch):
    def make(fail=None):
        lib = FakeNccl(fail)
        monkeypatch.setattr(nccl, "library", lambda: lib)
        monkeypatch.setattr(nccl, "communicator", lambda group, device: "comm")
        monkeypatch.setattr(nccl, "raw_stream", lambda device: "stream")
        return nccl.Direct("group", torch.device("cpu")), lib

    return make


def elements(ptr: int, base: torch.Tensor) -> int:
    """Elements of ``base`` before data pointer ``ptr``."""
    return (ptr - base.data_ptr()) // base.element_size()


def test_collectives_pass_buffers_counts_and_types(direct):
    data = torch.zeros(6, 4, dtype=torch.bfloat16)
    out = torch.zeros(3, 4, dtype=torch.bfloat16)
    d, lib = direct()
    d.all_reduce(data)
    d.reduce_scatter(out, data)
    d.all_gather(data, out)
    assert lib.calls[2] == ("ncclAllGather", (out.data_ptr(), data.data_ptr(), 12, 9, "comm", "stream"))
    assert lib.calls[:2] == [
        (
            "ncclAllReduce",
            (data.data_ptr(), data.data_ptr(), 24, nccl.DATATYPES[torch.bfloat16], nccl.SUM, "comm", "stream"),
        ),
        (
            "ncclReduceScatter",
            (data.data_ptr(), out.data_ptr(), 12, nccl.DATATYPES[torch.bfloat16], nccl.SUM, "comm", "stream"),
        ),
    ]


def test_all_to_all_equal_splits_is_ncclAlltoAll(direct):
    data, out = torch.zeros(6, 4, dtype=torch.float16), torch.zeros(6, 4, dtype=torch.float16)
    d, lib = direct()
    d.all_to_all(out, data, (2, 2, 2), (2, 2, 2))
    assert lib.calls == [
        ("ncclAlltoAll", (data.data_ptr(), out.data_ptr(), 8, nccl.DATATYPES[torch.float16], "comm", "stream"))
    ]


def test_all_to_all_uneven_splits_send_and_receive_each_block_in_one_group(direct):
    data = torch.zeros(8, 4, dtype=torch.bfloat16)  # rows: 3 to rank 0, 0 to rank 1, 5 to rank 2
    out = torch.zeros(6, 4, dtype=torch.bfloat16)  # rows: 2 from rank 0, 4 from rank 1, 0 from rank 2
    d, lib = direct()
    d.all_to_all(out, data, (2, 4, 0), (3, 0, 5))
    names = [name for name, _ in lib.calls]
    assert names == ["ncclGroupStart", "ncclSend", "ncclSend", "ncclRecv", "ncclRecv", "ncclGroupEnd"]
    sends = [(elements(args[0], data), args[1], args[3]) for name, args in lib.calls if name == "ncclSend"]
    recvs = [(elements(args[0], out), args[1], args[3]) for name, args in lib.calls if name == "ncclRecv"]
    assert sends == [(0, 12, 0), (12, 20, 2)]  # (first element, count, peer); the empty block is skipped
    assert recvs == [(0, 8, 0), (8, 16, 1)]


def test_a_failed_call_raises_with_nccl_s_reason_and_closes_the_group(direct):
    data = torch.zeros(4, 2, dtype=torch.bfloat16)
    d, lib = direct(fail={"ncclSend": 1})
    with pytest.raises(RuntimeError, match=r"ncclSend failed: unhandled cuda error \(NCCL error 1\)"):
        d.send_recv([(data[:2].view(-1), 1)], [(data[2:].view(-1), 1)])
    assert lib.calls[-1][0] == "ncclGroupEnd"


def private_communicator(monkeypatch) -> object:
    """A communicator flashoverlap made over a group's ranks (comm.budget_group), kept in its state."""
    private = object()
    monkeypatch.setattr(state, "_owners", {private: state.GroupState("world")})
    return private


def test_direct_only_wraps_flashoverlap_s_own_communicators(monkeypatch):
    user, private = object(), private_communicator(monkeypatch)
    monkeypatch.setattr(comm, "Direct", lambda group, device: ("direct", group))
    monkeypatch.setattr(comm, "unavailable", lambda: None)
    monkeypatch.setenv("FLASHOVERLAP_NCCL", "c10d")
    assert comm.direct(private, torch.device("cpu")) is private
    monkeypatch.delenv("FLASHOVERLAP_NCCL")  # the C API unless told otherwise
    assert comm.direct(user, torch.device("cpu")) is user  # a group c10d also runs collectives on
    assert comm.direct(private, torch.device("cpu")) == ("direct", private)


def test_nccl_path_falls_back_to_c10d_by_default_and_refuses_what_it_cannot_do(monkeypatch):
    private = private_communicator(monkeypatch)
    monkeypatch.setattr(comm, "Direct", lambda group, device: ("direct", group))
    monkeypatch.setattr(comm, "unavailable", lambda: "no libnccl.so")
    monkeypatch.delenv("FLASHOVERLAP_NCCL", raising=False)
    with pytest.warns(RuntimeWarning, match="through c10d, not its C API: no libnccl.so"):
        assert comm.direct(private, torch.device("cpu")) is private
    monkeypatch.setenv("FLASHOVERLAP_NCCL", "direct")  # asked for: an error, not a silent fallback
    with pytest.raises(RuntimeError, match="FLASHOVERLAP_NCCL=direct: no libnccl.so"):
        comm.direct(private, torch.device("cpu"))
    monkeypatch.setenv("FLASHOVERLAP_NCCL", "cupy")
    with pytest.raises(ValueError, match=r"FLASHOVERLAP_NCCL='cupy': expected one of \['direct', 'c10d'\]"):
        comm.direct(private, torch.device("cpu"))


def test_unavailable_names_what_is_missing(monkeypatch):
    nccl.unavailable.cache_clear()
    monkeypatch.setattr(nccl.dist, "ProcessGroupNCCL", None, raising=False)
    assert "ProcessGroupNCCL._comm_ptr" in nccl.unavailable()
    nccl.unavailable.cache_clear()
    monkeypatch.setattr(nccl.dist, "ProcessGroupNCCL", type("PG", (), {"_comm_ptr": None}))
    monkeypatch.setattr(nccl, "library", lambda: (_ for _ in ()).throw(RuntimeError("needs NCCL >= 2.27")))
    assert nccl.unavailable() == "needs NCCL >= 2.27"
    nccl.unavailable.cache_clear()
    monkeypatch.setattr(nccl, "library", lambda: None)
    assert nccl.unavailable() is None
    nccl.unavailable.cache_clear()


def test_window_carves_the_same_bytes_every_call_and_grows_without_freeing(monkeypatch):
    lib, regions = FakeNccl(), []

    def mem_alloc(ptr, size):  # a CPU stand-in for ncclMemAlloc
        regions.append(torch.zeros(size.value, dtype=torch.uint8))
        ptr._obj.value = regions[-1].data_ptr()
        return 0

    lib.ncclMemAlloc = mem_alloc
    monkeypatch.setattr(nccl, "library", lambda: lib)
    monkeypatch.setattr(nccl, "communicator", lambda group, device: group)
    monkeypatch.setattr(nccl, "cuda_backend", lambda group: "nccl")
    monkeypatch.setattr(nccl, "device_bytes", lambda ptr, n, device: next(r for r in regions if r.data_ptr() == ptr))
    window = nccl.Window(["budget", "tail", "budget"], torch.device("cpu"))
    shapes = [(3, 5), (1000,)]
    need = sum(nccl.carved_bytes(s, torch.bfloat16) for s in shapes)
    assert need == 2 * nccl.WIN_ALIGNMENT  # each tensor starts 4096-aligned
    first, again = ([alloc(s) for s in shapes] for alloc in (window.allocator(need, torch.bfloat16) for _ in "12"))
    assert [t.shape for t in first] == [(3, 5), (1000,)] and first[1].dtype == torch.bfloat16
    assert [t.data_ptr() for t in first] == [t.data_ptr() for t in again]  # the same bytes every call
    assert first[1].data_ptr() - first[0].data_ptr() == nccl.WIN_ALIGNMENT
    registered = [(args[0], args[2].value) for name, args in lib.calls if name == "ncclCommWindowRegister"]
    assert registered == [("budget", need), ("tail", need)]  # each communicator once
    bigger = window.allocator(need + 1, torch.bfloat16)  # grows to at least twice the size
    assert len(regions) == 2 and regions[1].numel() == 2 * need and window.regions[0] is regions[0]  # kept
    bigger((need // 2,))  # need bytes of bfloat16
    with pytest.raises(RuntimeError, match="12288 bytes carved, 8193 announced"):
        bigger((1,))  # more than announced


def test_the_backend_that_counts_is_the_one_of_cuda_tensors(tmp_path):
    """``dist.get_backend`` says "undefined" after ``init_process_group()`` without a backend and
    "cpu:gloo,cuda:nccl" for a map (torch 2.11), both NCCL for CUDA tensors: what decides the
    capped communicators, windows and point-to-point layouts is the backend of CUDA tensors."""
    from types import SimpleNamespace

    class Mapped:  # as torch's default group on GPUs: gloo for CPU tensors, NCCL for CUDA ones
        def _get_backend(self, device):
            return SimpleNamespace(name=lambda: "nccl" if device.type == "cuda" else "gloo")

    class CpuOnly:
        def _get_backend(self, device):
            raise RuntimeError(f"No backend type associated with device type {device.type}")

    assert nccl.cuda_backend(Mapped()) == "nccl" and nccl.cuda_backend(CpuOnly()) == "none"
    dist.init_process_group("cpu:gloo,cuda:gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0, world_size=1)
    try:
        assert dist.get_backend() == "cpu:gloo,cuda:gloo" and nccl.cuda_backend(None) == "gloo"
    finally:
        dist.destroy_process_group()


def test_a_group_fact_is_computed_once_per_group_and_dies_with_it():
    """c10d answers a group's size or backend in 10-100 us on NCCL groups, every call: asked once."""
    import gc

    class Group:
        pass

    asked = []

    def size(pg):
        asked.append(pg)
        return 2 if pg is first else 3

    first, second = Group(), Group()
    assert [nccl.group_fact(first, "size", size) for _ in range(3)] == [2, 2, 2]
    assert nccl.group_fact(second, "size", size) == 3 and asked == [first, second]
    assert nccl.group_fact(first, "other", lambda pg: "x") == "x"  # facts are kept apart by name
    known = len(nccl._facts)
    del second, asked[1]
    gc.collect()
    assert len(nccl._facts) == known - 1  # a destroyed group's facts go with it (no stale answer for a new one)
