"""A ``pull`` all-reduce (config ``reduction: pull``): partial sums copied between the GPUs'
memories on the copy engines, no NCCL.

Beside a GEMM on every SM, NCCL's kernels take SMs from it (the budget), and NCCL's copy-engine
all-gather hardly moves: 64 MB in 8 chunks beside a 4096x8192x8192 GEMM took 1.15-1.18 ms for both
against 0.79 for the GEMM alone on two H100s, while plain copies out of the other GPU's memory ran
beside it at no cost to it (0.80 ms for both, 0.21 alone; bench/symmetric_probe.py). So
the GEMM writes its groups into memory every rank maps (torch symmetric memory: CUDA IPC over
NVLink or PCIe P2P), each rank copies the other ranks' partial sums of a group into its own
memory once they say the group is there, and adds them to its own (comm.finish_group) on the SMs
the GEMM leaves (``comm_sms``) or as it retires; a reduce-scatter / all-to-all takes its own
segment's rows only (comm._pull_segment: an all-to-all copies them into place, a reduce-scatter
copies them and sums the copies on the SMs the GEMM leaves, or after it). With ``reduction:
pull_scatter`` each rank adds only its share of each group (a reduce-scatter), reading the other
ranks' partial sums of it straight out of their memory (SM loads over NVLink, :meth:`Pulls.at`:
one kernel reads every link at once, where copies into staging queued one after another on a copy
engine and the sum then read them again; on 4x H200 beside a GEMM, a 16 MiB group's reduce-scatter
ended 0.18 ms after the GEMM's start this way on 16 SMs against 0.28 copied first,
bench/peer_sum_probe.py), and then copies the other ranks' summed shares out of their memory (an
all-gather): 2 (w - 1) / w of a group per rank, where copying every rank's whole group is w - 1
(the same on two ranks, 3 against 1.5 on four), and 1 / w of the adds.
Ordered by stream memory operations (no SM, no host):
each rank writes its own memory and waits on the others' (a wait on another GPU's memory over
NVLink answered in ~5 us on 2x H200, one on the GPU's own memory in ~9), so in
rank r's memory:

- ``counters[g]``: the GEMM's group counters (its kernel bumps them as for any call); every other
  rank waits for group g's target there, then copies (or, ``pull_scatter``, reads) the group;
- ``summed[g]`` (``pull_scatter``): r has added its share of group g in its buffer; every other rank
  waits for it there, then copies that share (zeroed with the counters);
- ``ready[b]`` (``pull_fused``): r has copied every other rank's partial sums of band b of its own
  rows; r's GEMM epilogue waits for it before it adds them (zeroed with the counters);
- ``done[q]``: r has copied (or read) all of a call's groups out of q's memory; q waits for it (and clears
  it) at the end of its call (Peers.claim: beside its last adds), then zeroes its counters for its
  next call, whose GEMM overwrites the groups;
- ``fresh[q]``: r's counters are zeroed for r's next call; q waits for it (and clears it) before it
  waits on them, so that it never takes the previous call's counts for this one's.

At first every region is as a claim leaves it (counters zero, ``fresh`` set, ``done`` clear).

The other ranks wait on this rank's own counters rather than on a ready flag it would write once
its own wait on them ends: such a relay (a wait, a write into the other's memory, a wait and a
clear there) takes ~16-22 us from a group's last tile to its copy, one wait on the other's counter ~5.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import enqueue, signal, state
from .nccl import Window, carved_bytes, cuda_backend

MAX_GROUPS = 256  # counters per rank: the most groups a call may have (and ready bands, ``pull_fused``)
# int32 offsets in each rank's memory (then ``fresh``: Peers.fresh); a claim zeroes [COUNTERS, DONE)
COUNTERS, SUMMED, READY, DONE = 0, MAX_GROUPS, 2 * MAX_GROUPS, 3 * MAX_GROUPS


def ring(rank: int, world: int) -> list[int]:
    """Every rank but ``rank``, in the order it pulls from them: ``rank + 1``, ``rank + 2``, ... (mod
    ``world``). Every rank pulling from its s-th next rank at the same time reads each GPU once: in
    rank order all of them would read rank 0's memory (or 1's) first, sharing its links."""
    return [(rank + s) % world for s in range(1, world)]


class Pulls:
    """What comm's pulls need of a group of ranks: ``rank``, ``world``, ``others`` (every rank but
    this one, :func:`ring`), :meth:`arrivals`, :meth:`mine`, :meth:`arrived` and :meth:`at` (sums that read in
    place: ``pull_scatter``'s) and (``pull_scatter``) :meth:`summed` and :meth:`sums`;
    :class:`Peers` on GPUs, :class:`Gathered` on gloo."""

    rank: int
    world: int
    others: list[int]
    memory: torch.Tensor  # this rank's memory the chunks are views of

    def arrivals(self, g: int, chunks: Mapping[int, torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
        """(rank, its bytes at ``chunks[rank]``'s place, of group ``g``) for each other rank in
        ``chunks`` once it is there; see :class:`Peers`."""
        raise NotImplementedError

    def every(self, chunk: torch.Tensor) -> dict[int, torch.Tensor]:
        """``chunk`` for each other rank (:meth:`arrivals` of the same bytes of every rank)."""
        return dict.fromkeys(self.others, chunk)

    def arrived(self, g: int, chunk: torch.Tensor) -> None:
        """Wait (on the current stream) until every other rank's ``chunk`` of group ``g`` is there,
        for sums that then read it in place (:meth:`at`)."""
        for _ in self.arrivals(g, self.every(chunk)):
            pass

    def at(self, rank: int, chunk: torch.Tensor) -> torch.Tensor:
        """Rank ``rank``'s bytes at ``chunk``'s place in its memory, to be read where they are (the
        sums of ``pull_scatter``), on a stream ordered after :meth:`arrivals`' wait for the group."""
        raise NotImplementedError

    def mine(self, g: int) -> None:
        """Before this rank's own rows of group ``g`` are read (on the stream that reads them, or one
        it waits for): wait until they are written. (Nothing to wait for on gloo.)"""

    def summed(self, g: int) -> None:
        """After this rank's share of group ``g`` is summed in its memory (on the stream that summed
        it): say so to the other ranks. (Nothing to say on gloo.)"""

    def ready(self, band: int) -> None:
        """After every other rank's partial sums of ``band`` of this rank's rows are copied here (on
        the stream ordered after the copies): tell this rank's GEMM epilogue (``pull_fused``). (On
        gloo the reference executor orders them itself.)"""

    def sums(self, g: int, parts: list[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
        """(rank, its ``parts[rank]`` of group ``g``) for each other rank, as soon as it says it has
        summed it there (the caller copies it)."""
        raise NotImplementedError

    def _at(self, theirs: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        """Another rank's memory ``theirs`` (uint8) at the place ``chunk`` has in this rank's."""
        start = chunk.data_ptr() - self.memory.data_ptr()
        return theirs[start : start + chunk.numel() * chunk.element_size()].view(chunk.dtype)


class Gathered(Pulls):
    """:class:`Peers`' steps on a gloo group (the CPU reference executor): each :meth:`arrivals`
    all-gathers every rank's ``memory`` (a flat tensor the chunks are views of) and yields the
    other ranks' bytes at ``chunk``'s place in it, as a pull copies them. Every rank asks for the
    same groups in the same order, so the gathers pair up, and a gather orders like the flags;
    :meth:`at` reads what the last one saw."""

    def __init__(self, group: dist.ProcessGroup, memory: torch.Tensor) -> None:
        self.group, self.memory = group, memory
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.others = ring(self.rank, self.world)
        self._seen: list[torch.Tensor] = []  # every rank's memory as the last arrivals gathered it

    def arrivals(self, g: int, chunks: Mapping[int, torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
        self._seen = self._every()  # (every rank gathers once per group, whatever it takes)
        for r in self.others:
            if r in chunks:
                yield r, self._at(self._seen[r], chunks[r])

    def at(self, rank: int, chunk: torch.Tensor) -> torch.Tensor:
        return self._at(self._seen[rank], chunk)

    def sums(self, g: int, parts: list[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
        every = self._every()
        for r in self.others:
            yield r, self._at(every[r], parts[r])

    def _every(self) -> list[torch.Tensor]:
        """Every rank's ``memory`` as it is now, in rank order."""
        mine = self.memory.view(torch.uint8)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        return every


class Peers(Window, Pulls):
    """The memory of every rank of ``group`` (a :class:`comm.nccl.Window` whose regions every rank
    maps): at its start the GEMM's counters and the flags (int32: ``counters`` [MAX_GROUPS],
    ``summed`` [MAX_GROUPS], ``ready`` [MAX_GROUPS], ``done`` [world], ``fresh`` [world]), then the
    GEMM's buffer, the same bytes for every call (calls of one rank are stream-ordered, the ranks'
    by the flags). Grows as a window does (collectively, with a host sync). A call sets
    :attr:`targets` (its groups' counter targets) before its groups."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__([], device)
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.others = ring(self.rank, self.world)
        self.fresh = DONE + self.world
        self.flag_bytes = carved_bytes((self.fresh + self.world,), torch.int32)
        self.peers: list[torch.Tensor] = []  # every rank's current region (uint8), as mapped here
        self._handles: list = []  # (each region stays mapped while its handle lives)
        self.targets: tuple[int, ...] = ()  # the current call's counter target per group
        # per other rank (as ``others``), the stream its pulls / its sums' copies go on, set per call
        # (runtime._enqueue); empty: the current stream
        self.lanes: tuple = ()
        self.sum_lanes: tuple = ()
        # recorded where the last claim zeroed the counters; external: a CUDA graph's GEMM waits for
        # the claim of an eager call before its replay, and an eager call's for the graph's claim
        self.claimed = torch.cuda.Event(external=True)

    def _grow(self, nbytes: int) -> None:
        """A new region of ``nbytes`` on every rank, its flags as a claim leaves them; kept only once
        all of that is done (an allocation that fails, out of memory, leaves the current region and
        its flags as they were, for the next call)."""
        import torch.distributed._symmetric_memory as symm_mem

        memory = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(memory, self.group.group_name)
        peers = [handle.get_buffer(r, (nbytes,), torch.uint8) for r in range(self.world)]
        # as claimed (nothing counted, the counters fresh) on every rank before any rank waits on this region
        flags = memory[: self.flag_bytes].view(torch.int32)
        flags.zero_()
        flags[self.fresh : self.fresh + self.world] = 1
        # (a wait on an event never recorded is none, also in a graph captured from the first call on)
        enqueue.record(self.claimed, torch.cuda.current_stream(self.device))
        torch.cuda.synchronize(self.device)
        nccl = cuda_backend(self.group) == "nccl"
        dist.barrier(group=self.group, device_ids=[self.device.index] if nccl else None)
        self.peers, self.memory = peers, memory
        self.regions.append(memory)
        self._handles.append(handle)

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The GEMM's flat buffer of ``numel`` elements, after the flags (grows the region first)."""
        return self.allocator(carved_bytes((numel,), dtype), dtype, start=self.flag_bytes)((numel,))

    @property
    def counters(self) -> torch.Tensor:
        """This rank's GEMM counters (int32 [MAX_GROUPS]) in its current region: a pull's GEMM bumps
        these, not its plan's."""
        return self.memory[: 4 * MAX_GROUPS].view(torch.int32)

    def _flag(self, rank: int, index: int) -> int:
        """The address of int32 ``index`` (``COUNTERS``, ``SUMMED``, ``READY``, ``DONE`` or ``fresh`` +
        ...) in rank ``rank``'s memory, as mapped here."""
        return self.peers[rank].data_ptr() + 4 * index

    def _write(self, rank: int, index: int, value: int) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        enqueue.runtime_call("fo_write_value", self._flag(rank, index), value, stream)

    def _take(self, rank: int, index: int) -> None:
        """Wait (the current stream) until rank ``rank``'s flag ``index`` is set, then clear it."""
        signal.wait_at(torch.cuda.current_stream(self.device), self._flag(rank, index), 1)
        self._write(rank, index, 0)

    def claim(self) -> None:
        """After a call (once this rank has seen its own counters): wait until every other rank has
        copied the call's groups out of this rank's buffer (and so seen its counters), zero the
        counters (and ``summed`` and ``ready`` flags) for the next call (``pull_fused``: the caller
        orders this after its GEMM, whose epilogue reads the ``ready`` flags), record :attr:`claimed`
        (what the next GEMM waits for), then clear the flags and say so (before the other ranks' next
        ``done``, which follows their pulls of the ``fresh`` counters)."""
        stream = torch.cuda.current_stream(self.device)
        for r in self.others:
            signal.wait_at(stream, self._flag(r, DONE + self.rank), 1)
        enqueue.runtime_call("fo_zero", self._flag(self.rank, COUNTERS), 4 * (DONE - COUNTERS), stream.cuda_stream)
        enqueue.record(self.claimed, stream)
        for r in self.others:
            self._write(r, DONE + self.rank, 0)
        for r in self.others:
            self._write(self.rank, self.fresh + r, 1)

    def arrivals(self, g: int, chunks: Mapping[int, torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
        """(rank, its bytes at ``chunks[rank]``'s place, of group ``g``) for each other rank in
        ``chunks``, as soon as its counter says the group is written (the caller copies it on the
        current stream -- the rank's lane, :attr:`lanes`, while it holds the pair -- or reads it in
        place on a stream ordered after it); before a call's first group, once every other rank
        zeroed its counters for this call (waited for from every other rank, in ``chunks`` or not)."""
        for stream, r in self._on_lanes(self.lanes):
            if g == 0:
                self._take(r, self.fresh + self.rank)
            if r not in chunks:
                continue
            signal.wait_at(stream, self._flag(r, COUNTERS + g), self.targets[g])
            yield r, self._at(self.peers[r], chunks[r])

    def at(self, rank: int, chunk: torch.Tensor) -> torch.Tensor:
        return self._at(self.peers[rank], chunk)

    def _on_lanes(self, lanes: tuple) -> Iterator[tuple[torch.cuda.Stream, int]]:
        """(stream, rank) for each other rank: its lane in ``lanes`` (empty: the current stream), the
        current stream while the caller holds the pair."""
        current = torch.cuda.current_stream(self.device)
        for j, r in enumerate(self.others):
            if not lanes:
                yield current, r
                continue
            torch.cuda.set_stream(lanes[j])
            try:
                yield lanes[j], r
            finally:
                torch.cuda.set_stream(current)

    def mine(self, g: int) -> None:
        signal.wait_at(torch.cuda.current_stream(self.device), self._flag(self.rank, COUNTERS + g), self.targets[g])

    def summed(self, g: int) -> None:
        self._write(self.rank, SUMMED + g, 1)

    def ready(self, band: int) -> None:
        self._write(self.rank, READY + band, 1)

    @property
    def ready_flags(self) -> torch.Tensor:
        """This rank's ``ready`` flags (int32 [MAX_GROUPS]) in its current region, as its GEMM's
        epilogue polls them (``pull_fused``)."""
        return self.memory[4 * READY : 4 * DONE].view(torch.int32)

    def sums(self, g: int, parts: list[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
        """As :class:`Pulls`, on the ranks' :attr:`sum_lanes` as :meth:`arrivals` on :attr:`lanes`;
        ordered after the call's first :meth:`arrivals` (the ``fresh`` handshake: not the previous
        call's flags) by the caller's streams."""
        for stream, r in self._on_lanes(self.sum_lanes):
            signal.wait_at(stream, self._flag(r, SUMMED + g), 1)
            yield r, self._at(self.peers[r], parts[r])

    def mark(self, g: int) -> None:
        """Count group ``g`` as written (to its target), as the GEMM would (the tuner's measured pulls)."""
        self._write(self.rank, COUNTERS + g, self.targets[g])

    def copied(self) -> None:
        """Every group of the call is copied (or read in place) here: tell the ranks they came from."""
        for r in self.others:
            self._write(self.rank, DONE + r, 1)


class Rank(NamedTuple):
    """What a rank tells the other ranks of its group about itself, once per group (:func:`every_rank`)."""

    host: str
    gpu: str  # the GPU's uuid
    peer_access: bool  # to every other GPU it sees (False where it sees only its own)
    name: str  # the GPU's model, as torch.cuda.get_device_name says it
    sms: int


def this_rank(device: torch.device) -> Rank:
    """This rank's :class:`Rank`, asked of the host and of CUDA."""
    props = torch.cuda.get_device_properties(device)
    others = [j for j in range(torch.cuda.device_count()) if j != device.index]
    peer_access = bool(others) and all(torch.cuda.can_device_access_peer(device.index, j) for j in others)
    return Rank(socket.gethostname(), str(props.uuid), peer_access, props.name, props.multi_processor_count)


def every_rank(group: dist.ProcessGroup | None, device: torch.device) -> tuple[Rank, ...]:
    """Every rank's :class:`Rank` in ``group``'s rank order: gathered on the first ask per group and
    device (a collective with a host sync, which every rank reaches alike: decision._start) and kept
    in the group's state, so that every rank decides on the same facts."""
    known = state.of(group).ranks
    if device.index not in known:
        views: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(views, this_rank(device), group=group)
        known[device.index] = tuple(views)
    return known[device.index]


def hosts(ranks: tuple[Rank, ...]) -> list[str]:
    """The hosts ``ranks`` sit on, each once, in rank order."""
    return list(dict.fromkeys(r.host for r in ranks))


def unavailable(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Why the ranks of ``group`` cannot pull from each other's memory, or None where they can:
    an NCCL group (gloo's ranks may share a GPU) of ranks on one host, each on a GPU of its own
    with peer access to every GPU it sees (checked on every rank), and P2P not disabled (the
    consumer-GPU emulation forces NCCL through host memory: pulling over NVLink would bypass it).
    The same answer on every rank: it rests on every rank's view (:func:`every_rank`)."""
    if os.environ.get("NCCL_P2P_DISABLE") == "1":
        return "NCCL_P2P_DISABLE=1 rules out copies between the GPUs' memories"
    if cuda_backend(group) != "nccl":
        return f"a {cuda_backend(group)} group (its ranks may share a GPU): pulls need an NCCL group"
    return why_not(every_rank(group, device))


def why_not(ranks: tuple[Rank, ...]) -> str | None:
    """What in the ranks' views rules pulls out (:func:`unavailable`), None where nothing does."""
    if len(hosts(ranks)) > 1:
        return "ranks on several hosts: pulls need every rank's GPU on one host"
    if len({r.gpu for r in ranks}) < len(ranks):
        return "ranks sharing a GPU: pulls need a GPU per rank"
    if not all(r.peer_access for r in ranks):
        return "a rank without peer access to every GPU it sees (or seeing only its own): no pulls"
    return None


def peers(group: dist.ProcessGroup, device: torch.device) -> Peers:
    """The :class:`Peers` of ``group`` on ``device``, made once and kept in the group's state (its
    memory on the first call that needs it)."""
    made = state.of(group).peers
    if device.index not in made:
        made[device.index] = Peers(group, device)
    return made[device.index]
