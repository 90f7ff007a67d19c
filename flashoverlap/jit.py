"""Compile CUDA sources with nvcc into shared libraries, cached on disk.

The cache key covers the source, every header it can include from this package, the CUTLASS
version, the flags and the nvcc version, so a changed template or toolkit recompiles and an
unchanged one loads in milliseconds. Ranks of one job compiling the same library take turns
through a file lock; the result is renamed into place atomically.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent

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


def nvcc_path() -> str:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if not found:
        raise RuntimeError(
            "flashoverlap needs nvcc (CUDA 12.3+) to build its kernels; set CUDA_HOME or put nvcc on PATH"
        )
    return found


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


def _log(message: str) -> None:
    print(f"[flashoverlap] {message}", file=sys.stderr, flush=True)


def build(
    name: str,
    source: str,
    *,
    arch: str = "sm_90a",
    cutlass: bool = False,
    output: Path | None = None,
    object_only: bool = False,
) -> Path:
    """Compile ``source`` into ``<cache>/<name>-<key>.so`` (or ``output``) and return its path.

    ``object_only`` compiles to an object file without linking: CI uses it to prove that every
    generated source builds for the target on a machine without a GPU.
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
            cmd = [nvcc_path(), *flags, str(src), "-o", str(tmp_out)]
            _log(f"compiling {name} for {arch} with {Path(cmd[0]).name} (first use; CUTLASS kernels take ~1-2 min)")
            start = time.monotonic()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"nvcc failed building {name} ({arch}):\n{' '.join(cmd)}\n{proc.stderr[-6000:]}")
            _log(f"built {name} in {time.monotonic() - start:.1f} s -> {target}")
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
    # out, a, b, n (elements), dtype, stream
    lib.fo_add.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
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
