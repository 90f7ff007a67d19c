"""Fault injection on GPUs: no overlapped call may hang when a rank dies, raises, skips a call or
loses its NCCL communicators (not collected by pytest; it starts its own workers, no torchrun):

    python tests/fault_injection.py --world 2 --paths direct c10d symmetric pull a2a_pull \\
        --cases kill raise skip nccl_error --timeout 5 --parallel 4 --csv OUT.csv [--gpus 0,1,2,3]

For each (path, case) the supervisor starts ``--world`` worker processes (this script with
``--worker``), on GPUs of their own (concurrent cases on disjoint GPU sets where there are enough,
else sharing them), with ``FLASHOVERLAP_TIMEOUT_S=--timeout`` and the process group's timeout
alike. Every worker warms up (5 calls), writes ``ready.<rank>``, then enqueues 200 calls without
syncing; the last rank injects the fault at call 100 and writes its wall-clock time to ``fault``
just before:

- ``kill``: SIGKILL right after enqueueing call 100 (the peers wait for a rank that is gone);
- ``raise``: an uncaught RuntimeError after call 100 (the rank exits through the interpreter);
- ``skip``: call 100 left out (the ranks' collectives pair off by one; the last call has no peer);
- ``nccl_error``: its communicators aborted after call 100, then calling on (n/a for the pulls,
  whose calls hold no NCCL).

The other ranks should not get past the stream: flashoverlap's watchdog should end them
(``flashoverlap watchdog:`` on stderr, SIGABRT) within the timeout. The supervisor waits for each
worker until ``timeout + --grace`` seconds after the fault (``--startup-timeout`` before it: the
first call compiles kernels), kills the stragglers' process groups and calls them hung. It prints
one row per rank (exit code, seconds from the fault to exit, outcome, last stderr line) and one
summary per case (the slowest survivor), writes them to ``--csv``, and exits non-zero if a rank
hung, a case never reached its fault, or a survivor took longer than ``timeout + 60`` s.
Outcomes: watchdog, torch (torch's NCCL watchdog / timeout), raised (a Python traceback),
finished (exit 0), killed (the injected SIGKILL), hang, other (any other exit, e.g. a signal), and
for the faulty rank ``exit hang``: hung after its calls were done (it printed "finished" or raised),
in torch's teardown (``destroy_process_group`` or the process groups' destructors at exit, which
flush collectives its gone peers will never join: torch expects a hang there from a program that
skipped a call). That is the faulty program's own, not a call that hung, and does not fail the run;
a launcher such as torchrun ends that rank once the others have exited.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flashoverlap import report

PATHS = ("direct", "c10d", "symmetric", "pull", "a2a_pull")
CASES = ("kill", "raise", "skip", "nccl_error")
NO_NCCL = ("pull", "a2a_pull")  # paths whose calls run no NCCL collective: nccl_error is n/a there
OUTCOMES = ("watchdog", "torch", "raised", "finished", "killed", "hang", "exit hang", "other", "n/a")

SIZE = 4096  # M = N = K of the operands (bf16)
WARMUP = 5
CALLS = 200
FAULT_CALL = 100
SLOW_MARGIN_S = 60.0  # a survivor slower than timeout + this fails the run
# stderr text of torch's own NCCL watchdog / timeouts (ProcessGroupNCCL), strongest first
TORCH_STRONG = (
    "Watchdog caught collective operation timeout",
    "Some NCCL operations have failed or timed out",
    "taking the entire process down",
    "Process group watchdog thread terminated",
    "ProcessGroupNCCL's watchdog",
)
TORCH_WEAK = ("ProcessGroupNCCL", "NCCL error", "ncclCommWatchdog")
WATCHDOG_TEXT = "flashoverlap watchdog:"
TRACEBACK_TEXT = "Traceback (most recent call last)"
FIELDS = ("world", "path", "case", "rank", "role", "returncode", "seconds", "outcome", "last_line")
LAST_LINES = 20  # stderr lines kept per rank
LAST_LINE_CHARS = 110  # the table's last-line column


# --- the case matrix -----------------------------------------------------------------------------


def applicable(path: str, case: str) -> bool:
    """Whether ``case`` can be injected on ``path``: aborting NCCL communicators tests nothing where
    the call holds none (the pulls copy out of mapped memory)."""
    return not (case == "nccl_error" and path in NO_NCCL)


def case_matrix(paths: Sequence[str], cases: Sequence[str]) -> list[tuple[str, str, bool]]:
    """Every (path, case, applicable), paths outer: the order the cases are started and reported."""
    return [(path, case, applicable(path, case)) for path in paths for case in cases]


def call_config(path: str, world: int) -> tuple[str, dict]:
    """The flashoverlap entry point (name) and config of ``path`` on ``world`` ranks. A pull on more
    than two ranks is pull_scatter (each rank sums only its share), the config the tuner picks there."""
    if path in ("direct", "c10d"):  # (c10d: the same call, FLASHOVERLAP_NCCL=c10d in its environment)
        return "gemm_all_reduce", {"comm_sms": 16}
    if path == "symmetric":
        return "gemm_all_reduce", {"symmetric": True}
    if path == "pull":
        return "gemm_all_reduce", {"reduction": "pull" if world == 2 else "pull_scatter", "comm_sms": 4}
    if path == "a2a_pull":
        return "gemm_all_to_all", {"layout": "segments", "reduction": "pull", "comm_sms": 4}
    raise ValueError(f"unknown path {path!r}; expected one of {PATHS}")


# --- outcomes ------------------------------------------------------------------------------------


def classify(returncode: int | None, stderr: str, *, hung: bool, injected_kill: bool) -> str:
    """One rank's outcome from how it ended and its stderr. Order matters: flashoverlap's watchdog
    line wins over anything torch printed beside it; an exit 0 is ``finished`` whatever warnings
    came before; torch's watchdog text wins over a traceback (its abort can interrupt the main
    thread mid-raise), a bare "ProcessGroupNCCL" does not (NCCL errors raised as DistBackendError
    name it in their traceback: that rank raised)."""
    if hung:
        return "hang"
    if injected_kill and returncode == -signal.SIGKILL:
        return "killed"
    if WATCHDOG_TEXT in stderr:
        return "watchdog"
    if returncode == 0:
        return "finished"
    if any(text in stderr for text in TORCH_STRONG):
        return "torch"
    if TRACEBACK_TEXT in stderr:
        return "raised"
    if any(text in stderr for text in TORCH_WEAK):
        return "torch"
    return "other"


def past_its_calls(stdout: Path, stderr: Path) -> bool:
    """Whether a rank got past its stream of calls: it printed "finished" or raised (read whole: a
    traceback's first line is far from the end of a long one)."""

    def text(path: Path) -> str:
        return path.read_text(errors="replace") if path.exists() else ""

    return " finished (" in text(stdout) or TRACEBACK_TEXT in text(stderr)


def last_line(lines: Sequence[str], limit: int = LAST_LINE_CHARS) -> str:
    """The last non-blank line, shortened to ``limit`` characters (its end kept: where messages
    are long, the reason is last)."""
    for line in reversed(lines):
        text = line.strip()
        if text:
            return text if len(text) <= limit else "..." + text[-(limit - 3) :]
    return ""


def tail(path: Path, count: int = LAST_LINES) -> list[str]:
    """The last ``count`` lines of a log file (read as text, bad bytes replaced; [] if absent)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))  # a crash can log much; the end is what counts
            data = f.read()
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-count:]


@dataclass
class Result:
    """One rank of one case (rank None: a case not run, n/a)."""

    world: int
    path: str
    case: str
    rank: int | None
    role: str  # faulty / survivor / "" (n/a)
    returncode: int | None
    seconds: float | None  # from the fault to this rank's exit (to its kill, for a hang)
    outcome: str
    last_line: str
    lines: list[str] = field(default_factory=list, repr=False)  # stderr's last lines
    fault_reached: bool = True

    def row(self) -> dict:
        """The CSV / table row."""
        return {
            "world": self.world,
            "path": self.path,
            "case": self.case,
            "rank": "" if self.rank is None else self.rank,
            "role": self.role,
            "returncode": "" if self.returncode is None else self.returncode,
            "seconds": "" if self.seconds is None else f"{self.seconds:.1f}",
            "outcome": self.outcome,
            "last_line": self.last_line,
        }


# --- GPUs, ports, environment --------------------------------------------------------------------


class SlotPool:
    """GPU sets for concurrent cases: the GPUs cut into disjoint sets of ``world``; each case takes
    the least used set (ties: the first), so that with 4 GPUs and world 2 two cases run on disjoint
    pairs and further ones (``--parallel`` beyond) share them evenly."""

    def __init__(self, gpus: Sequence[int], world: int) -> None:
        if len(gpus) < world:
            raise ValueError(f"world {world} needs {world} GPUs, got {list(gpus)}")
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"GPUs listed twice: {list(gpus)}")
        self.slots = [list(gpus[i : i + world]) for i in range(0, len(gpus) - world + 1, world)]
        self.load = [0] * len(self.slots)

    def acquire(self) -> int:
        """The index of the least used GPU set, now used once more."""
        index = min(range(len(self.slots)), key=lambda i: (self.load[i], i))
        self.load[index] += 1
        return index

    def release(self, index: int) -> None:
        self.load[index] -= 1


def visible_devices(gpus: Sequence[int], parent: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for GPUs numbered as this process sees them: where the supervisor itself
    runs under CUDA_VISIBLE_DEVICES, its GPU i is the i-th entry there, not physical GPU i."""
    if parent is None or not parent.strip():
        return ",".join(str(g) for g in gpus)
    listed = [d.strip() for d in parent.split(",") if d.strip()]
    if max(gpus) >= len(listed):
        raise ValueError(f"GPU {max(gpus)} is not among CUDA_VISIBLE_DEVICES={parent!r}")
    return ",".join(listed[g] for g in gpus)


def free_port(taken: set[int]) -> int:
    """A TCP port free now and not handed out before in this run (each case's rendezvous has its
    own: a port of a case just ended may still be held by its store)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            taken.add(port)
            return port
    raise RuntimeError("no free TCP port")


def worker_env(
    base: dict[str, str], path: str, rank: int, world: int, port: int, devices: str, timeout: float
) -> dict[str, str]:
    """A worker's environment: torchrun's variables, its GPUs, the timeout, NVLink multicast off
    (the machines' rule), unbuffered output (os.abort() flushes no Python buffer) and the NCCL path:
    c10d where asked, else flashoverlap's default (a FLASHOVERLAP_NCCL of the caller's is dropped)."""
    env = dict(base)
    env.pop("FLASHOVERLAP_NCCL", None)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        CUDA_VISIBLE_DEVICES=devices,
        FLASHOVERLAP_TIMEOUT_S=f"{timeout:g}",
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
        PYTHONUNBUFFERED="1",
    )
    if path == "c10d":
        env["FLASHOVERLAP_NCCL"] = "c10d"
    return env


def worker_command(path: str, case: str, timeout: float, case_dir: Path) -> list[str]:
    """The command of one worker of a case (rank and rendezvous come in its environment)."""
    return [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--path",
        path,
        "--case",
        case,
        "--timeout",
        f"{timeout:g}",
        "--case-dir",
        str(case_dir),
    ]


CommandFn = Callable[[str, str, float, Path], list[str]]


# --- the supervisor ------------------------------------------------------------------------------


def read_stamp(path: Path) -> float | None:
    """A wall-clock time a worker wrote (None: not there yet or unreadable)."""
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError):
        return None


def write_stamp(path: Path) -> None:
    """Write time.time() to ``path`` atomically (the supervisor polls for it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{time.time():.6f}\n")
    os.replace(tmp, path)


class CaseRun:
    """One (path, case) in flight: its workers, when each ended, and the fault's clock."""

    def __init__(
        self,
        world: int,
        path: str,
        case: str,
        case_dir: Path,
        slot: int,
        command: list[str],
        envs: list[dict[str, str]],
        timeout: float,
        grace: float,
        startup: float,
    ) -> None:
        self.world, self.path, self.case, self.dir, self.slot = world, path, case, case_dir, slot
        self.timeout, self.grace, self.startup = timeout, grace, startup
        self.started = time.time()
        self.exits: dict[int, float] = {}
        self.hung: set[int] = set()
        self.procs: list[subprocess.Popen] = []
        case_dir.mkdir(parents=True, exist_ok=True)
        try:
            for rank, env in enumerate(envs):
                with open(case_dir / f"rank{rank}.out", "wb") as out, open(case_dir / f"rank{rank}.err", "wb") as err:
                    # a session of its own: a straggler and whatever it started are killed together
                    proc = subprocess.Popen(
                        command, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True
                    )
                self.procs.append(proc)
        except BaseException:  # (a worker that cannot start: none of the others left running)
            self.kill_rest(time.time())
            raise

    def fault_time(self) -> float | None:
        """When the clock for a hang starts: the injected fault, or the first exit where that came
        first (a rank that crashed before the fault is a fault too; a kill of ours is no exit)."""
        first_exit = min((t for rank, t in self.exits.items() if rank not in self.hung), default=None)
        times = [t for t in (read_stamp(self.dir / "fault"), first_exit) if t is not None]
        return min(times, default=None)

    def deadline(self) -> float:
        """Wall-clock time after which the live workers are killed as hung."""
        fault = self.fault_time()
        return self.started + self.startup if fault is None else fault + self.timeout + self.grace

    def poll(self, now: float | None = None) -> bool:
        """Note the workers that ended; past the deadline kill the rest. True once all have ended."""
        for rank, proc in enumerate(self.procs):
            if rank not in self.exits and proc.poll() is not None:
                self.exits[rank] = time.time() if now is None else now
        if len(self.exits) == len(self.procs):
            return True
        now = time.time() if now is None else now
        if now > self.deadline():
            self.kill_rest(now)
            return True
        return False

    def kill_rest(self, now: float) -> None:
        """SIGKILL the process group of every worker still running (not yet reaped, so its pid is
        still its own) and reap it; those ranks hung."""
        for rank, proc in enumerate(self.procs):
            if rank in self.exits:
                continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:  # (stuck in the driver: left to the OS, still a hang)
                print(f"warning: pid {proc.pid} still there 60 s after SIGKILL", file=sys.stderr, flush=True)
            self.hung.add(rank)
            self.exits[rank] = now

    def results(self) -> list[Result]:
        """Every rank's row (after :meth:`poll` returned True)."""
        stamped = read_stamp(self.dir / "fault")
        fault = self.fault_time()
        rows = []
        for rank, proc in enumerate(self.procs):
            faulty = rank == self.world - 1
            lines = tail(self.dir / f"rank{rank}.err")
            end = self.exits.get(rank)
            outcome = classify(
                proc.returncode, "\n".join(lines), hung=rank in self.hung, injected_kill=faulty and self.case == "kill"
            )
            logs = (self.dir / f"rank{rank}.out", self.dir / f"rank{rank}.err")
            if outcome == "hang" and faulty and past_its_calls(*logs):
                outcome = "exit hang"
            last = last_line(lines)
            if rank in self.hung and stamped is None:  # (not ready: stuck in init, compilation or warm-up)
                ready = "ready" if (self.dir / f"ready.{rank}").exists() else "not ready"
                last = f"(killed before the fault, {ready}) {last}"[:LAST_LINE_CHARS]
            rows.append(
                Result(
                    world=self.world,
                    path=self.path,
                    case=self.case,
                    rank=rank,
                    role="faulty" if faulty else "survivor",
                    returncode=None if rank in self.hung else proc.returncode,
                    seconds=None if fault is None or end is None else end - fault,
                    outcome=outcome,
                    last_line=last,
                    lines=lines,
                    fault_reached=stamped is not None,
                )
            )
        return rows


def run_cases(
    matrix: Sequence[tuple[str, str, bool]],
    *,
    world: int,
    timeout: float,
    parallel: int,
    gpus: Sequence[int],
    log_dir: Path,
    grace: float = 90.0,
    startup: float = 900.0,
    command: CommandFn = worker_command,
    base_env: dict[str, str] | None = None,
    poll_s: float = 0.2,
    progress: bool = True,
) -> list[Result]:
    """Run every applicable case of ``matrix``, ``parallel`` at a time, and return one result per
    rank (one n/a row per case not applicable), in the matrix's order. ``command`` makes a worker's
    command line (tests pass fake workers)."""
    base = dict(os.environ if base_env is None else base_env)
    parent_devices = base.get("CUDA_VISIBLE_DEVICES")
    pool = SlotPool(gpus, world)
    ports: set[int] = set()
    pending = [(i, path, case) for i, (path, case, ok) in enumerate(matrix) if ok]
    done: dict[int, list[Result]] = {
        i: [Result(world, path, case, None, "", None, None, "n/a", "no NCCL in this path's call")]
        for i, (path, case, ok) in enumerate(matrix)
        if not ok
    }
    running: dict[int, CaseRun] = {}
    try:
        while pending or running:
            while pending and len(running) < max(1, parallel):
                index, path, case = pending.pop(0)
                slot = pool.acquire()
                devices = visible_devices(pool.slots[slot], parent_devices)
                port = free_port(ports)
                case_dir = log_dir / f"w{world}-{path}-{case}"
                envs = [worker_env(base, path, r, world, port, devices, timeout) for r in range(world)]
                running[index] = CaseRun(
                    world,
                    path,
                    case,
                    case_dir,
                    slot,
                    command(path, case, timeout, case_dir),
                    envs,
                    timeout,
                    grace,
                    startup,
                )
                if progress:
                    print(f"start {path} {case} on GPUs {devices} (port {port}, logs {case_dir})", flush=True)
            for index, run in list(running.items()):
                if run.poll():
                    del running[index]
                    pool.release(run.slot)
                    done[index] = run.results()
                    if progress:
                        print(summary(done[index], timeout), flush=True)
            time.sleep(poll_s)
    finally:  # (interrupted: leave no worker behind)
        for run in running.values():
            run.kill_rest(time.time())
    return [r for i in sorted(done) for r in done[i]]


# --- reporting -----------------------------------------------------------------------------------


def summary(rows: Sequence[Result], timeout: float) -> str:
    """One case in a line: the slowest survivor's time to error and every rank's outcome."""
    first = rows[0]
    head = f"world {first.world} {first.path} {first.case}:"
    if first.outcome == "n/a":
        return f"{head} n/a ({first.last_line})"
    if not first.fault_reached:
        head += " FAULT NOT REACHED;"
    survivors = [r for r in rows if r.role == "survivor"]
    timed = [r for r in survivors if r.seconds is not None]
    if timed:
        slow = max(timed, key=lambda r: r.seconds)
        verdict = "" if slow.seconds <= timeout + SLOW_MARGIN_S and slow.outcome != "hang" else " SLOW"
        head += f" slowest survivor {slow.seconds:.1f} s (rank {slow.rank} {slow.outcome}){verdict};"
    outcomes = ", ".join(f"rank {r.rank} {r.outcome}" for r in rows)
    finished = [r.rank for r in survivors if r.outcome == "finished"]
    note = f" (survivors {finished} finished: a fault went unnoticed)" if finished and first.case != "skip" else ""
    return f"{head} {outcomes}{note}"


def failures(results: Sequence[Result], timeout: float) -> list[str]:
    """Why the run fails (empty: it passes): a rank hung (not an ``exit hang``), a case never
    reached its fault (so it tested nothing), or a survivor took longer than ``timeout +
    SLOW_MARGIN_S`` to end."""
    why = []
    for r in results:
        if r.outcome == "n/a":
            continue
        name = f"world {r.world} {r.path} {r.case} rank {r.rank}"
        if r.outcome == "hang":
            why.append(f"{name}: hung")
        elif not r.fault_reached:
            why.append(f"{name}: the case never reached its fault ({r.outcome}: {r.last_line})")
        elif r.role == "survivor" and r.seconds is not None and r.seconds > timeout + SLOW_MARGIN_S:
            why.append(f"{name}: {r.seconds:.1f} s from the fault to exit (> {timeout + SLOW_MARGIN_S:g})")
    return why


def table(results: Sequence[Result]) -> str:
    """The rows as an aligned text table."""
    rows = [{k: str(v) for k, v in r.row().items()} for r in results]
    widths = {k: max([len(k), *(len(row[k]) for row in rows)]) for k in FIELDS}
    lines = ["  ".join(k.ljust(widths[k]) for k in FIELDS).rstrip()]
    lines += ["  ".join(row[k].ljust(widths[k]) for k in FIELDS).rstrip() for row in rows]
    return "\n".join(lines)


# --- the worker ----------------------------------------------------------------------------------


def abort_communicators() -> None:
    """The injected NCCL error: abort flashoverlap's private communicators, then every c10d group
    (the default one with them). A failure of an abort is printed, not raised: the fault is what
    follows, the next call on an aborted communicator."""
    import torch.distributed as dist

    from flashoverlap import state

    count = 0
    for group_state in list(state._states.values()):
        for communicator in list(group_state.communicators.values()):
            try:
                communicator.abort()
                count += 1
            except Exception as e:  # (reported; the default group's abort follows)
                print(f"injected: abort of a private communicator failed: {e!r}", file=sys.stderr, flush=True)
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception as e:
        print(f"injected: abort of the default group failed: {e!r}", file=sys.stderr, flush=True)
    print(f"injected: aborted {count} private communicators and the default group", file=sys.stderr, flush=True)


def worker(path: str, case: str, timeout: float, case_dir: Path) -> int:
    """One rank of a case (see the module doc). Returns 0 where it got through the stream."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import flashoverlap
    from flashoverlap import comm

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    # torch's own watchdog times its collectives out after the same time as flashoverlap's
    dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=timeout))
    name, config = call_config(path, world)
    call = getattr(flashoverlap, name)
    try:
        how = f"FLASHOVERLAP_NCCL={comm.nccl_path()} C API={comm.uses_direct()}"
    except Exception as e:  # (informative only)
        how = f"NCCL path unknown ({e!r})"
    print(f"[rank {rank}] {path} {case}: {name} {config}; {how}", flush=True)

    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    a = torch.randn(SIZE, SIZE, device=device, generator=gen).to(torch.bfloat16)
    w = (torch.randn(SIZE, SIZE, device=device, generator=gen) / SIZE**0.5).to(torch.bfloat16)
    out = None
    for _ in range(WARMUP):
        out = call(a, w, config=config)
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    (case_dir / f"ready.{rank}").write_text("ready\n")

    faulty = rank == world - 1
    fault = case_dir / "fault"
    for i in range(CALLS):
        if faulty and i == FAULT_CALL and case == "skip":
            write_stamp(fault)
            continue
        out = call(a, w, config=config)  # (only the last output is kept)
        if faulty and i == FAULT_CALL:
            if case == "kill":
                write_stamp(fault)
                os.kill(os.getpid(), signal.SIGKILL)
            elif case == "raise":
                write_stamp(fault)
                raise RuntimeError("injected fault")
            elif case == "nccl_error":
                write_stamp(fault)
                abort_communicators()
    torch.cuda.synchronize()
    print(f"[rank {rank}] finished ({tuple(out.shape)})", flush=True)
    if faulty and case == "skip":  # the one rank expected to get through: it ends cleanly
        dist.destroy_process_group()
        return 0
    # a survivor here missed the fault; leave without the exit handlers (which could wait on a
    # peer that is gone and turn a wrong "finished" into a hang)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- the command line ----------------------------------------------------------------------------


def parse_gpus(text: str) -> list[int]:
    """``--gpus 0,1,2,3`` -> [0, 1, 2, 3]."""
    try:
        gpus = [int(g) for g in text.split(",") if g.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus: comma-separated GPU numbers, got {text!r}") from None
    if not gpus or min(gpus) < 0:
        raise argparse.ArgumentTypeError(f"--gpus: comma-separated GPU numbers, got {text!r}")
    return gpus


def default_gpus(world: int) -> list[int]:
    """Every GPU this process sees (CUDA_VISIBLE_DEVICES, else nvidia-smi), else 0..world-1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        return list(range(len([d for d in visible.split(",") if d.strip()])))
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        count = sum(1 for line in listed.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        count = 0
    return list(range(count)) if count >= world else list(range(world))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="ranks per case")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--timeout", type=float, default=5.0, help="FLASHOVERLAP_TIMEOUT_S and the group's timeout")
    parser.add_argument("--parallel", type=int, default=1, help="cases run at once")
    parser.add_argument("--gpus", type=parse_gpus, default=None, help="GPUs to spread cases over (default: all)")
    parser.add_argument("--csv", type=Path, default=None, help="write the result rows here")
    parser.add_argument("--log-dir", type=Path, default=None, help="workers' logs (default: a new temp dir)")
    parser.add_argument("--grace", type=float, default=90.0, help="seconds past the timeout before a hang is called")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds allowed before the fault")
    # worker mode (started by the supervisor)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--case-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker and (args.path is None or args.case is None or args.case_dir is None):
        parser.error("--worker needs --path, --case and --case-dir")
    if args.world < 2:
        parser.error("--world: at least 2 ranks (one faulty, one to notice)")
    if args.timeout <= 0 or args.grace < 0 or args.startup_timeout <= 0 or args.parallel < 1:
        parser.error("--timeout and --startup-timeout must be positive, --grace >= 0, --parallel >= 1")
    if not args.worker and args.gpus is not None and len(args.gpus) < args.world:
        parser.error(f"--gpus: world {args.world} needs at least {args.world} GPUs, got {args.gpus}")
    return args


def main(argv: Sequence[str] | None = None, command: CommandFn = worker_command) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args.path, args.case, args.timeout, args.case_dir)
    gpus = args.gpus if args.gpus is not None else default_gpus(args.world)
    log_dir = args.log_dir if args.log_dir is not None else Path(tempfile.mkdtemp(prefix="fault_injection_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    matrix = case_matrix(args.paths, args.cases)
    print(
        f"fault injection: world {args.world}, {sum(ok for *_, ok in matrix)} cases ({len(matrix)} in the matrix), "
        f"timeout {args.timeout:g} s, {args.parallel} at once on GPUs {gpus}; logs in {log_dir}",
        flush=True,
    )
    start = time.monotonic()
    results = run_cases(
        matrix,
        world=args.world,
        timeout=args.timeout,
        parallel=args.parallel,
        gpus=gpus,
        log_dir=log_dir,
        grace=args.grace,
        startup=args.startup_timeout,
        command=command,
    )
    print()
    print(table(results))
    print()
    for path, case, _ in matrix:
        print(summary([r for r in results if (r.path, r.case) == (path, case)], args.timeout))
    if args.csv is not None:
        report.write_csv(str(args.csv), [r.row() for r in results])
        print(f"wrote {args.csv}")
    why = failures(results, args.timeout)
    print(f"{len(matrix)} cases in {time.monotonic() - start:.0f} s; logs in {log_dir}")
    for line in why:
        print(f"FAIL {line}")
    print("FAIL" if why else "PASS", flush=True)
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
