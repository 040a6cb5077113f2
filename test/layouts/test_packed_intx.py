"""PackedIntxLayout: pinned bytes of the dense bit stream and of the ternary bit planes, exact round trips
for every bit width, byte arithmetic, slicing at whole bytes, IntxWeightOnlyConfig's layout choice, and
reasons for weights it can't take. (The shared conformance suite covers the generic ops.)"""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk
from torchqkit.core import choose_qparams_affine, dequantize_affine, quantize_affine
from torchqkit.core import qdtypes as Q
from torchqkit.layouts import PlainParts


def _weight(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _pack(codes, qdtype, layout=None):
    """Pack given codes with one scale per row through the layout."""
    layout = layout or qk.PackedIntxLayout()
    parts = PlainParts(codes, torch.ones(codes.shape[0], 1), None)
    return layout.pack(parts, qk.layouts.WeightFormat.of(qdtype, (1, codes.shape[1]), codes.shape, "none"))["qdata"]


# ------------------------------------------------------------------------------------------ pinned bytes

def test_int3_bit_stream_is_pinned():
    # Note [Packed intx bits]: u = q + 4, code k at stream bits [3k, 3k + 3), least significant bit first.
    codes = torch.tensor([[-4, 3, 0, 1, -1, 2, -2, -3, 3, -4],
                          [3] * 10], dtype=torch.int8)
    packed = _pack(codes, Q.int3)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 4)  # ceil(10 * 3 / 8) bytes a row
    assert packed.tolist() == [[0b00111000, 0x3B, 0x2B, 0x07],
                               [0xFF, 0xFF, 0xFF, 0x3F]]  # 30 one-bits, then 2 zero bits


def test_uint2_and_int5_bytes_are_pinned():
    assert _pack(torch.tensor([[0, 1, 2, 3]], dtype=torch.uint8), Q.uint2).tolist() == [[0xE4]]
    # int5: u = q + 16; 8 codes fill 5 bytes. u = [0, 31, 16, 1, 0, 0, 0, 0]: u1 = stream bits 5..9,
    # u2 = 0b10000 puts its one at bit 14, u3 = 1 at bit 15.
    codes = torch.tensor([[-16, 15, 0, -15, -16, -16, -16, -16]], dtype=torch.int8)
    assert _pack(codes, Q.int5).tolist() == [[0b11100000, 0b11000011, 0, 0, 0]]


def test_ternary_bit_planes_are_pinned():
    codes = torch.tensor([[1, -1, 0, 0, 1, 1, -1, 0, -1, 0]], dtype=torch.int8)
    packed = _pack(codes, Q.int2, qk.PackedIntxLayout(ternary=True))
    # nonzero plane, negative plane for codes 0..7; then for codes 8..9.
    assert packed.tolist() == [[0b01110011, 0b01000010, 0b00000001, 0b00000001]]


# ------------------------------------------------------------------------------------------ round trips

@pytest.mark.parametrize("bits", range(1, 8))
@pytest.mark.parametrize("signed", [True, False], ids=["int", "uint"])
def test_every_width_roundtrips_and_dequantizes_like_the_oracle(bits, signed):
    qdtype = (Q.INT if signed else Q.UINT)[bits]
    mapping = qk.MappingType.SYMMETRIC if signed else qk.MappingType.ASYMMETRIC
    w, block = _weight((5, 36)), (1, 12)  # 36 * bits is not a multiple of 8 for odd bits: a partial last byte
    aqt = qk.quantize_weight(w, qdtype, block, qk.PackedIntxLayout(), mapping=mapping)
    scale, zp = choose_qparams_affine(w, qdtype, block, mapping=mapping)
    codes = quantize_affine(w, qdtype, block, scale, zp)
    assert aqt.qdata.shape == (5, -(-36 * bits // 8))
    parts = aqt.qlayout.unpack(aqt)
    assert parts.qdata.dtype == codes.dtype and torch.equal(parts.qdata, codes)
    torch.testing.assert_close(aqt.dequantize(), dequantize_affine(codes, qdtype, block, scale, zp), rtol=0, atol=0)


def test_every_code_value_survives_packing():
    for bits in range(1, 8):
        for qdtype in (Q.INT[bits], Q.UINT[bits]):
            codes = torch.arange(int(qdtype.qmin), int(qdtype.qmax) + 1).repeat(3)[None, :].to(qdtype.storage_dtype)
            layout = qk.PackedIntxLayout()
            aqt = qk.AffineQuantizedTensor(layout.pack(PlainParts(codes, torch.ones(1, 1), None),
                                                       qk.layouts.WeightFormat.of(qdtype, (1, codes.shape[1]), codes.shape, "none")),
                                           qdtype, (1, codes.shape[1]), tuple(codes.shape), torch.float32, layout,
                                           qk.ZeroPointDomain.NONE)
            assert torch.equal(layout.unpack(aqt).qdata, codes), qdtype.name


def test_ternary_weights_roundtrip_exactly():
    g = torch.Generator().manual_seed(0)
    w = (torch.randint(-1, 2, (16, 64), generator=g) * 0.25).float()  # blocks of {-a, 0, a}
    aqt = qk.quantize_weight(w, Q.int2, qk.PerGroup(32), qk.PackedIntxLayout(ternary=True),
                             mapping=qk.MappingType.SYMMETRIC_NO_CLIPPING_ERR)
    assert aqt.qdata.shape == (16, 16)  # 2 bits per weight
    torch.testing.assert_close(aqt.dequantize(), w, rtol=0, atol=0)


def test_ternary_refuses_minus_two_with_the_fix():
    w = torch.tensor([[-3.0, 1.0, 0.5, 0.0] * 8])  # symmetric int2: -3 / (3 / 1.5) = -1.5 -> code -2
    with pytest.raises(ValueError, match=r"8 of 32 int2 codes are -2.*SYMMETRIC_NO_CLIPPING_ERR"):
        qk.quantize_weight(w, Q.int2, qk.PerGroup(32), qk.PackedIntxLayout(ternary=True))
    model = torch.nn.Sequential(torch.nn.Linear(32, 1, bias=False))
    model[0].weight.data.copy_(w)
    with pytest.warns(UserWarning, match="left unquantized"):
        report = qk.quantize_(model, qk.IntxWeightOnlyConfig(bits=2, layout=qk.PackedIntxLayout(ternary=True)))
    assert report["0"].status == "skipped" and "codes are -2" in report["0"].reason


# ------------------------------------------------------------------------------------------ bytes

def test_stored_bytes_match_the_format_arithmetic():
    # int3 g32 symmetric, float32 scales: 3 bits per weight + one float32 scale per 32 weights.
    aqt = qk.quantize_weight(_weight((64, 256)), Q.int3, qk.PerGroup(32), qk.PackedIntxLayout())
    assert aqt.packed_nbytes() == 64 * 256 * 3 // 8 + 64 * 256 // 32 * 4
    # uint5 asymmetric: + one int zero point (uint8) per group.
    aqt = qk.quantize_weight(_weight((64, 256)), Q.uint5, qk.PerGroup(32), qk.PackedIntxLayout(),
                             mapping=qk.MappingType.ASYMMETRIC)
    assert aqt.packed_nbytes() == 64 * 256 * 5 // 8 + 64 * 256 // 32 * (4 + 1)
    # Ternary: 2 bits per weight.
    aqt = qk.quantize_weight(_weight((64, 256)), Q.int2, qk.PerGroup(32), qk.PackedIntxLayout(ternary=True),
                             mapping=qk.MappingType.SYMMETRIC_NO_CLIPPING_ERR)
    assert aqt.packed_nbytes() == 64 * 256 * 2 // 8 + 64 * 256 // 32 * 4


@pytest.mark.parametrize("bits", [2, 3, 5, 6, 7, 8])
def test_intx_config_packs_below_8_bits_and_reports_the_real_size(bits):
    config = qk.IntxWeightOnlyConfig(bits=bits, granularity=qk.PerGroup(32))
    assert config.layout is None
    model = torch.nn.Sequential(torch.nn.Linear(256, 64, bias=False))
    report = qk.quantize_(model, config)
    weight = model[0].weight
    expected = qk.PlainLayout() if bits == 8 else qk.PackedIntxLayout()
    assert weight.qlayout == expected
    assert report["0"].bytes_after == 64 * 256 * bits // 8 + 64 * 256 // 32 * 4


def test_intx_config_keeps_an_explicit_layout_and_roundtrips_json():
    config = qk.IntxWeightOnlyConfig(bits=3, layout=qk.PlainLayout())
    assert config.resolved_layout() == qk.PlainLayout()
    for c in (config, qk.IntxWeightOnlyConfig(bits=2, layout=qk.PackedIntxLayout(ternary=True)),
              qk.IntxWeightOnlyConfig(bits=5)):
        assert qk.config_from_dict(c.to_dict()) == c


# ------------------------------------------------------------------------------------------ slicing

def test_slices_along_in_features_are_byte_views():
    aqt = qk.quantize_weight(_weight((16, 64)), Q.int3, qk.PerGroup(8), qk.PackedIntxLayout())
    part = aqt[:, 8:24]  # codes 8..23 = bytes 3..8
    assert part.qdata.data_ptr() == aqt.qdata[:, 3:].data_ptr() and part.qdata.shape == (16, 6)
    torch.testing.assert_close(part.dequantize(), aqt.dequantize()[:, 8:24], rtol=0, atol=0)
    rows = aqt[4:9]
    assert rows.qdata.data_ptr() == aqt.qdata[4:].data_ptr()
    torch.testing.assert_close(rows.dequantize(), aqt.dequantize()[4:9], rtol=0, atol=0)


def test_per_row_slices_cut_at_whole_bytes():
    aqt = qk.quantize_weight(_weight((8, 30)), Q.int6, qk.PerRow(), qk.PackedIntxLayout())  # 4 codes = 3 bytes
    part = aqt[:, 4:30]  # the single row block shrinks; the last byte is partial
    assert part.block_size == (1, 26) and part.qdata.shape == (8, 20)
    torch.testing.assert_close(part.dequantize(), aqt.dequantize()[:, 4:30], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"multiples of 4 \(or end at 30\)"):
        aqt[:, 2:6]


def test_ternary_slices_cut_at_plane_groups():
    aqt = qk.quantize_weight(_weight((8, 64)), Q.int2, qk.PerGroup(16), qk.PackedIntxLayout(ternary=True),
                             mapping=qk.MappingType.SYMMETRIC_NO_CLIPPING_ERR)
    part = aqt[:, 16:48]
    assert part.qdata.data_ptr() == aqt.qdata[:, 4:].data_ptr()
    torch.testing.assert_close(part.dequantize(), aqt.dequantize()[:, 16:48], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ supports

@pytest.mark.parametrize("layout,qdtype,zpd,reason", [
    (qk.PackedIntxLayout(), Q.int8, qk.ZeroPointDomain.NONE, "use PlainLayout"),
    (qk.PackedIntxLayout(), Q.nf4, qk.ZeroPointDomain.NONE, "integer codes"),
    (qk.PackedIntxLayout(), Q.float8_e4m3fn, qk.ZeroPointDomain.NONE, "integer codes"),
    (qk.PackedIntxLayout(ternary=True), Q.int3, qk.ZeroPointDomain.NONE, "ternary=False"),
    (qk.PackedIntxLayout(ternary=True), Q.int2, qk.ZeroPointDomain.INT, "ternary=False"),
])
def test_supports_names_the_reason(layout, qdtype, zpd, reason):
    text = layout.supports(qk.layouts.WeightFormat.of(qdtype, (1, 32), (16, 64), zpd))
    assert text is not None and reason in text


def test_explicit_packed_layout_at_8_bits_is_reported_not_skipped_silently():
    model = torch.nn.Sequential(torch.nn.Linear(64, 16))
    with pytest.warns(UserWarning, match="left unquantized"):
        report = qk.quantize_(model, qk.IntxWeightOnlyConfig(bits=8, layout=qk.PackedIntxLayout()))
    assert report["0"].status == "skipped" and "use PlainLayout" in report["0"].reason


def test_ternary_knob_is_checked():
    with pytest.raises(ValueError, match="ternary must be True or False"):
        qk.PackedIntxLayout(ternary=1)


def test_kernel_status_reports_the_kernel_and_the_reference_path():
    rows = [r for r in qk.kernels.status() if r["layout"] == "packed_intx"]
    assert [r["path"].split(" ")[0] for r in rows] == [
        "torchqkit::linear_intxwo", "torchqkit::linear_ternarywo", "torchqkit::linear_int8da_int4_packed",
        "torchqkit::linear_intxwo", "torchqkit::linear_ternarywo", "reference"]
