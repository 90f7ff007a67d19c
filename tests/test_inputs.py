"""A call's operand checks."""

import pytest
import torch

from flashoverlap.inputs import Fp8, Scales, check_inputs, check_scales, epilogue

from .helpers import bf16

E4M3 = torch.float8_e4m3fn


def fp8(*shape: int, dtype: torch.dtype = E4M3) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def test_reference_inputs_must_be_on_cpu():
    assert check_inputs(bf16(16, 32), bf16(8, 32), "nk", device_type="cpu") == (16, 8, 32)


def test_fp8_operands_align_rows_to_16_bytes():
    assert check_inputs(fp8(16, 32), fp8(48, 32), "nk", device_type="cpu") == (16, 48, 32)
    with pytest.raises(ValueError, match="multiples of 16"):
        check_inputs(fp8(16, 40), fp8(48, 40), "nk", device_type="cpu")


def test_16_bit_operands_take_no_scales():
    a, w = bf16(16, 32), bf16(8, 32)
    assert check_scales(a, w, "nk", None, None, None) == (None, None)
    one = torch.ones(1)
    for given in [(one, None, None), (None, one, None), (None, None, torch.bfloat16), (None, None, None, True)]:
        with pytest.raises(ValueError, match="are for FP8 operands"):
            check_scales(a, w, "nk", *given)


def test_fp8_operands_take_per_tensor_scales_a_16_bit_result_and_an_accumulation():
    a, w, one = fp8(16, 32), fp8(8, 32), torch.ones(1)
    scales, kind = check_scales(a, w, "nk", one, torch.tensor(2.0), None)
    assert scales == Scales(one, scales.b) and scales.b.item() == 2.0 and kind == Fp8(torch.bfloat16, False)
    assert check_scales(a, w, "nk", one, one, torch.float16, True)[1] == Fp8(torch.float16, True)
    with pytest.raises(TypeError, match="use_fast_accum must be a bool"):
        check_scales(a, w, "nk", one, one, None, 1)


def test_fp8_operands_take_rowwise_scales_as_scaled_mm():
    """scale_a [M, 1] with scale_b [1, N]: the epilogue reads M and N values (inputs.Scales.epilogue)."""
    a, w = fp8(16, 32), fp8(8, 32)
    rows, cols = torch.rand(16, 1), torch.rand(1, 8)
    scales, kind = check_scales(a, w, "nk", rows, cols, None, True)
    assert scales.rowwise and kind == Fp8(torch.bfloat16, True, rowwise=True)
    alpha, row, col = scales.epilogue()
    assert alpha is None and torch.equal(row, rows.reshape(-1)) and torch.equal(col, cols.reshape(-1))
    assert row.data_ptr() == rows.data_ptr() and col.data_ptr() == cols.data_ptr()  # (no copies)
    # one row: [1, 1] with [1, N] is rowwise, a single value for a with [1, N] is not
    assert check_scales(fp8(1, 32), w, "nk", torch.ones(1, 1), cols, None)[0].rowwise
    with pytest.raises(ValueError, match=r"scale_a should be float32 \[1, 1\]"):
        check_scales(fp8(1, 32), w, "nk", torch.ones(1), cols, None)
    assert check_scales(fp8(16, 32)[0], w, "nk", rows, cols, None) == (None, None)  # (check_inputs: not 2-D)
    per_tensor, _ = check_scales(a, w, "nk", torch.tensor(2.0), torch.tensor(3.0), None)
    alpha, row, col = per_tensor.epilogue()
    assert alpha.item() == 6.0 and row is None and col is None
    assert epilogue(None) == (None, None, None)  # (16-bit operands: the epilogue reads no scales)


@pytest.mark.parametrize(
    "layout, scale_a, scale_b, out_dtype, message",
    [
        ("kn", torch.ones(1), torch.ones(1), None, "need weight_layout 'nk'"),
        ("nk", None, torch.ones(1), None, "need scale_a"),
        ("nk", torch.ones(1), None, None, "need scale_b"),
        ("nk", torch.ones(16, 1), torch.ones(1), None, r"scale_b should be float32 \[1, 8\]"),
        ("nk", torch.ones(1), torch.ones(1, 8), None, r"scale_a should be float32 \[16, 1\]"),
        ("nk", torch.ones(1, 16), torch.ones(1, 8), None, r"scale_a should be float32 \[16, 1\]"),
        ("nk", torch.ones(16, 1), torch.ones(8, 1), None, r"scale_b should be float32 \[1, 8\]"),
        ("nk", torch.ones(16, 1, dtype=torch.float64), torch.ones(1, 8), None, "should be float32"),
        ("nk", torch.ones(32, 1)[::2], torch.ones(1, 8), None, "scale_a must be contiguous"),
        ("nk", torch.ones(16, 1), torch.ones(1, 8), torch.float16, "rowwise scales give a bfloat16 result"),
        ("nk", torch.ones(16, 1), torch.ones(1, 8, device="meta"), None, "scale_b is on meta, expected cpu"),
        ("nk", torch.ones(1, dtype=torch.float64), torch.ones(1), None, "one float32 value"),
        ("nk", 1.0, torch.ones(1), None, "scale_a must be a torch.Tensor"),
        ("nk", torch.ones(1), torch.ones(1), torch.float32, "out_dtype must be one of"),
        ("nk", torch.ones(1), torch.ones(1, device="meta"), None, "scale_b is on meta, expected cpu"),
    ],
)
def test_bad_fp8_arguments_are_refused(layout, scale_a, scale_b, out_dtype, message):
    with pytest.raises((ValueError, TypeError), match=message):
        check_scales(fp8(16, 32), fp8(8, 32), layout, scale_a, scale_b, out_dtype)


def test_two_e5m2_operands_are_refused():
    """torch._scaled_mm, the plain path every FP8 call may take (one rank, a lost trial), multiplies no
    two float8_e5m2 operands."""
    e5m2 = torch.float8_e5m2
    with pytest.raises(ValueError, match="two float8_e5m2 operands"):
        check_scales(fp8(16, 32, dtype=e5m2), fp8(8, 32, dtype=e5m2), "nk", torch.ones(1), torch.ones(1), None)
