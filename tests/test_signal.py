"""signal on the CPU: the debug-mode settings (the waits themselves run in tests/test_gpu.py)."""

import pytest

from flashoverlap import signal


def test_debug_timeout_is_off_by_default(monkeypatch):
    monkeypatch.delenv("FLASHOVERLAP_DEBUG", raising=False)
    monkeypatch.setenv("FLASHOVERLAP_TIMEOUT_S", "not read outside debug mode")
    assert signal.debug_timeout() is None


def test_debug_timeout_reads_its_bound(monkeypatch):
    monkeypatch.setenv("FLASHOVERLAP_DEBUG", "1")
    monkeypatch.delenv("FLASHOVERLAP_TIMEOUT_S", raising=False)
    assert signal.debug_timeout() == 10.0
    monkeypatch.setenv("FLASHOVERLAP_TIMEOUT_S", "0.25")
    assert signal.debug_timeout() == 0.25


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan"])
def test_bad_debug_timeouts_are_named(monkeypatch, value):
    monkeypatch.setenv("FLASHOVERLAP_DEBUG", "1")
    monkeypatch.setenv("FLASHOVERLAP_TIMEOUT_S", value)
    with pytest.raises(ValueError, match="FLASHOVERLAP_TIMEOUT_S must be a positive number"):
        signal.debug_timeout()


def test_bad_wait_mode_is_named(monkeypatch):
    monkeypatch.setenv("FLASHOVERLAP_WAIT", "busy")
    signal.forget_probes()
    try:
        with pytest.raises(ValueError, match="FLASHOVERLAP_WAIT must be one of"):
            signal.stream_waits(0, capturing=False)
    finally:
        signal.forget_probes()
