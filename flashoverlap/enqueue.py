"""An overlapped call's host work as one native call (csrc/runtime.cu ``fo_replay``).

A call enqueues some twenty operations: the GEMM, a counter wait and a collective per group, event
records and waits between its streams, copies out of a window, the counter reset. Issued from
Python each costs microseconds (ctypes, torch's wrappers): a 3-group call took ~670 us of host
time on the H100 host against ~290 us of GPU time, so short GEMMs could not overlap
unless replayed as CUDA graphs. So a call of a kind seen before runs from Python once more while a
:class:`Tape` notes each native call it makes (:func:`note`), and later calls of that kind replay
the notes in one native call (:class:`Program`) with what changes per call substituted: the
operands and the buffers allocated per call (the caller's stream is part of the kind). (The first call of a kind sets up
what the second notes: events, windows, communicators.) Only calls whose every step is such a
native call are recorded (runtime.run_overlapped decides); a step that is not marks the tape
unusable (:func:`opaque`).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager

from . import jit

# fo_replay's signatures by index: p pointer (rebased where it lies in a per-call value), u unsigned,
# i int, n size_t; the C side lists the same argument counts (kArgs). A noted call's signature is
# its ctypes argument types (:func:`signature`), those the Python path calls it with.
SIGNATURES = (
    "pp",  # fo_record_event, fo_wait_event
    "pup",  # fo_stream_wait, fo_write_value
    "pnp",  # fo_zero
    "pnpnnnp",  # fo_copy_2d
    "punpip",  # fo_spin_wait
    "ppniipp",  # ncclAllReduce, ncclReduceScatter
    "ppnipp",  # ncclAllGather, ncclAlltoAll
    "pniipp",  # ncclSend, ncclRecv
    "",  # ncclGroupStart, ncclGroupEnd
    "p" * 12 + "i" * 17 + "p",  # fo_run (a signal GEMM, csrc/launcher.cuh)
    "ppp" + "i" * 7 + "p",  # fo_restore
    "p" * 10 + "inip",  # fo_sum
)
_INDEX = {sig: i for i, sig in enumerate(SIGNATURES)}
_KINDS = {ctypes.c_void_p: "p", ctypes.c_uint: "u", ctypes.c_int: "i", ctypes.c_size_t: "n", ctypes.c_ulonglong: "n"}

_local = threading.local()  # .tape: the Tape being written on this thread, if any


def signature(argtypes: Sequence[type]) -> str:
    """A C function's ctypes argument types as :data:`SIGNATURES` spells them."""
    return "".join(_KINDS[t] for t in argtypes)


@functools.cache
def address(lib: ctypes.CDLL, name: str) -> int:
    """The address of ``lib``'s C function ``name``."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


class Tape:
    """The native calls of one call, in order, each argument of kind ``p`` expressed relative to the
    per-call value it lies in (``values``: (address, bytes) each), if any (never a null pointer)."""

    def __init__(self, values: Sequence[tuple[int, int]]) -> None:
        self.values = tuple(values)
        self.words: list[int] = []
        self.errors: list[Callable[[int], str]] = []
        self.usable = True

    def _operand(self, kind: str, value: int | None) -> tuple[int, int]:
        value = int(value or 0)
        if kind == "p" and value:
            for exact in (True, False):  # an operand's own start first (views of one storage)
                for slot, (start, size) in enumerate(self.values, 1):
                    if value == start if exact else start <= value < start + size:
                        return slot, value - start
        if not 0 <= value < 2**64:
            raise ValueError(f"replay: argument {value} does not fit 64 bits")
        return 0, value

    def add(self, signature: str, function: int, args: Sequence[int | None], error: Callable[[int], str]) -> None:
        if len(args) != len(signature):
            raise ValueError(f"replay: {len(args)} arguments for signature {signature!r}")
        self.words += [_INDEX[signature], function]
        for kind, value in zip(signature, args):
            self.words += self._operand(kind, value)
        self.errors.append(error)

    def program(self) -> Program:
        return Program(self.words, self.errors, len(self.values))


class Program:
    """A :class:`Tape` made native: :meth:`replay` enqueues its calls with new per-call values."""

    def __init__(self, words: Sequence[int], errors: Sequence[Callable[[int], str]], values: int) -> None:
        self._words = (ctypes.c_uint64 * len(words))(*words)
        self._errors = tuple(errors)
        self._values = ctypes.c_uint64 * values  # (made once: a replay's host time is what it is for)
        self._replay = jit.runtime_library().fo_replay
        self.ops = len(errors)

    def replay(self, values: Sequence[int]) -> None:
        """Enqueue the recorded calls, the per-call values (in the tape's order) substituted."""
        if len(values) != self._values._length_:  # (ctypes would pad a short list with null pointers)
            raise ValueError(f"replay: {len(values)} per-call values for a tape of {self._values._length_}")
        status = ctypes.c_int()
        failed = self._replay(self._words, len(self._words), self._values(*values), ctypes.byref(status))
        if failed >= 0:
            raise RuntimeError(
                f"flashoverlap: replayed call {failed} of {self.ops} failed: {self._errors[failed](status.value)}"
            )


@contextmanager
def recording(tape: Tape | None):
    """Note the native calls made inside on ``tape`` (None: nothing is noted)."""
    outer = getattr(_local, "tape", None)
    _local.tape = tape
    try:
        yield tape
    finally:
        _local.tape = outer


def noting() -> bool:
    """Whether a tape is being written on this thread (so that a caller can skip preparing a note)."""
    tape = getattr(_local, "tape", None)
    return tape is not None and tape.usable


def note(signature: str, function: int, args: Sequence[int | None], error: Callable[[int], str]) -> None:
    """A native call just made (``function``: its address; ``error(status)`` says what a failure
    means), for the tape being written, if any."""
    tape = getattr(_local, "tape", None)
    if tape is not None and tape.usable:
        tape.add(signature, function, args, error)


def opaque() -> None:
    """Something other than a noted native call was just enqueued: the tape being written (if any)
    cannot replay the call."""
    tape = getattr(_local, "tape", None)
    if tape is not None:
        tape.usable = False


def runtime_call(name: str, *args: int | None) -> None:
    """Call csrc/runtime.cu's ``name`` (argument types set in jit.runtime_library), raise on
    failure, and note it."""
    lib = jit.runtime_library()
    jit.check(lib, getattr(lib, name)(*args), "fo_runtime_error")
    if noting():
        _note_runtime(name, args)


def _note_runtime(name: str, args: Sequence[int | None]) -> None:
    """A call of csrc/runtime.cu's ``name`` with ``args`` just made (by us, or by torch: the events), noted."""
    lib = jit.runtime_library()
    note(signature(getattr(lib, name).argtypes), address(lib, name), args, _runtime_error)


def _runtime_error(status: int) -> str:
    return jit.runtime_library().fo_runtime_error().decode()


def record(event, stream) -> None:
    """``event.record(stream)`` (torch objects), noted."""
    event.record(stream)
    if noting():
        _note_runtime("fo_record_event", (event.cuda_event, stream.cuda_stream))


def wait(stream, event) -> None:
    """``stream.wait_event(event)`` (torch objects), noted where the event exists (torch skips the
    wait on an event never recorded; so would the replay)."""
    stream.wait_event(event)
    if not noting():
        return
    if event.cuda_event:
        _note_runtime("fo_wait_event", (stream.cuda_stream, event.cuda_event))
    else:
        opaque()  # recorded later, the replay must wait on it: not a call to replay
