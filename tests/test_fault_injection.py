"""The fault-injection harness (tests/fault_injection.py) on the CPU: the case matrix, outcomes from
sample stderr, the table and CSV, and the supervisor with fake workers (small Python processes that
write the ready / fault files and then finish, abort like the watchdog, or hang), so that its hang
detection and timing are known right before it runs on GPUs. The GPU run itself is marked multigpu."""

from __future__ import annotations

import csv
import signal
import sys
import time
from pathlib import Path

import pytest

from flashoverlap import report

from . import fault_injection as fi

# A fake worker: argv[1] the case dir, argv[2] one behaviour per rank (comma-separated). Every rank
# writes its ready file; the last one writes the fault stamp first unless its behaviour says "nofault".
FAKE = r"""
import os, signal, sys, time
case_dir, behaviour = sys.argv[1], sys.argv[2].split(",")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
do = behaviour[rank]
if do == "early":  # crashes before it is ready: no fault file anywhere
    print("RuntimeError: NCCL init failed", file=sys.stderr)
    sys.exit(3)
open(os.path.join(case_dir, f"ready.{rank}"), "w").close()
if rank == world - 1 and do != "nofault":
    tmp = os.path.join(case_dir, "fault.tmp")
    with open(tmp, "w") as f:
        f.write(f"{time.time():.6f}")
    os.replace(tmp, os.path.join(case_dir, "fault"))
if do == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if do == "watchdog":
    time.sleep(0.3)
    print("flashoverlap watchdog: call 100 not done after 0.3 s; aborting", file=sys.stderr, flush=True)
    os.abort()
if do == "raise":
    raise RuntimeError("injected fault")
if do in ("hang", "nofault"):
    time.sleep(1000)
if do == "exithang":  # its calls done, stuck in teardown
    print(f"[rank {rank}] finished ((8, 8))", flush=True)
    time.sleep(1000)
if do == "raisehang":  # raised (a long traceback), then stuck in teardown at exit
    print("Traceback (most recent call last):", file=sys.stderr)
    for i in range(200):
        print(f"  frame {i}", file=sys.stderr)
    print("RuntimeError: no process group", file=sys.stderr, flush=True)
    time.sleep(1000)
print("finished", flush=True)
"""


def fake(spec: dict[str, str] | str) -> fi.CommandFn:
    """A worker command of fake workers: ``spec`` the behaviours (per case, or one for all)."""

    def command(path: str, case: str, timeout: float, case_dir: Path) -> list[str]:
        behaviour = spec if isinstance(spec, str) else spec[case]
        return [sys.executable, "-c", FAKE, str(case_dir), behaviour]

    return command


def result(rank, role, outcome, seconds, case="kill", path="direct", fault_reached=True) -> fi.Result:
    return fi.Result(2, path, case, rank, role, -6, seconds, outcome, "last", fault_reached=fault_reached)


# --- the case matrix and the calls ----------------------------------------------------------------


def test_nccl_error_is_not_applicable_to_the_pulls_only():
    matrix = fi.case_matrix(fi.PATHS, fi.CASES)
    assert len(matrix) == len(fi.PATHS) * len(fi.CASES)
    na = [(p, c) for p, c, ok in matrix if not ok]
    assert na == [("pull", "nccl_error"), ("a2a_pull", "nccl_error")]
    assert matrix[0] == ("direct", "kill", True)  # paths outer, in the order given


def test_each_path_makes_its_call():
    assert fi.call_config("direct", 2) == ("gemm_all_reduce", {"comm_sms": 16})
    assert fi.call_config("c10d", 4) == ("gemm_all_reduce", {"comm_sms": 16})
    assert fi.call_config("symmetric", 2) == ("gemm_all_reduce", {"symmetric": True})
    assert fi.call_config("pull", 2) == ("gemm_all_reduce", {"reduction": "pull", "comm_sms": 4})
    assert fi.call_config("pull", 4) == ("gemm_all_reduce", {"reduction": "pull_scatter", "comm_sms": 4})
    name, config = fi.call_config("a2a_pull", 4)
    assert name == "gemm_all_to_all" and config == {"layout": "segments", "reduction": "pull", "comm_sms": 4}
    assert fi.SIZE % (4 * 256) == 0  # segments: even splits of whole 256-row bands on 4 ranks
    with pytest.raises(ValueError, match="unknown path"):
        fi.call_config("nope", 2)


def test_the_configs_are_valid():
    from flashoverlap.config import OverlapConfig

    for path in fi.PATHS:
        for world in (2, 4):
            OverlapConfig(**fi.call_config(path, world)[1])


# --- outcomes -------------------------------------------------------------------------------------

TORCH_TIMEOUT = (
    "[rank0]:[E ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=212, OpType=ALLREDUCE, NumelIn=1, Timeout(ms)=5000) ran for 5001 milliseconds before timing out.\n"
    "[rank0]:[E ProcessGroupNCCL.cpp:2168] [PG ID 0 PG GUID 0(default_pg) Rank 0] To avoid data inconsistency, "
    "we are taking the entire process down.\n"
)
DIST_BACKEND_ERROR = (
    "Traceback (most recent call last):\n"
    '  File "tests/fault_injection.py", line 400, in worker\n'
    "torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3690,"
    " remote process exited or there was a network error\n"
)
EXIT_WARNING = "[rank0]:[W ProcessGroupNCCL.cpp:1250] Warning: WARNING: destroy_process_group() was not called\n"


@pytest.mark.parametrize(
    "returncode, stderr, hung, injected, want",
    [
        (-6, "flashoverlap watchdog: group 3 of call 100 not written after 5 s\n", False, False, "watchdog"),
        (-6, TORCH_TIMEOUT + "flashoverlap watchdog: NCCL error on communicator 1\n", False, False, "watchdog"),
        (-6, TORCH_TIMEOUT, False, False, "torch"),
        (-6, DIST_BACKEND_ERROR + TORCH_TIMEOUT, False, False, "torch"),  # the watchdog's abort over a raise
        (1, DIST_BACKEND_ERROR, False, False, "raised"),  # names ProcessGroupNCCL, yet a traceback
        (1, "Traceback (most recent call last):\nRuntimeError: injected fault\n", False, False, "raised"),
        (-6, "[E ProcessGroupNCCL.cpp:100] NCCL error: unhandled system error\n", False, False, "torch"),
        (0, EXIT_WARNING + "[rank 0] finished\n", False, False, "finished"),
        (-9, "", False, True, "killed"),
        (-9, "", False, False, "other"),  # killed, but not by the injection
        (-11, "", False, False, "other"),
        (None, "flashoverlap watchdog: never exits\n", True, False, "hang"),
        (-9, "", True, True, "hang"),
    ],
)
def test_outcome_from_exit_and_stderr(returncode, stderr, hung, injected, want):
    assert fi.classify(returncode, stderr, hung=hung, injected_kill=injected) == want


def test_last_line_skips_blanks_and_keeps_the_end():
    assert fi.last_line(["a", "RuntimeError: x", "  ", ""]) == "RuntimeError: x"
    assert fi.last_line([]) == ""
    long = "x" * 50 + "the reason"
    short = fi.last_line([long], limit=20)
    assert len(short) == 20 and short.endswith("the reason") and short.startswith("...")


def test_tail_reads_the_last_lines(tmp_path):
    log = tmp_path / "err"
    log.write_bytes(b"".join(b"line %d\n" % i for i in range(100)) + b"bad \xff byte\n")
    assert fi.tail(log, 3) == ["line 98", "line 99", "bad \ufffd byte"]
    assert fi.tail(tmp_path / "absent") == []


# --- GPUs, ports, environment, command line -------------------------------------------------------


def test_concurrent_cases_spread_over_disjoint_gpu_sets():
    pool = fi.SlotPool([0, 1, 2, 3], 2)
    assert pool.slots == [[0, 1], [2, 3]]
    assert [pool.acquire() for _ in range(4)] == [0, 1, 0, 1]  # --parallel 4: two cases per pair
    pool.release(1)
    pool.release(1)
    assert pool.acquire() == 1
    assert fi.SlotPool([0, 1, 2, 3], 4).slots == [[0, 1, 2, 3]]
    assert fi.SlotPool([0, 1, 2], 2).slots == [[0, 1]]  # (an odd GPU out)
    with pytest.raises(ValueError):
        fi.SlotPool([0], 2)
    with pytest.raises(ValueError):
        fi.SlotPool([0, 0], 2)


def test_visible_devices_follow_the_supervisors_own():
    assert fi.visible_devices([2, 3], None) == "2,3"
    assert fi.visible_devices([0, 1], "4,5,6,7") == "4,5"
    assert fi.visible_devices([1, 0], " 6, 7 ") == "7,6"
    with pytest.raises(ValueError):
        fi.visible_devices([2], "0,1")


def test_free_ports_are_not_handed_out_twice():
    taken: set[int] = set()
    ports = [fi.free_port(taken) for _ in range(5)]
    assert len(set(ports)) == 5 and taken == set(ports)


def test_worker_environment():
    base = {"PATH": "/bin", "FLASHOVERLAP_NCCL": "c10d", "NCCL_NVLS_ENABLE": "1"}
    env = fi.worker_env(base, "direct", 1, 2, 29555, "2,3", 5.0)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "29555"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["FLASHOVERLAP_TIMEOUT_S"] == "5"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["PYTHONUNBUFFERED"] == "1" and env["PATH"] == "/bin"
    assert "FLASHOVERLAP_NCCL" not in env  # the default path, whatever the caller had
    assert fi.worker_env({}, "c10d", 0, 2, 1, "0,1", 2.5)["FLASHOVERLAP_NCCL"] == "c10d"
    assert fi.worker_env({}, "c10d", 0, 2, 1, "0,1", 2.5)["FLASHOVERLAP_TIMEOUT_S"] == "2.5"
    assert base["FLASHOVERLAP_NCCL"] == "c10d"  # (not changed)


def test_worker_command_parses_back(tmp_path):
    command = fi.worker_command("a2a_pull", "nccl_error", 5.0, tmp_path)
    assert command[0] == sys.executable and command[1].endswith("fault_injection.py")
    args = fi.parse_args(command[2:])
    assert args.worker and args.path == "a2a_pull" and args.case == "nccl_error"
    assert args.timeout == 5.0 and args.case_dir == tmp_path


def test_command_line():
    args = fi.parse_args(["--world", "2", "--paths", "direct", "pull", "--cases", "kill", "--gpus", "0,1,2,3"])
    assert args.paths == ["direct", "pull"] and args.cases == ["kill"] and args.gpus == [0, 1, 2, 3]
    assert args.parallel == 1 and args.timeout == 5.0 and args.grace == 90.0
    defaults = fi.parse_args([])
    assert defaults.paths == list(fi.PATHS) and defaults.cases == list(fi.CASES)
    for bad in (
        ["--world", "1"],
        ["--world", "4", "--gpus", "0,1"],
        ["--gpus", "a"],
        ["--paths", "nope"],
        ["--worker"],
    ):
        with pytest.raises(SystemExit):
            fi.parse_args(bad)


# --- table, CSV, verdict --------------------------------------------------------------------------


def test_table_and_csv(tmp_path):
    rows = [
        result(0, "survivor", "watchdog", 5.43),
        result(1, "faulty", "killed", 0.01),
        fi.Result(2, "pull", "nccl_error", None, "", None, None, "n/a", "no NCCL in this path's call"),
    ]
    text = fi.table(rows).splitlines()
    assert text[0].split() == list(fi.FIELDS)
    assert "watchdog" in text[1] and "5.4" in text[1] and "n/a" in text[3]
    report.write_csv(str(tmp_path / "out.csv"), [r.row() for r in rows])  # (as main writes --csv)
    with open(tmp_path / "out.csv") as f:
        read = list(csv.DictReader(f))
    assert [r["outcome"] for r in read] == ["watchdog", "killed", "n/a"]
    assert read[0]["seconds"] == "5.4" and read[0]["rank"] == "0" and read[2]["rank"] == ""


def test_verdict():
    good = [result(0, "survivor", "watchdog", 6.0), result(1, "faulty", "killed", 0.0)]
    assert fi.failures(good, 5.0) == []
    assert "slowest survivor 6.0 s (rank 0 watchdog)" in fi.summary(good, 5.0)
    assert fi.failures([fi.Result(2, "pull", "nccl_error", None, "", None, None, "n/a", "")], 5.0) == []
    slow = [result(0, "survivor", "torch", 65.5), result(1, "faulty", "raised", 0.1)]
    assert "65.5 s" in fi.failures(slow, 5.0)[0] and "SLOW" in fi.summary(slow, 5.0)
    assert fi.failures([result(1, "faulty", "hang", 95.0)], 5.0)[0].endswith("hung")
    assert "never reached" in fi.failures([result(0, "survivor", "other", None, fault_reached=False)], 5.0)[0]
    finished = [result(0, "survivor", "finished", 0.5), result(1, "faulty", "killed", 0.0)]
    assert fi.failures(finished, 5.0) == [] and "unnoticed" in fi.summary(finished, 5.0)
    skipped = [result(0, "survivor", "finished", 0.5, case="skip"), result(1, "faulty", "finished", 0.5, case="skip")]
    assert "unnoticed" not in fi.summary(skipped, 5.0)


# --- the supervisor, with fake workers --------------------------------------------------------------


def run_fake(tmp_path, spec, cases=("kill",), paths=("direct",), world=2, timeout=0.3, grace=0.7, **kw):
    return fi.run_cases(
        fi.case_matrix(paths, cases),
        world=world,
        timeout=timeout,
        parallel=kw.pop("parallel", 2),
        gpus=kw.pop("gpus", list(range(world))),
        log_dir=tmp_path,
        grace=grace,
        startup=kw.pop("startup", 20.0),
        command=fake(spec),
        base_env={},
        poll_s=0.02,
        progress=False,
    )


def test_supervisor_times_survivors_from_the_fault(tmp_path):
    rows = run_fake(tmp_path, "watchdog,watchdog,kill", world=3, gpus=[0, 1, 2])
    assert [(r.rank, r.role, r.outcome) for r in rows] == [
        (0, "survivor", "watchdog"),
        (1, "survivor", "watchdog"),
        (2, "faulty", "killed"),
    ]
    assert [r.returncode for r in rows] == [-signal.SIGABRT, -signal.SIGABRT, -signal.SIGKILL]
    assert all(0.25 < r.seconds < 5 for r in rows[:2]) and 0 <= rows[2].seconds < 2
    assert rows[0].last_line.startswith("flashoverlap watchdog:") and all(r.fault_reached for r in rows)
    assert fi.failures(rows, 0.3) == []
    assert (tmp_path / "w3-direct-kill" / "ready.0").exists()  # the logs and files stay for reading


def test_supervisor_kills_a_hang_after_timeout_and_grace(tmp_path):
    start = time.monotonic()
    rows = run_fake(tmp_path, "hang,raise", cases=("raise",))
    took = time.monotonic() - start
    assert [r.outcome for r in rows] == ["hang", "raised"]
    assert rows[0].returncode is None and 0.9 <= rows[0].seconds < 3  # killed at timeout + grace = 1 s
    assert rows[1].returncode == 1 and rows[1].last_line == "RuntimeError: injected fault"
    assert took < 10
    assert fi.failures(rows, 0.3) == ["world 2 direct raise rank 0: hung"]


def test_a_faulty_rank_stuck_after_its_calls_is_an_exit_hang_not_a_failure(tmp_path):
    """The faulty rank hanging in torch's teardown after its calls (a skipped call leaves its peers'
    collectives unjoined) is reported apart; one hanging inside its calls fails the run."""
    rows = run_fake(tmp_path, "watchdog,exithang", cases=("skip",))
    assert [r.outcome for r in rows] == ["watchdog", "exit hang"] and rows[1].returncode is None
    assert fi.failures(rows, 0.3) == []
    rows = run_fake(tmp_path / "raised", "watchdog,raisehang", cases=("nccl_error",))
    assert [r.outcome for r in rows] == ["watchdog", "exit hang"] and fi.failures(rows, 0.3) == []
    rows = run_fake(tmp_path / "inside", "watchdog,hang", cases=("skip",))
    assert [r.outcome for r in rows] == ["watchdog", "hang"]
    assert fi.failures(rows, 0.3) == ["world 2 direct skip rank 1: hung"]


def test_a_crash_before_the_fault_starts_the_clock(tmp_path):
    rows = run_fake(tmp_path, "hang,early", cases=("skip",))
    assert [r.outcome for r in rows] == ["hang", "other"]
    assert not rows[0].fault_reached and rows[1].returncode == 3
    assert 0.9 <= rows[0].seconds < 3  # from rank 1's exit
    why = fi.failures(rows, 0.3)
    assert why[0].endswith("hung") and "never reached its fault" in why[1]


def test_a_fault_never_reached_hangs_at_the_startup_limit(tmp_path):
    rows = run_fake(tmp_path, "hang,nofault", startup=1.0)
    assert [r.outcome for r in rows] == ["hang", "hang"] and all(r.seconds is None for r in rows)
    assert rows[1].last_line.startswith("(killed before the fault, ready)")


def test_main_runs_the_matrix_in_parallel(tmp_path, monkeypatch, capsys):
    """The command line end to end: 4 cases at once over two GPU pairs, n/a rows for the pulls'
    nccl_error, the CSV, the summaries and the exit status (1: the skip case hangs)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec = {"kill": "watchdog,kill", "raise": "watchdog,raise", "skip": "hang,finish", "nccl_error": "watchdog,raise"}
    argv = ["--world", "2", "--paths", "direct", "pull", "--timeout", "0.3", "--grace", "0.5", "--parallel", "4"]
    argv += ["--gpus", "0,1,2,3", "--csv", str(tmp_path / "out.csv"), "--log-dir", str(tmp_path / "logs")]
    start = time.monotonic()
    assert fi.main(argv, command=fake(spec)) == 1
    assert time.monotonic() - start < 15
    out = capsys.readouterr().out
    assert "on GPUs 0,1" in out and "on GPUs 2,3" in out
    assert "world 2 pull nccl_error: n/a" in out and "FAIL world 2 direct skip rank 0: hung" in out
    with open(tmp_path / "out.csv") as f:
        read = list(csv.DictReader(f))
    assert len(read) == 2 * 3 * 2 + 2 + 1  # direct: 4 cases x 2 ranks; pull: 3 x 2 and one n/a
    got = {(r["path"], r["case"], r["rank"]): r["outcome"] for r in read}
    assert got[("direct", "kill", "0")] == "watchdog" and got[("direct", "kill", "1")] == "killed"
    assert got[("pull", "skip", "0")] == "hang" and got[("pull", "skip", "1")] == "finished"
    assert got[("pull", "nccl_error", "")] == "n/a"
    assert [(r["path"], r["case"]) for r in read][::2][:4] == [
        (p, c) for p, c, _ in fi.case_matrix(["direct"], fi.CASES)
    ]


# --- on GPUs --------------------------------------------------------------------------------------


@pytest.mark.multigpu
def test_no_overlapped_call_hangs_when_a_rank_is_killed(tmp_path):
    """Two GPUs, the NCCL and the pull path: the peer of a killed rank is ended by flashoverlap's
    watchdog within the timeout (+ 30 s for the abort and the exit), never hangs. Needs
    flashoverlap.watchdog."""
    timeout = 5.0
    argv = ["--world", "2", "--paths", "direct", "pull", "--cases", "kill", "--timeout", f"{timeout:g}"]
    argv += ["--gpus", "0,1", "--csv", str(tmp_path / "out.csv"), "--log-dir", str(tmp_path / "logs")]
    fi.main(argv)
    with open(tmp_path / "out.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    assert not [r for r in rows if r["outcome"] == "hang"], rows
    for r in rows:
        if r["role"] == "survivor":
            assert r["outcome"] == "watchdog", r
            assert r["seconds"] and float(r["seconds"]) <= timeout + 30, r
        else:
            assert r["outcome"] == "killed", r
