"""NCCL's C API on torch's own communicators (the libnccl torch loaded, ``_comm_ptr()``).

Two things c10d does not offer: buffers in symmetric windows (:class:`Window`), and per-group
collectives enqueued straight on the communication stream (:class:`Direct`), without c10d's
per-call work objects, stream hand-offs and events (tens of microseconds of host time per
collective, which decide calls whose GEMM is short).
"""

from __future__ import annotations

import ctypes
import functools
import math
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .. import enqueue

CTA_POLICY_ZERO = 2  # ncclConfig_t.CTAPolicy: NCCL_CTA_POLICY_ZERO (nccl.h, 2.27+)
WIN_SYMMETRIC = 1  # ncclCommWindowRegister flags: NCCL_WIN_COLL_SYMMETRIC
WIN_ALIGNMENT = 4096  # NCCL_WIN_REQUIRED_ALIGNMENT
DATATYPES = {torch.float16: 6, torch.float32: 7, torch.bfloat16: 9}  # ncclDataType_t
SUM = 0  # ncclRedOp_t

_P, _N, _I = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
_SIGNATURES = {  # argument types of the calls made per group (ctypes converts plain ints)
    "ncclAllReduce": [_P, _P, _N, _I, _I, _P, _P],
    "ncclReduceScatter": [_P, _P, _N, _I, _I, _P, _P],
    "ncclAllGather": [_P, _P, _N, _I, _P, _P],
    "ncclAlltoAll": [_P, _P, _N, _I, _P, _P],
    "ncclSend": [_P, _N, _I, _I, _P, _P],
    "ncclRecv": [_P, _N, _I, _I, _P, _P],
    "ncclGroupStart": [],
    "ncclGroupEnd": [],
    "ncclCommGetAsyncError": [_P, _P],  # (the watchdog's, not per group)
}


@functools.cache
def library() -> ctypes.CDLL:
    """The NCCL library torch loaded (a second copy could not use torch's communicators)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libnccl.so" in line}
    if len(paths) != 1:
        raise RuntimeError(f"needs torch's NCCL as a shared library (libnccl.so); found {sorted(paths) or 'none'}")
    lib = ctypes.CDLL(paths.pop())
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
    version = ctypes.c_int()
    check(lib, lib.ncclGetVersion(ctypes.byref(version)), "ncclGetVersion")
    if version.value < 22700:
        raise RuntimeError(f"needs NCCL >= 2.27 (symmetric windows, CTA policies); torch loaded {version.value}")
    return lib


@functools.cache
def unavailable() -> str | None:
    """Why NCCL's C API cannot run on torch's communicators in this process (None: it can)."""
    if not hasattr(getattr(dist, "ProcessGroupNCCL", None), "_comm_ptr"):
        return f"torch {torch.__version__} offers no NCCL communicator pointer (ProcessGroupNCCL._comm_ptr)"
    try:
        library()
    except (RuntimeError, OSError) as exc:
        return str(exc)
    return None


def raw_stream(device: int) -> int:
    """The current stream of ``device`` as a cudaStream_t (torch.cuda.current_stream costs
    microseconds more: it builds a Stream object)."""
    return torch._C._cuda_getCurrentRawStream(device)


def check(lib: ctypes.CDLL, status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(_error(lib, what, status))


def _error(lib: ctypes.CDLL, what: str, status: int) -> str:
    return f"{what} failed: {lib.ncclGetErrorString(status).decode()} (NCCL error {status})"


_facts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> {name: value}


def group_fact(group: dist.ProcessGroup | None, name: str, compute: Callable[[dist.ProcessGroup], object]):
    """``compute(group)`` (``None``: the default group), once per group: what never changes about a
    group (its size, this rank in it, its CUDA backend). On the H200 host the first such c10d query
    of an overlapped call took ~100 us under cProfile (bench/host_profile.py; cached, the cost moved
    to the next query), so a call asks none."""
    pg = group if group is not None else dist.group.WORLD
    if torch.compiler.is_compiling():  # traced (torch.compile): c10d's answer folds into the graph, and a
        return compute(pg)  # cache filled while tracing is a side effect dynamo cannot replay (a group)
    facts = _facts.setdefault(pg, {})
    if name not in facts:
        facts[name] = compute(pg)
    return facts[name]


def _backend_name(pg: dist.ProcessGroup) -> str:
    try:
        return pg._get_backend(torch.device("cuda")).name()
    except (RuntimeError, ValueError):  # no backend for CUDA tensors ("cpu:gloo")
        return "none"


def cuda_backend(group: dist.ProcessGroup | None) -> str:
    """The backend that carries ``group``'s CUDA tensors ("nccl", "gloo"), which
    ``dist.get_backend`` names only for a group of one backend: it says "undefined" after
    ``init_process_group()`` without one and "cpu:gloo,cuda:nccl" for a map, both NCCL for CUDA
    tensors (checked on torch 2.11)."""
    return group_fact(group, "cuda_backend", _backend_name)


def communicator(group: dist.ProcessGroup, device: torch.device) -> ctypes.c_void_p:
    """The ncclComm_t of ``group`` on ``device``, created first where c10d has not yet."""
    dist.barrier(group=group, device_ids=[device.index])
    return ctypes.c_void_p(group._get_backend(device)._comm_ptr())


class _DeviceBytes:
    """Device memory seen by torch.as_tensor as a uint8 vector (CUDA array interface)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


def device_bytes(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of device memory at ``ptr`` as a uint8 tensor that does not own it."""
    return torch.as_tensor(_DeviceBytes(ptr, nbytes), device=device)


class Window:
    """NCCL memory (``ncclMemAlloc``: cuMem) registered as a symmetric window
    (``ncclCommWindowRegister``) with the communicator of each NCCL group in ``groups``:
    collectives whose send and receive buffers both lie in such windows run NCCL's
    symmetric-memory kernels, or its copy engines. :meth:`allocator` hands out the same bytes to
    every call (calls are stream-ordered: one's communication ends before the next one's GEMM
    writes). It grows (at least doubling) when a call needs more; registration is collective, so
    every rank must make the same calls in the same order, as the overlapped calls do. Outgrown
    memory is kept, not freed (a CUDA graph may still use it, and freeing is collective too): the
    whole stays under twice the largest call. Grow before capturing a graph (a warm-up call)."""

    def __init__(self, groups: Sequence[dist.ProcessGroup], device: torch.device):
        self.groups = [g for g in dict.fromkeys(groups) if cuda_backend(g) == "nccl"]  # none: no window
        self.device = device
        self.memory: torch.Tensor | None = None  # uint8, the current region
        self.regions: list[torch.Tensor] = []  # every region allocated, outgrown ones included
        self.released: torch.cuda.Event | None = None  # recorded where the last call was done with it

    def acquire(self, stream: torch.cuda.Stream) -> None:
        """Make ``stream`` wait until the previous call is done with the window: calls from other
        streams are not ordered by the communication stream alone (not in graph capture, where
        the captured order holds)."""
        if self.released is not None and not torch.cuda.is_current_stream_capturing():
            enqueue.wait(stream, self.released)

    def release(self, stream: torch.cuda.Stream) -> None:
        """Mark the window free once ``stream``'s work so far (a call's last use of it) is done."""
        if not torch.cuda.is_current_stream_capturing():
            self.released = self.released or torch.cuda.Event()
            enqueue.record(self.released, stream)

    def allocator(self, nbytes: int, dtype: torch.dtype, start: int = 0):
        """``alloc(shape, dtype=dtype)`` carving tensors out of the window, ``nbytes`` in all (sum of
        :func:`carved_bytes`) from byte ``start`` on; grows the window first where it is smaller."""
        if self.memory is None or self.memory.numel() < start + nbytes:
            self._grow(max(start + nbytes, 2 * self.memory.numel() if self.memory is not None else 0))
        memory, offset = self.memory, start

        def alloc(shape, kind: torch.dtype = dtype) -> torch.Tensor:
            nonlocal offset
            size = carved_bytes(shape, kind)
            if offset + size > start + nbytes:
                raise RuntimeError(f"window allocator: {offset + size - start} bytes carved, {nbytes} announced")
            t = memory[offset : offset + size].view(kind)[: math.prod(shape)].view(shape)
            offset += size
            return t

        return alloc

    def _grow(self, nbytes: int) -> None:
        """A new region of ``nbytes``, registered with every communicator, or (raising) none: a
        region that failed to register with one is deregistered from the others and freed, so that
        no call carves a window some communicator does not know. A failed allocation is
        ``torch.OutOfMemoryError`` where the GPU lacks the bytes (NCCL reports any CUDA error alike)."""
        lib = library()
        comms = [communicator(group, self.device) for group in self.groups]
        ptr = ctypes.c_void_p()
        status = lib.ncclMemAlloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        if status != 0:
            free = torch.cuda.mem_get_info(self.device)[0]
            if free < nbytes:
                raise torch.OutOfMemoryError(f"{_error(lib, 'ncclMemAlloc', status)}: {nbytes} bytes, {free} free")
            check(lib, status, "ncclMemAlloc")
        registered = []
        try:
            for c in comms:
                handle = ctypes.c_void_p()
                status = lib.ncclCommWindowRegister(
                    c, ptr, ctypes.c_size_t(nbytes), ctypes.byref(handle), WIN_SYMMETRIC
                )
                check(lib, status, "ncclCommWindowRegister")  # without peer access NCCL registers nothing
                registered.append((c, handle))
            memory = device_bytes(ptr.value, nbytes, self.device)
        except BaseException:
            for c, handle in registered:
                lib.ncclCommWindowDeregister(c, handle)
            lib.ncclMemFree(ptr)
            raise
        self.memory = memory
        self.regions.append(memory)


def carved_bytes(shape, dtype: torch.dtype) -> int:
    """Bytes a tensor of ``shape`` takes in a :class:`Window` (aligned: NCCL_WIN_REQUIRED_ALIGNMENT)."""
    return -(-max(math.prod(shape) * dtype.itemsize, 1) // WIN_ALIGNMENT) * WIN_ALIGNMENT


class Direct:
    """``group``'s NCCL communicator, its collectives enqueued on the current stream through the C
    API. Ranks are ``group``'s own. Tensors are contiguous, of one NCCL data type."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group = group
        self.device = device.index
        self.lib = library()
        self.comm = communicator(group, device)

    def _call(self, name: str, *args) -> None:
        stream = raw_stream(self.device)
        check(self.lib, getattr(self.lib, name)(*args, self.comm, stream), name)
        self._note(name, args, stream)

    def _note(self, name: str, args: tuple, stream: int | None = None) -> None:
        """enqueue.note: the call ``name`` just made with ``args``, then the communicator and ``stream``
        unless None (ncclGroupStart / End take neither)."""
        if not enqueue.noting():
            return
        if stream is not None:
            args = (*args, self.comm.value, stream)
        enqueue.note(
            enqueue.signature(_SIGNATURES[name]),
            enqueue.address(self.lib, name),
            args,
            lambda status: _error(self.lib, name, status),
        )

    def all_reduce(self, data: torch.Tensor) -> None:  # in place
        self._call("ncclAllReduce", data.data_ptr(), data.data_ptr(), data.numel(), DATATYPES[data.dtype], SUM)

    def all_gather(self, out: torch.Tensor, data: torch.Tensor) -> None:
        self._call("ncclAllGather", data.data_ptr(), out.data_ptr(), data.numel(), DATATYPES[data.dtype])

    def reduce_scatter(self, out: torch.Tensor, data: torch.Tensor) -> None:
        self._call("ncclReduceScatter", data.data_ptr(), out.data_ptr(), out.numel(), DATATYPES[out.dtype], SUM)

    def all_to_all(self, out: torch.Tensor, data: torch.Tensor, recv: Sequence[int], send: Sequence[int]) -> None:
        """Rows of [rows, cols] ``data``: ``send[r]`` to rank r; ``recv[r]`` arrive from it."""
        row = data[0].numel() if data.dim() > 1 else 1
        if len(set(send)) == 1 and tuple(recv) == tuple(send):  # NCCL's own (copy engines in a window)
            self._call("ncclAlltoAll", data.data_ptr(), out.data_ptr(), send[0] * row, DATATYPES[data.dtype])
            return
        flat_in, flat_out = data.view(-1), out.view(-1)
        sends, recvs, s0, r0 = [], [], 0, 0
        for peer, (s, r) in enumerate(zip(send, recv)):
            sends.append((flat_in[s0 * row : (s0 + s) * row], peer))
            recvs.append((flat_out[r0 * row : (r0 + r) * row], peer))
            s0, r0 = s0 + s, r0 + r
        self.send_recv(sends, recvs)

    def send_recv(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> None:
        """All of them as one NCCL group (each pair of ranks moving data both ways at once)."""
        check(self.lib, self.lib.ncclGroupStart(), "ncclGroupStart")
        self._note("ncclGroupStart", ())
        try:
            for t, peer in sends:
                if t.numel():
                    self._call("ncclSend", t.data_ptr(), t.numel(), DATATYPES[t.dtype], peer)
            for t, peer in recvs:
                if t.numel():
                    self._call("ncclRecv", t.data_ptr(), t.numel(), DATATYPES[t.dtype], peer)
        finally:
            check(self.lib, self.lib.ncclGroupEnd(), "ncclGroupEnd")
            self._note("ncclGroupEnd", ())
