"""AMD's float8 formats in the oracle (Note [float8 fnuz] in core/qdtype.py): every byte dequantizes as torch's own
float8_e4m3fnuz / float8_e5m2fnuz conversion does, quantization saturates at 240 / 57344 and rounds to nearest even,
and no finite value becomes the NaN byte 0x80."""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk
from torchqkit.core import qdtypes as Q

FNUZ = [pytest.param(Q.float8_e4m3fnuz, id="e4m3fnuz"), pytest.param(Q.float8_e5m2fnuz, id="e5m2fnuz")]
EVERY_BYTE = torch.arange(256, dtype=torch.uint8)


def _bits(t: torch.Tensor) -> list[int]:
    return t.float().contiguous().view(torch.int32).tolist()


def test_registered_with_their_range():
    e4, e5 = qk.qdtypes.qdtype_from_name("float8_e4m3fnuz"), qk.qdtypes.qdtype_from_name("float8_e5m2fnuz")
    assert (e4.qmin, e4.qmax, e4.storage_dtype, e4.kind) == (-240.0, 240.0, torch.float8_e4m3fnuz, Q.QKind.FLOAT8)
    assert (e5.qmin, e5.qmax, e5.storage_dtype) == (-57344.0, 57344.0, torch.float8_e5m2fnuz)
    assert e4.is_fnuz and e5.is_fnuz and not Q.float8_e4m3fn.is_fnuz and not Q.int8.is_fnuz
    assert {"float8_e4m3fnuz", "float8_e5m2fnuz"} <= {q.name for q in qk.qdtypes.all_qdtypes()}


@pytest.mark.parametrize("qdtype", FNUZ)
@pytest.mark.parametrize("scale", [1.0, 2.0 ** -5, 3.0])
def test_every_byte_dequantizes_as_torch_does(qdtype, scale):
    codes = EVERY_BYTE.view(qdtype.storage_dtype).reshape(16, 16)
    out = qk.dequantize_affine(codes, qdtype, (16, 16), torch.tensor([[scale]]))
    want = codes.to(torch.float32) * scale  # torch's own conversion, then the same float32 product
    nan = want.isnan()
    assert nan.reshape(-1).nonzero().reshape(-1).tolist() == [0x80]  # the only NaN; no inf anywhere
    assert torch.isnan(out[nan]).all()
    assert _bits(out[~nan]) == _bits(want[~nan])  # bit for bit: +0 only, subnormals, +-max


@pytest.mark.parametrize("qdtype", FNUZ)
def test_every_value_quantizes_back_to_its_byte(qdtype):
    # The 255 finite values (0x00 .. 0xFF but 0x80), quantized with scale 1, give their own bytes back.
    codes = EVERY_BYTE[EVERY_BYTE != 0x80]
    values = codes.view(qdtype.storage_dtype).float().reshape(1, -1)
    q = qk.quantize_affine(values, qdtype, (1, values.shape[1]), torch.ones(1, 1))
    assert q.dtype == qdtype.storage_dtype and torch.equal(q.view(torch.uint8).reshape(-1), codes)


def test_e4m3fnuz_rounding_and_saturation():
    q, top = Q.float8_e4m3fnuz, 240.0
    x = torch.tensor([[1.0625, 1.1875, 1.5 * 2 ** -10, 2.5 * 2 ** -10, 239.0, 250.0, 1e30, -1e30, -1e-12, -0.0]])
    codes = qk.quantize_affine(x, q, x.shape, torch.ones(1, 1))
    # Ties to even (1.0625 between 1 and 1.125 -> 1; 1.1875 -> 1.25; subnormal ties -> 2 * 2^-10), values past the
    # max saturate (torch's cast alone would give NaN), a value that rounds to zero is +0 (0x00), never 0x80.
    assert codes.float().reshape(-1).tolist() == [1.0, 1.25, 2 * 2 ** -10, 2 * 2 ** -10, 240.0, top, top, -top, 0.0, 0.0]
    assert codes.view(torch.uint8).reshape(-1).tolist()[-2:] == [0x00, 0x00]
    assert (x.clamp(-top, top).to(torch.float8_e4m3fnuz).view(torch.uint8) == codes.view(torch.uint8)).all()
    assert torch.isnan(torch.tensor([250.0]).to(torch.float8_e4m3fnuz).float()).all()  # why the oracle clamps first


@pytest.mark.parametrize("qdtype", FNUZ)
def test_scale_fills_the_fnuz_range(qdtype):
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    scale, zero = qk.choose_qparams_affine(w, qdtype, (1, 64), scale_dtype=torch.float32)
    assert zero is None
    torch.testing.assert_close(scale, w.abs().amax(1, keepdim=True) / qdtype.qmax, rtol=0, atol=0)
    codes = qk.quantize_affine(w, qdtype, (1, 64), scale)
    assert torch.equal(codes.float().abs().amax(1), torch.full((8,), qdtype.qmax))  # each row's absmax -> max
    assert not (codes.view(torch.uint8) == 0x80).any()
    # Relative error of the rounding: half an ulp of 3 (e4m3) / 2 (e5m2) mantissa bits.
    deq = qk.dequantize_affine(codes, qdtype, (1, 64), scale)
    half_ulp = 2.0 ** -4 if qdtype is Q.float8_e4m3fnuz else 2.0 ** -3
    normal = w.abs() >= scale * torch.finfo(qdtype.storage_dtype).smallest_normal
    assert ((deq - w).abs()[normal] <= half_ulp * w.abs()[normal]).all()


@pytest.mark.parametrize("qdtype", FNUZ)
def test_nan_input_without_check_is_the_nan_byte(qdtype):
    x = torch.tensor([[1.0, float("nan")]])
    codes = qk.quantize_affine(x, qdtype, x.shape, torch.ones(1, 1), check_finite=False)
    assert codes.view(torch.uint8).tolist() == [[codes.view(torch.uint8)[0, 0].item(), 0x80]]
    with pytest.raises(ValueError, match="NaN"):
        qk.quantize_affine(x, qdtype, x.shape, torch.ones(1, 1))
