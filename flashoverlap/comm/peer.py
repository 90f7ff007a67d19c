"""A ``pull`` all-reduce (config ``reduction: pull``): partial sums copied between the GPUs'
memories on the copy engines, no NCCL.

Beside a GEMM on every SM, NCCL's kernels take SMs from it (the budget), and NCCL's copy-engine
all-gather hardly moves: 64 MB in 8 chunks beside a 4096x8192x8192 GEMM took 1.15-1.18 ms for both
against 0.79 for the GEMM alone on two H100s, while plain copies out of the other GPU's memory ran
beside it at no cost to it (0.80 ms for both, 0.21 alone; bench/symmetric_probe.py, stop 29). So
the GEMM writes its groups into memory every rank maps (torch symmetric memory: CUDA IPC over
NVLink or PCIe P2P), each rank copies the other ranks' partial sums of a group into its own
memory once they say the group is there, and adds them to its own (comm.finish_group) on the SMs
the GEMM leaves (``comm_sms``) or as it retires; a reduce-scatter / all-to-all copies its own
segment's rows only (comm._pull_segment). Ordered by flags in that memory, written and waited on
by stream memory operations (no SM, no host):

- ``ready[g][r]`` in rank q's memory: rank r's group g is written (r's counter reached its
  target); q waits for it, clears it and copies;
- ``done[r]``: rank r has copied all of a call's groups out of this rank's buffer; this rank's
  next GEMM, which overwrites them, waits for it and clears it (set at first: nothing to copy).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .. import enqueue
from .nccl import Window, carved_bytes, cuda_backend, group_fact

MAX_GROUPS = 256  # ready flags per rank: the most groups a call may have


class Pulls:
    """What comm's pulls need of a group of ranks: ``rank``, ``world``, ``others`` (every rank but
    this one) and :meth:`arrivals`; :class:`Peers` on GPUs, :class:`Gathered` on gloo."""

    rank: int
    world: int
    others: list[int]
    memory: torch.Tensor  # this rank's memory the chunks are views of

    def arrivals(self, g: int, chunk: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        raise NotImplementedError

    def _at(self, theirs: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        """Another rank's memory ``theirs`` (uint8) at the place ``chunk`` has in this rank's."""
        start = chunk.data_ptr() - self.memory.data_ptr()
        return theirs[start : start + chunk.numel() * chunk.element_size()].view(chunk.dtype)


class Gathered(Pulls):
    """:class:`Peers`' steps on a gloo group (the CPU reference executor): each :meth:`arrivals`
    all-gathers every rank's ``memory`` (a flat tensor the chunks are views of) and yields the
    other ranks' bytes at ``chunk``'s place in it, as a pull copies them. Every rank asks for the
    same groups in the same order, so the gathers pair up, and a gather orders like the flags."""

    def __init__(self, group: dist.ProcessGroup, memory: torch.Tensor) -> None:
        self.group, self.memory = group, memory
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.others = [r for r in range(self.world) if r != self.rank]

    def arrivals(self, g: int, chunk: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        mine = self.memory.view(torch.uint8)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        for r in self.others:
            yield r, self._at(every[r], chunk)


class Peers(Window, Pulls):
    """The memory of every rank of ``group`` (a :class:`comm.nccl.Window` whose regions every rank
    maps): at its start the flags (int32: ``ready`` [MAX_GROUPS, world], then ``done`` [world]),
    then the GEMM's buffer, the same bytes for every call (calls of one rank are stream-ordered,
    the ranks' by the flags). Grows as a window does (collectively, with a host sync)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__([], device)
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.others = [r for r in range(self.world) if r != self.rank]
        self.flag_bytes = carved_bytes(((MAX_GROUPS + 1) * self.world,), torch.int32)
        self.peers: list[torch.Tensor] = []  # every rank's current region (uint8), as mapped here
        self._handles: list = []  # (each region stays mapped while its handle lives)

    def _grow(self, nbytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        memory = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(memory, self.group.group_name)
        self.peers = [handle.get_buffer(r, (nbytes,), torch.uint8) for r in range(self.world)]
        self.memory = memory
        self.regions.append(memory)
        self._handles.append(handle)
        # nothing ready, nothing to wait for, on every rank before any rank signals into this region
        flags = memory[: self.flag_bytes].view(torch.int32)
        flags.zero_()
        flags[MAX_GROUPS * self.world : (MAX_GROUPS + 1) * self.world] = 1
        torch.cuda.synchronize(self.device)
        nccl = cuda_backend(self.group) == "nccl"
        dist.barrier(group=self.group, device_ids=[self.device.index] if nccl else None)

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The GEMM's flat buffer of ``numel`` elements, after the flags (grows the region first)."""
        return self.allocator(carved_bytes((numel,), dtype), dtype, start=self.flag_bytes)((numel,))

    def _flag(self, rank: int, index: int) -> int:
        """The address of flag ``index`` in rank ``rank``'s memory, as mapped here."""
        return self.peers[rank].data_ptr() + 4 * index

    def _signal(self, rank: int, index: int, value: int) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        enqueue.runtime_call("fo_write_value", self._flag(rank, index), value, stream)

    def _take(self, index: int) -> None:
        """Wait (the current stream) until this rank's flag ``index`` is set, then clear it."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        enqueue.runtime_call("fo_stream_wait", self._flag(self.rank, index), 1, stream)
        enqueue.runtime_call("fo_write_value", self._flag(self.rank, index), 0, stream)

    def claim(self) -> None:
        """Before a call's GEMM (on the stream it waits for): wait until every other rank has copied
        the previous call's groups out of this rank's buffer."""
        for r in self.others:
            self._take(MAX_GROUPS * self.world + r)

    def arrivals(self, g: int, chunk: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """Group ``g`` of this rank's buffer (``chunk``, its counter waited for) is there: tell every
        other rank; then (rank, its ``chunk``) for each other rank, as soon as it said the same (the
        caller copies it)."""
        for r in self.others:
            self._signal(r, g * self.world + self.rank, 1)
        for r in self.others:
            self._take(g * self.world + r)
            yield r, self._at(self.peers[r], chunk)

    def copied(self) -> None:
        """Every group of the call is copied here: tell the ranks they came from."""
        for r in self.others:
            self._signal(r, MAX_GROUPS * self.world + self.rank, 1)


def unavailable(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Why the ranks of ``group`` cannot pull from each other's memory, or None where they can:
    an NCCL group (gloo's ranks may share a GPU) of ranks on one host, each on a GPU of its own
    with peer access to every GPU it sees (checked on every rank), and P2P not disabled (the
    consumer-GPU emulation forces NCCL through host memory: pulling over NVLink would bypass it).
    The same answer on every rank: the first ask per group gathers every rank's view (a host sync)."""
    if os.environ.get("NCCL_P2P_DISABLE") == "1":
        return "NCCL_P2P_DISABLE=1 rules out copies between the GPUs' memories"
    if cuda_backend(group) != "nccl":
        return f"a {cuda_backend(group)} group (its ranks may share a GPU): pulls need an NCCL group"
    return group_fact(group, f"pull unavailable on {device.index}", lambda pg: _ask_every_rank(pg, device))


def _ask_every_rank(group: dist.ProcessGroup, device: torch.device) -> str | None:
    others = [j for j in range(torch.cuda.device_count()) if j != device.index]
    peer_access = bool(others) and all(torch.cuda.can_device_access_peer(device.index, j) for j in others)
    mine = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid), peer_access)
    views: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(views, mine, group=group)
    if len({host for host, _, _ in views}) > 1:
        return "ranks on several hosts: pulls need every rank's GPU on one host"
    if len({uuid for _, uuid, _ in views}) < len(views):
        return "ranks sharing a GPU: pulls need a GPU per rank"
    if not all(access for _, _, access in views):
        return "a rank without peer access to every GPU it sees (or seeing only its own): no pulls"
    return None


_peers: dict[tuple, Peers] = {}


def peers(group: dist.ProcessGroup, device: torch.device) -> Peers:
    """The :class:`Peers` of ``group`` on ``device``, made once (its memory on the first call that needs it)."""
    key = (group, device.index)
    if key not in _peers:
        _peers[key] = Peers(group, device)
    return _peers[key]
