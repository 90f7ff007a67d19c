"""The recording of a call's native calls and their replay with new per-call values (enqueue)."""

import ctypes
import re
import shutil
import threading
from pathlib import Path

import pytest

from flashoverlap import enqueue, jit
from flashoverlap.comm import nccl
from flashoverlap.gemm.kernel import RUN_ARGTYPES

RUNTIME = Path(jit.__file__).parent / "csrc" / "runtime.cu"


def test_signatures_match_the_replay_loop():
    """fo_replay reads as many arguments per signature as enqueue.SIGNATURES spells."""
    counts = re.search(r"kArgs\[\] = \{([^}]*)\}", RUNTIME.read_text()).group(1)
    assert [int(c) for c in counts.split(",")] == [len(s) for s in enqueue.SIGNATURES]
    assert all(set(s) <= set("puin") for s in enqueue.SIGNATURES)
    # every NCCL call a Direct communicator makes can be noted
    assert {enqueue.signature(argtypes) for argtypes in nccl._SIGNATURES.values()} <= set(enqueue.SIGNATURES)
    assert enqueue.signature(RUN_ARGTYPES) in enqueue.SIGNATURES


def test_pointers_are_noted_relative_to_the_per_call_value_they_lie_in():
    a, w, out, stream = 0x10000, 0x20000, 0x30000, 0x7000
    tape = enqueue.Tape([(a, 0x100), (w, 0x80), (out, 0x1000)])
    tape.add("ppniipp", 0xF00, (out + 0x200, out + 0x200, 64, 9, 0, 0x5555, stream), str)
    tape.add("pup", 0xF01, (a + 0x100, 0x10010, stream), str)  # one past a's end: a constant; an integer
    tape.add("pnp", 0xF02, (None, 0x20000, stream), str)  # None: a null pointer, never rebased
    assert tape.words == [
        enqueue.SIGNATURES.index("ppniipp"), 0xF00,
        3, 0x200, 3, 0x200, 0, 64, 0, 9, 0, 0, 0, 0x5555, 0, stream,
        enqueue.SIGNATURES.index("pup"), 0xF01, 0, a + 0x100, 0, 0x10010, 0, stream,
        enqueue.SIGNATURES.index("pnp"), 0xF02, 0, 0, 0, 0x20000, 0, stream,
    ]  # fmt: skip
    assert len(tape.errors) == 3
    empty = enqueue.Tape([(0, 0), (0x40000, 8)])  # an empty tensor's address is 0
    empty.add("pp", 1, (0, 0x40000), str)
    assert empty.words[2:] == [0, 0, 2, 0]


def test_a_pointer_prefers_the_value_it_starts():
    view = enqueue.Tape([(0x1000, 0x100), (0x1040, 0x10)])  # (a call's extents never overlap: runtime._disjoint)
    view.add("pnp", 1, (0x1040, 0x1040, 0x1000), str)
    assert view.words[2:] == [2, 0, 0, 0x1040, 1, 0]
    with pytest.raises(ValueError, match="3 arguments for signature 'pp'"):
        view.add("pp", 1, (1, 2, 3), str)
    with pytest.raises(ValueError, match="does not fit 64 bits"):
        view.add("pp", 1, (-5, 0), str)


def test_notes_go_to_the_tape_being_written_on_this_thread_only():
    enqueue.note("pp", 1, (2, 3), str)  # no tape: nothing happens
    assert not enqueue.noting()
    tape = enqueue.Tape([])
    seen = []
    with enqueue.recording(tape):
        assert enqueue.noting()
        enqueue.note("pp", 1, (2, 3), str)
        worker = threading.Thread(target=lambda: seen.append(enqueue.noting()))
        worker.start()
        worker.join()
        with enqueue.recording(None):  # nested: nothing noted inside
            enqueue.note("pp", 1, (4, 5), str)
        assert enqueue.noting()
    assert seen == [False] and len(tape.errors) == 1 and not enqueue.noting()
    with enqueue.recording(tape):
        enqueue.opaque()
        assert not enqueue.noting()
        enqueue.note("pp", 1, (2, 3), str)
    assert not tape.usable and len(tape.errors) == 1


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_native_replay_substitutes_each_call_s_values(tmp_path, monkeypatch):
    """fo_replay itself, without a GPU: libc's strcmp (two pointers) stands in for a recorded call,
    so the status it returns says whether the pointers substituted are the ones meant."""
    monkeypatch.setenv("FLASHOVERLAP_CACHE_DIR", str(tmp_path))
    jit.runtime_library.cache_clear()
    libc = ctypes.CDLL(None)
    strcmp = ctypes.cast(libc.strcmp, ctypes.c_void_p).value
    texts = [ctypes.create_string_buffer(t) for t in (b"..same", b"same", b"..diff", b"same")]
    where = [ctypes.addressof(t) for t in texts]
    try:
        lib = jit.runtime_library()
        calls = [n for n in dir(lib) if n.startswith("fo_") and getattr(lib, n).argtypes is not None]
        # every runtime call the Python path makes (all that jit.runtime_library declares but the replay) can be noted
        noted = {
            "fo_restore",
            "fo_copy_2d",
            "fo_zero",
            "fo_stream_wait",
            "fo_spin_wait",
            "fo_record_event",
            "fo_wait_event",
            "fo_sum",
            "fo_write_value",
        }
        assert set(calls) == noted | {"fo_replay"}
        assert all(enqueue.signature(getattr(lib, n).argtypes) in enqueue.SIGNATURES for n in noted)
        tape = enqueue.Tape([(where[0], 7), (where[1], 5)])
        tape.add("pp", strcmp, (where[0] + 2, where[1]), lambda status: f"strcmp said {status}")
        tape.add("", ctypes.cast(libc.getpid, ctypes.c_void_p).value, (), lambda status: "getpid is never 0")
        program = tape.program()
        with pytest.raises(RuntimeError, match=r"replayed call 1 of 2 failed: getpid is never 0"):
            program.replay(where[:2])  # "same" == "same": the first passes, the second fails
        with pytest.raises(RuntimeError, match=r"replayed call 0 of 2 failed: strcmp said"):
            program.replay(where[2:])  # "diff" != "same"
        words = (ctypes.c_uint64 * 2)(len(enqueue.SIGNATURES), strcmp)
        status = ctypes.c_int()
        assert jit.runtime_library().fo_replay(words, 2, None, ctypes.byref(status)) == 0 and status.value == -1
        assert b"malformed op 0" in jit.runtime_library().fo_runtime_error()
    finally:
        jit.runtime_library.cache_clear()
