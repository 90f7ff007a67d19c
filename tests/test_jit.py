"""Finding the CUDA compiler (CUDA_HOME, pip's wheels, the PATH) and the compile's messages (CPU)."""

import logging
import stat
import sys

import pytest

from flashoverlap import jit


def fake_wheels(site, pieces=tuple(jit.PIP_PIECES)):
    """The files of pip's CUDA 13 wheels (cuda-toolkit[nvcc,cccl]) that ``pieces`` name, under
    ``site``/nvidia/cu13 as pip lays them out; returns that directory."""
    home = site / "nvidia" / "cu13"
    for piece in pieces:
        path = home / jit.PIP_PIECES[piece][0]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return home


@pytest.fixture
def fresh_toolkit():
    jit.toolkit.cache_clear()
    yield
    jit.toolkit.cache_clear()


def test_the_wheels_of_one_site_directory_make_a_toolkit(tmp_path):
    home = fake_wheels(tmp_path)
    found = jit.pip_toolkit(["", str(tmp_path / "elsewhere"), str(tmp_path)])
    assert found.nvcc == str(home / "bin" / "nvcc") and str(home) in found.source
    # nvcc's own configuration looks for libraries in lib64: the wheels' lib is given, and the headers
    assert found.flags == (f"-I{home / 'include'}", "-isystem", str(home / "include" / "cccl"), f"-L{home / 'lib'}")
    assert found.command()[0] == found.nvcc


def test_wheels_spread_over_directories_are_each_given_to_nvcc(tmp_path):
    """A --target install of nvcc beside the environment's own runtime and headers (as torch brings them)."""
    target = fake_wheels(tmp_path / "target", ("nvcc", "cicc"))
    site = fake_wheels(tmp_path / "site", ("runtime headers", "static runtime", "crt headers", "CCCL headers"))
    found = jit.pip_toolkit([str(tmp_path / "target"), str(tmp_path / "site")])
    assert found.nvcc == str(target / "bin" / "nvcc")
    assert f"-I{site / 'include'}" in found.flags and f"-L{site / 'lib'}" in found.flags


def test_a_runtime_wheel_alone_is_no_toolkit(tmp_path):
    fake_wheels(tmp_path, ("runtime headers", "static runtime"))  # what torch's CUDA 13 build installs
    assert jit.pip_toolkit([str(tmp_path)]) is None


@pytest.mark.parametrize(
    "missing, message",
    [
        ("CCCL headers", "lacks its CCCL headers \\(nvidia-cuda-cccl\\)"),
        ("crt headers", "lacks its crt headers \\(nvidia-cuda-crt\\)"),
        ("cicc", "lacks its cicc \\(nvidia-nvvm beside it\\)"),
    ],
)
def test_a_partial_pip_toolkit_names_the_wheel_it_lacks(tmp_path, missing, message):
    fake_wheels(tmp_path, [p for p in jit.PIP_PIECES if p != missing])
    with pytest.raises(RuntimeError, match=message):
        jit.pip_toolkit([str(tmp_path)])


def test_cicc_must_sit_beside_nvcc(tmp_path):
    fake_wheels(tmp_path / "a", [p for p in jit.PIP_PIECES if p != "cicc"])
    fake_wheels(tmp_path / "b", ("cicc",))  # nvcc runs the cicc of its own tree only
    with pytest.raises(RuntimeError, match="cicc"):
        jit.pip_toolkit([str(tmp_path / "a"), str(tmp_path / "b")])


def test_cuda_home_then_pip_then_the_path(tmp_path, monkeypatch, fresh_toolkit):
    home = fake_wheels(tmp_path / "site")
    system = tmp_path / "cuda"
    (system / "bin").mkdir(parents=True)
    (system / "bin" / "nvcc").write_text("")
    (system / "bin" / "nvcc").chmod(0o755)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site")])
    monkeypatch.setenv("CUDA_HOME", str(system))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    assert jit.toolkit().nvcc == str(system / "bin" / "nvcc") and jit.toolkit().source == f"CUDA_HOME={system}"
    jit.toolkit.cache_clear()
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setenv("PATH", str(system / "bin"))
    assert jit.toolkit().nvcc == str(home / "bin" / "nvcc")  # the wheels before a system nvcc on the PATH
    jit.toolkit.cache_clear()
    monkeypatch.setattr(sys, "path", [])
    assert jit.toolkit() == jit.Toolkit(str(system / "bin" / "nvcc"), f"the PATH ({system / 'bin' / 'nvcc'})")
    jit.toolkit.cache_clear()
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(jit, "SYSTEM_NVCC", str(tmp_path / "none"))
    with pytest.raises(RuntimeError, match=r"flashoverlap\[cu13\].*CUDA_HOME"):
        jit.toolkit()


def test_a_long_compile_says_it_still_runs(monkeypatch, caplog):
    monkeypatch.setattr(jit, "HEARTBEAT_S", 0.05)
    with caplog.at_level(logging.INFO, "flashoverlap"):
        done = jit._compile(["sh", "-c", "sleep 0.3; echo oops >&2; exit 3"], "kernel 2 of 5, k")
    assert done.returncode == 3 and done.stderr == "oops\n"
    assert any(m.startswith("still compiling kernel 2 of 5, k (") for m in caplog.messages)


def test_messages_reach_stderr_until_the_application_configures_logging(monkeypatch, capsys):
    """Without any logging setup a compile's messages are seen; with the application's handlers
    (here pytest's, taken away for the first part) they go there alone, not twice."""
    from flashoverlap import logs

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    jit.log.info("compiling x")
    assert capsys.readouterr().err == "[flashoverlap] compiling x\n"
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])
    jit.log.info("compiling y")
    assert capsys.readouterr().err == ""
    logs.install()  # (again: still one handler)
    assert [type(h) for h in logs.logger.handlers] == [logs.DefaultHandler] and logs.logger.level == logging.INFO
