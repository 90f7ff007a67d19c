"""Compile CUDA sources with nvcc into shared libraries, cached on disk.

The cache key covers the source, every header it can include from this package, the CUTLASS
version, the flags and the nvcc version, so a changed template or toolkit recompiles and an
unchanged one loads in milliseconds. Ranks of one job compiling the same library take turns
through a file lock; the result is renamed into place atomically.

The compiler (:func:`toolkit`): ``CUDA_HOME`` / ``CUDA_PATH`` where set, else CUDA's pip wheels
(``pip install "flashoverlap[cu13]"``: ``nvidia/cu13`` in site-packages or any ``sys.path``
directory), else ``nvcc`` on the PATH or in ``/usr/local/cuda``; the compile message names it.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
log = logging.getLogger(__name__)

# sm_90a needs the -gencode spelling: the -arch shorthand also runs a plain sm_90 pass that
# rejects wgmma/setmaxnreg.
ARCH_FLAGS = {
    "sm_90a": ["-gencode=arch=compute_90a,code=sm_90a"],
    "sm_90": ["-gencode=arch=compute_90,code=sm_90"],
    "sm_89": ["-gencode=arch=compute_89,code=sm_89"],
    "sm_86": ["-gencode=arch=compute_86,code=sm_86"],
    "sm_80": ["-gencode=arch=compute_80,code=sm_80"],
    # the small runtime kernels, for every GPU the kernel families run on (PTX for newer ones)
    "sm_80-sm_90": [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_86,code=sm_86",
        "-gencode=arch=compute_89,code=sm_89",
        "-gencode=arch=compute_90,code=[sm_90,compute_90]",
    ],
}
RUNTIME_ARCH = "sm_80-sm_90"

BASE_FLAGS = [
    "-std=c++17",
    "-O3",
    "-DNDEBUG",
    "--expt-relaxed-constexpr",
    "-Xcompiler=-fPIC",
    "-Xcompiler=-Wno-psabi",
]


def cache_dir() -> Path:
    root = os.environ.get("FLASHOVERLAP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "flashoverlap"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class Toolkit:
    """The nvcc the kernels build with, where it was found (for messages), and what it needs
    besides its own configuration to find the pieces of a pip toolkit."""

    nvcc: str
    source: str
    flags: tuple[str, ...] = ()

    def command(self) -> list[str]:
        return [self.nvcc, *self.flags]


# nvidia/<name>/ of the CUDA toolkit wheels (cuda-toolkit[nvcc,cccl]), newest first: NVIDIA ships
# no nvcc wheel for CUDA 12 (nvidia-cuda-nvcc-cu12 holds ptxas alone)
PIP_TOOLKITS = ("cu13",)
# what the kernels need of a pip toolkit, each file relative to nvidia/<name>/, and the wheel that has it
PIP_PIECES = {
    "nvcc": ("bin/nvcc", "nvidia-cuda-nvcc"),
    "cicc": ("nvvm/bin/cicc", "nvidia-nvvm"),
    "runtime headers": ("include/cuda_runtime.h", "nvidia-cuda-runtime"),
    "static runtime": ("lib/libcudart_static.a", "nvidia-cuda-runtime"),
    "crt headers": ("include/crt/host_config.h", "nvidia-cuda-crt"),
    "CCCL headers": ("include/cccl/cuda/std/version", "nvidia-cuda-cccl"),
}
SYSTEM_NVCC = "/usr/local/cuda/bin/nvcc"


def pip_toolkit(paths: Iterable[str]) -> Toolkit | None:
    """The CUDA toolkit of pip's wheels under one of ``paths`` (``sys.path``: site-packages, a
    ``--target`` directory on ``PYTHONPATH``), or None where no directory holds their nvcc.

    Each wheel may sit in another of those directories (a ``--target`` install beside the
    environment's own wheels), while nvcc's configuration looks beside itself only (and for
    libraries in lib64, where the wheels have lib): the include and library directories are
    given to it. nvcc calls cicc from its own tree: the two must sit together."""
    for name in PIP_TOOLKITS:
        roots = [Path(p) / "nvidia" / name for p in paths if p]
        found = {piece: next((r for r in roots if (r / rel).is_file()), None) for piece, (rel, _) in PIP_PIECES.items()}
        home = found["nvcc"]
        if home is None:
            continue
        if found["cicc"] != home:
            found["cicc"] = None
        missing = [piece for piece, root in found.items() if root is None]
        if missing:
            wheels = sorted({PIP_PIECES[piece][1] for piece in missing})
            raise RuntimeError(
                f"CUDA's pip nvcc at {home} lacks its {', '.join(missing)} ({', '.join(wheels)}"
                f"{' beside it' * (found['cicc'] is None)}): pip install 'cuda-toolkit[nvcc,cccl]' of its version, "
                "or uninstall nvidia-cuda-nvcc to use a system CUDA toolkit"
            )
        includes = dict.fromkeys(found[p] / "include" for p in ("runtime headers", "crt headers"))
        flags = [f"-I{d}" for d in includes]
        flags += ["-isystem", str(found["CCCL headers"] / "include" / "cccl"), f"-L{found['static runtime'] / 'lib'}"]
        return Toolkit(str(home / "bin" / "nvcc"), f"pip's CUDA toolkit ({home})", tuple(flags))
    return None


@functools.cache
def toolkit() -> Toolkit:
    """The nvcc to build with: see the module's docstring."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return Toolkit(str(Path(home) / "bin" / "nvcc"), f"{var}={home}")
    found = pip_toolkit(sys.path)
    if found is not None:
        return found
    on_path = shutil.which("nvcc")
    if on_path:
        return Toolkit(on_path, f"the PATH ({on_path})")
    if Path(SYSTEM_NVCC).is_file():
        return Toolkit(SYSTEM_NVCC, SYSTEM_NVCC)
    raise RuntimeError(
        "flashoverlap builds its kernels with nvcc, and found none: pip install 'flashoverlap[cu13]' "
        "(CUDA 13 from pip), or install a CUDA toolkit 12.3+ and set CUDA_HOME or put nvcc on the PATH"
    )


def nvcc_path() -> str:
    return toolkit().nvcc


@functools.cache
def nvcc_version() -> str:
    out = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


@functools.cache
def cutlass_include_dirs() -> tuple[str, ...]:
    try:
        import cutlass_library
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("flashoverlap builds its GEMMs from CUTLASS headers: pip install nvidia-cutlass") from exc
    root = Path(cutlass_library.__file__).resolve().parent / "source"
    dirs = (root / "include", root / "tools" / "util" / "include")
    if not (dirs[0] / "cutlass" / "cutlass.h").exists():
        raise RuntimeError(f"CUTLASS headers not found under {root}; reinstall nvidia-cutlass")
    return tuple(str(d) for d in dirs)


@functools.cache
def _cutlass_version() -> str:
    from importlib.metadata import version

    return version("nvidia-cutlass")


def _own_headers_digest(source: str) -> str:
    """Digest of the headers of ours (csrc/) that ``source`` includes, directly or through them:
    a change to one rebuilds the kernels that use it, and only those."""
    csrc = _PACKAGE_DIR / "csrc"
    seen: dict[str, bytes] = {}
    pending = [source]
    while pending:
        for name in re.findall(r'#include\s+"([^"]+)"', pending.pop()):
            path = csrc / name
            if name not in seen and path.is_file():
                seen[name] = path.read_bytes()
                pending.append(seen[name].decode())
    digest = hashlib.sha256()
    for name in sorted(seen):
        digest.update(name.encode() + b"\0" + seen[name])
    return digest.hexdigest()


HEARTBEAT_S = 15.0  # between "still compiling" messages: a CUTLASS kernel takes 1-2 minutes


def _compile(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    """Run nvcc, saying every :data:`HEARTBEAT_S` seconds that it still runs (``what``: the kernel)."""
    start = time.monotonic()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            while True:
                try:
                    out, err = proc.communicate(timeout=HEARTBEAT_S)  # (retried: no output is lost)
                    break
                except subprocess.TimeoutExpired:
                    log.info("still compiling %s (%.0f s)", what, time.monotonic() - start)
        except BaseException:  # interrupted: no orphaned nvcc
            proc.kill()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def build(
    name: str,
    source: str,
    *,
    arch: str = "sm_90a",
    cutlass: bool = False,
    output: Path | None = None,
    object_only: bool = False,
    progress: tuple[int, int] | None = None,
) -> Path:
    """Compile ``source`` into ``<cache>/<name>-<key>.so`` (or ``output``) and return its path.

    ``object_only`` compiles to an object file without linking: CI uses it to prove that every
    generated source builds for the target on a machine without a GPU. ``progress``: this is
    kernel k of n being built (for the messages).
    """
    if arch not in ARCH_FLAGS:
        raise ValueError(f"unsupported arch {arch!r}; supported: {sorted(ARCH_FLAGS)}")
    includes = [str(_PACKAGE_DIR / "csrc")]
    if cutlass:
        includes += list(cutlass_include_dirs())
    flags = BASE_FLAGS + ARCH_FLAGS[arch] + [f"-I{d}" for d in includes]
    flags += ["-c"] if object_only else ["-shared", "-cudart=static"]

    key_material = "\n".join(
        [
            source,
            _own_headers_digest(source),
            " ".join(BASE_FLAGS + ARCH_FLAGS[arch]),
            str(object_only),
            nvcc_version(),
            _cutlass_version() if cutlass else "",
        ]
    )
    key = hashlib.sha256(key_material.encode()).hexdigest()[:20]
    suffix = ".o" if object_only else ".so"
    target = output or cache_dir() / f"{name}-{key}{suffix}"
    if output is None and target.exists():
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if output is None and target.exists():  # another rank built it while we waited
            return target
        with tempfile.TemporaryDirectory(prefix="flashoverlap-") as tmp:
            src = Path(tmp) / f"{name}.cu"
            src.write_text(source)
            # Same directory as the target, so the final rename is atomic.
            tmp_out = target.parent / f".{target.name}.{os.getpid()}.tmp"
            tools = toolkit()
            cmd = [*tools.command(), *flags, str(src), "-o", str(tmp_out)]
            what = name if progress is None else f"kernel {progress[0]} of {progress[1]}, {name}"
            log.info("compiling %s for %s with nvcc from %s (CUTLASS kernels take ~1-2 min)", what, arch, tools.source)
            start = time.monotonic()
            proc = _compile(cmd, what)
            if proc.returncode != 0:
                raise RuntimeError(f"nvcc failed building {name} ({arch}):\n{' '.join(cmd)}\n{proc.stderr[-6000:]}")
            log.info("built %s in %.1f s -> %s", what, time.monotonic() - start, target)
            os.replace(tmp_out, target)
    return target


def build_runtime(**kwargs) -> Path:
    """Build csrc/runtime.cu (restore, strided copy, counter reset, waits) for every supported GPU; ``kwargs``
    go to :func:`build`."""
    return build("fo_runtime", (_PACKAGE_DIR / "csrc" / "runtime.cu").read_text(), arch=RUNTIME_ARCH, **kwargs)


@functools.cache
def runtime_library() -> ctypes.CDLL:
    """csrc/runtime.cu: restore, strided copy, adds and sums, counter reset, stream waits and writes, replay."""
    lib = ctypes.CDLL(str(build_runtime()))
    lib.fo_runtime_error.restype = ctypes.c_char_p
    lib.fo_restore.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 7 + [ctypes.c_void_p]
    # dst, dpitch, src, spitch, width (bytes), height, stream
    lib.fo_copy_2d.argtypes = [ctypes.c_void_p, ctypes.c_size_t] * 2 + [ctypes.c_size_t] * 2 + [ctypes.c_void_p]
    # out, out2 (or null), in0..in7 (unused: null), count, n (elements), dtype, stream
    lib.fo_sum.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_int, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.fo_zero.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]  # ptr, bytes, stream
    lib.fo_stream_wait.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p]  # counter, target, stream
    lib.fo_write_value.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p]  # flag, value, stream
    lib.fo_record_event.argtypes = [ctypes.c_void_p] * 2  # event, stream
    lib.fo_wait_event.argtypes = [ctypes.c_void_p] * 2  # stream, event
    # ops, words, values, status (flashoverlap.enqueue)
    lib.fo_replay.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    # counter, target, timeout_ns, report, group, stream
    lib.fo_spin_wait.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint,
        ctypes.c_ulonglong,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    return lib


def check(lib: ctypes.CDLL, status: int, error_fn: str) -> None:
    """Raise with the library's message when a C entry point returned non-zero."""
    if status != 0:
        message = getattr(lib, error_fn)()
        raise RuntimeError(f"flashoverlap kernel error: {message.decode() if message else status}")
