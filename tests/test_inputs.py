"""A call's operand checks."""

from flashoverlap.inputs import check_inputs

from .helpers import bf16


def test_reference_inputs_must_be_on_cpu():
    assert check_inputs(bf16(16, 32), bf16(8, 32), "nk", device_type="cpu") == (16, 8, 32)
