"""Where a replayed call's host time goes (torchrun): the public call back to back against its
pieces, each timed alone the same way (us per call of 200 calls while the host runs ahead; where
the host sets the pace, host time): ``call`` (the public call), ``runner`` (the kept decision's
runner: the call less its front), ``replay`` (runtime.Replay: allocations, native replay,
watchdog), ``native`` (enqueue.Program.replay alone), ``unbatched`` (the same native replay with
every stream memory operation enqueued on its own), ``allocs``, ``watch``, ``current`` (the
replay's checks), and ``torch`` (``F.linear`` + torch.distributed's collective). Then the native
replay's driver calls by kind, from a build of csrc/runtime.cu that times each (rows of stream
memory operations as one). The cases take turns in balanced orders (timing.balanced_orders), one
block each per order; the median block.
  torchrun --nproc-per-node 2 bench/replay_profile.py MxNxK CONFIG_JSON [COLLECTIVE]
(COLLECTIVE: all_reduce (default), reduce_scatter or all_to_all, split evenly; the config must
make the call overlapped and replayable: NCCL's C API or pulls.)"""

import ctypes
import statistics
import sys

import torch
import torch.distributed as dist
from host_profile import (  # (bench/host_profile.py: Python puts a script's folder first on the path)
    per_call_us,
    setup,
)

from flashoverlap import comm, jit, runtime, state
from flashoverlap.config import OverlapConfig
from flashoverlap.timing import balanced_orders

KINDS = ["event", "memop", "zero", "copy", "spin", "nccl", "nccl", "nccl", "nccl group", "gemm", "restore", "sum"]
ROWS = len(KINDS)  # (the timed build's slot for rows of stream memory operations)
SINCE = "std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0_).count()"


def timed_source(batched: bool = True) -> str:
    """csrc/runtime.cu with each replayed call's host time added up per signature, and per row of
    stream memory operations (``fo_times`` reads and resets the sums); ``batched`` False: every
    stream memory operation enqueued on its own."""
    src = (jit._PACKAGE_DIR / "csrc" / "runtime.cu").read_text()
    edits = [
        ("#include <algorithm>", "#include <algorithm>\n#include <chrono>"),
        ("namespace {", "namespace {\ndouble g_ns[16];\nlong long g_n[16];"),
        (
            "    int rc = 0;\n    switch (sig) {",
            "    int rc = 0;\n    auto t0_ = std::chrono::steady_clock::now();\n    switch (sig) {",
        ),
        (
            "    if (rc != 0) {\n      *status = rc;\n      return index;",
            f"    g_ns[sig] += {SINCE};\n"
            "    g_n[sig]++;\n    if (rc != 0) {\n      *status = rc;\n      return index;",
        ),
        (
            "    CUresult const err = batch(",
            "    auto t0_ = std::chrono::steady_clock::now();\n    CUresult const err = batch(",
        ),
        (
            '    if (err != CUDA_SUCCESS) {\n      std::snprintf(g_error, sizeof(g_error), "cuStreamBatchMemOp',
            f"    g_ns[{ROWS}] += {SINCE};\n"
            f"    g_n[{ROWS}] += 1;\n    g_n[{ROWS + 1}] += n;\n"
            '    if (err != CUDA_SUCCESS) {\n      std::snprintf(g_error, sizeof(g_error), "cuStreamBatchMemOp',
        ),
    ]
    if not batched:
        edits.append(
            (
                'static bool const batches = driver_entry<BatchMemOp>("cuStreamBatchMemOp") != nullptr;',
                "static bool const batches = false;",
            )
        )
    for old, new in edits:
        if src.count(old) != 1:
            raise RuntimeError(f"csrc/runtime.cu changed: {old!r} is not there once")
        src = src.replace(old, new)
    return src + (
        '\nextern "C" void fo_times(double* ns, long long* n) {\n'
        "  for (int i = 0; i < 16; ++i) { ns[i] = g_ns[i]; n[i] = g_n[i]; g_ns[i] = 0; g_n[i] = 0; }\n}\n"
    )


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__.split("\n  ")[-1])  # (the usage: a replayable config must be named)
    jit.build_runtime = lambda **kw: jit.build("fo_runtime_timed", timed_source(), arch=jit.RUNTIME_ARCH, **kw)
    rank, (m, n, k), config, name, a, w, ex, call = setup()
    cfg = OverlapConfig.from_dict(config)
    for _ in range(runtime.RECORDED_CALLS + 2):
        call(a, w, config=cfg)
    torch.cuda.synchronize()
    replays = [r for prep in state.plans.values() for r in prep.replays.values()]
    if not replays:
        raise SystemExit("the call is not replayed natively (plain, through c10d, or a step that is not native)")
    replay = replays[-1]
    runner = list(state.kept(None).runners.values())[-1][0]
    made = [torch.empty(shape, dtype=replay.dtype, device="cuda") for shape in replay.shapes]
    values = [a.data_ptr(), w.data_ptr(), *(t.data_ptr() for t in made)]
    # the same words replayed by a build that batches nothing: their functions are the first build's
    unbatched = ctypes.CDLL(str(jit.build("fo_runtime_unbatched", timed_source(False), arch=jit.RUNTIME_ARCH)))
    unbatched.fo_replay.argtypes = jit.runtime_library().fo_replay.argtypes
    words = replay.program._words
    status = ctypes.c_int()

    def one_by_one() -> None:
        if unbatched.fo_replay(words, len(words), (ctypes.c_uint64 * len(values))(*values), ctypes.byref(status)) >= 0:
            raise RuntimeError(unbatched.fo_runtime_error().decode())

    unbatched.fo_runtime_error.restype = ctypes.c_char_p
    cases = {
        "call": lambda: call(a, w, config=cfg),
        "runner": lambda: runner(a, w, None),
        "replay": lambda: replay(a, w, None),
        "native": lambda: replay.program.replay(values),
        "unbatched": one_by_one,
        "allocs": lambda: [torch.empty(s, dtype=replay.dtype, device="cuda") for s in replay.shapes],
        "watch": lambda: runtime._watch(replay.watched),
        "current": replay.current,
        "torch": lambda: comm.collective(ex, torch.nn.functional.linear(a, w), None),
    }
    names = list(cases)
    blocks: dict[str, list[float]] = {c: [] for c in names}
    for order in balanced_orders(len(names)):
        for v in order:
            blocks[names[v]].append(per_call_us(cases[names[v]], 200, waited=False))
    lib = jit.runtime_library()
    ns, counts = (ctypes.c_double * 16)(), (ctypes.c_longlong * 16)()
    lib.fo_times(ns, counts)
    dist.barrier()
    for _ in range(200):
        replay.program.replay(values)
    torch.cuda.synchronize()
    lib.fo_times(ns, counts)
    if rank == 0:
        print(
            f"{name} {m}x{n}x{k} {sys.argv[2]}, {dist.get_world_size()} ranks: {replay.program.ops} operations per call"
        )
        for case in names:
            each = [round(b, 1) for b in blocks[case]]
            print(f"  {case:>9}: {statistics.median(blocks[case]):6.1f} us per call  {each}")
        print("  native, by kind (us per call):")
        for i, kind in enumerate(KINDS):
            if counts[i]:
                each, total = ns[i] / counts[i] / 1e3, ns[i] / 200 / 1e3
                print(f"    {kind:>10}: {counts[i] / 200:4.1f} x {each:5.2f} = {total:5.1f}")
        if counts[ROWS]:
            per = counts[ROWS + 1] / counts[ROWS]
            print(
                f"    {'memop rows':>10}: {counts[ROWS] / 200:4.1f} x {ns[ROWS] / counts[ROWS] / 1e3:5.2f} = "
                f"{ns[ROWS] / 200 / 1e3:5.1f} ({per:.1f} operations a row)"
            )
        print(f"    {'all':>10}: {sum(ns[: ROWS + 1]) / 200 / 1e3:5.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
