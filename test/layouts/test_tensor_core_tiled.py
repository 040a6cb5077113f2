"""TensorCoreTiledLayout: the pinned bit arrangement, padding that never leaks, byte arithmetic, slicing at
tile boundaries, reasons for weights it can't take, and its place as Int4WeightOnlyConfig's default.
(The shared conformance suite covers detach/clone/to/copy_/t/linear/mm/compile/save-load.)"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.core import choose_qparams_affine, dequantize_affine, quantize_affine
from torchqkit.core import qdtypes as Q

INT4 = dict(mapping=qk.MappingType.ASYMMETRIC, zero_point_domain=qk.ZeroPointDomain.FLOAT)


def _weight(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _tiled(shape, group_size=32, inner_k_tiles=8, dtype=torch.float32, seed=0):
    return qk.quantize_weight(_weight(shape, seed, dtype), Q.uint4, qk.PerGroup(group_size),
                              qk.TensorCoreTiledLayout(inner_k_tiles=inner_k_tiles), **INT4)


def _pack_codes(codes, group_size, inner_k_tiles):
    """Pack given uint4 codes (scale 1, zero 0) through the layout."""
    n, k = codes.shape
    parts = qk.layouts.PlainParts(codes, torch.ones(n, k // group_size), torch.zeros(n, k // group_size))
    return qk.TensorCoreTiledLayout(inner_k_tiles=inner_k_tiles).pack(
        parts, qk.layouts.WeightFormat.of(Q.uint4, (1, group_size), (n, k), "float"))


def _words_from_docstring(codes, inner_k_tiles):
    """Note [Tensor-core tiled int4], written as scalar loops: lane l = 4 r + c of n-tile i, chunk j, word w
    holds nibble p = 4 e + 2 u + h = code[8 i + r, 16 T j + 16 (2 w + u) + 2 c + 8 h + e]."""
    t = inner_k_tiles
    n8, kt = codes.shape
    out = torch.zeros(n8 // 8, kt // (16 * t), 32, t // 2, dtype=torch.int64)
    for i in range(n8 // 8):
        for j in range(kt // (16 * t)):
            for lane in range(32):
                r, c = divmod(lane, 4)
                for w in range(t // 2):
                    word = 0
                    for p in range(8):
                        e, u, h = p // 4, (p // 2) % 2, p % 2
                        word |= int(codes[8 * i + r, 16 * t * j + 16 * (2 * w + u) + 2 * c + 8 * h + e]) << (4 * p)
                    out[i, j, lane, w] = word
    return out


# ------------------------------------------------------------------------------------------ bit layout

def test_packed_bytes_of_hand_written_example_are_pinned():
    # 8 x 32 codes, inner_k_tiles=2: one n-tile, one chunk of two k16-tiles, one int32 word per lane.
    n, k = torch.arange(8).reshape(8, 1), torch.arange(32).reshape(1, 32)
    codes = ((k + 3 * n + 5 * (k // 16)) % 16).to(torch.uint8)
    qdata = _pack_codes(codes, 32, 2)["qdata"]
    assert qdata.shape == (1, 1, 32, 1) and qdata.dtype == torch.int32
    words = [w & 0xFFFFFFFF for w in qdata.flatten().tolist()]
    # Row 0, lanes c = 0..3: nibbles 0..7 = k offsets 2c+{0, 8} (tile 0), 2c+{0, 8} (tile 1, +5), then the
    # odd ks 2c+{1, 9} the same way; e.g. lane 0 = [0, 8, 5, 13, 1, 9, 6, 14] -> 0xE691D580.
    # Lane 4 is row 1 (codes + 3), c = 0.
    assert words[:5] == [0xE691D580, 0x08B3F7A2, 0x2AD519C4, 0x4CF73BE6, 0x19C408B3]
    # Little-endian bytes of the first word, as saved on any device.
    assert qdata.flatten()[:1].view(torch.uint8).tolist() == [0x80, 0xD5, 0x91, 0xE6]


@pytest.mark.parametrize("inner_k_tiles", [2, 4, 8])
def test_packing_matches_the_documented_formula(inner_k_tiles):
    codes = torch.randint(0, 16, (16, 256), generator=torch.Generator().manual_seed(inner_k_tiles),
                          dtype=torch.uint8)
    qdata = _pack_codes(codes, 32, inner_k_tiles)["qdata"]
    assert qdata.shape == (2, 256 // (16 * inner_k_tiles), 32, inner_k_tiles // 2)
    assert torch.equal(qdata.to(torch.int64) & 0xFFFFFFFF, _words_from_docstring(codes, inner_k_tiles))


@pytest.mark.parametrize("inner_k_tiles", [2, 4, 8])
@pytest.mark.parametrize("shape,group_size", [((1, 32), 32), ((13, 160), 32), ((8, 64), 64), ((30, 384), 128),
                                              ((17, 256), 256)])
def test_roundtrip_and_dequantize_bit_exact(shape, group_size, inner_k_tiles):
    w = _weight(shape, dtype=torch.bfloat16)
    aqt = _tiled(shape, group_size, inner_k_tiles, dtype=torch.bfloat16)
    scale, zp = choose_qparams_affine(w, Q.uint4, (1, group_size), **INT4)
    codes = quantize_affine(w, Q.uint4, (1, group_size), scale, zp, zero_point_domain=qk.ZeroPointDomain.FLOAT)
    parts = aqt.qlayout.unpack(aqt)
    assert torch.equal(parts.qdata, codes) and torch.equal(parts.scale, scale) and torch.equal(parts.zero_point, zp)
    oracle = dequantize_affine(codes, Q.uint4, (1, group_size), scale, zp, zero_point_domain=qk.ZeroPointDomain.FLOAT,
                               output_dtype=torch.bfloat16)
    assert aqt.dequantize().dtype == torch.bfloat16
    torch.testing.assert_close(aqt.dequantize(), oracle, rtol=0, atol=0)
    assert aqt.scale_and_zero.dtype == torch.bfloat16  # scale and zero point kept in the weight's dtype


# ------------------------------------------------------------------------------------------ bytes and padding

def test_stored_bytes_match_the_format_arithmetic():
    # Aligned bf16 weight, g128: 4 bits per weight + a bf16 scale and a bf16 zero point per 128 weights.
    aqt = _tiled((64, 256), group_size=128, dtype=torch.bfloat16)
    assert aqt.packed_nbytes() == 64 * 256 // 2 + (64 * 256 // 128) * 2 * 2
    # Padded float32 weight: (44, 96) g32 is stored as (48, 128): 4 groups of 32 per padded row.
    aqt = _tiled((44, 96), group_size=32)
    assert aqt.qdata.shape == (6, 1, 32, 4) and aqt.scale_and_zero.shape == (4, 48, 2)
    assert aqt.packed_nbytes() == 48 * 128 // 2 + 4 * 48 * 2 * 4


def test_report_counts_the_real_packed_bytes():
    model = torch.nn.Sequential(torch.nn.Linear(256, 64, bias=False), torch.nn.Linear(96, 44, bias=False))
    report = qk.quantize_(copy.deepcopy(model), qk.Int4WeightOnlyConfig(group_size=32))
    assert report["0"].bytes_after == 64 * 256 // 2 + 8 * 64 * 2 * 4
    # K = 96 at the tiling chosen per weight (2: chunks of 32, no padding); at inner_k_tiles 8 it pads to 128
    assert report["1"].bytes_before == 44 * 96 * 4 and report["1"].bytes_after == 48 * 96 // 2 + 3 * 48 * 2 * 4
    tiled8 = qk.Int4WeightOnlyConfig(group_size=32, layout=qk.TensorCoreTiledLayout(inner_k_tiles=8))
    assert qk.quantize_(model, tiled8)["1"].bytes_after == 48 * 128 // 2 + 4 * 48 * 2 * 4


def test_padding_never_leaks():
    shape = (44, 96)  # pads to (48, 128)
    aqt = _tiled(shape)
    assert tuple(aqt.shape) == shape and aqt.dequantize().shape == shape
    assert aqt.t().shape == (96, 44)
    x = _weight((5, 96), seed=1)
    out = F.linear(x, aqt)
    assert out.shape == (5, 44)
    ref = F.linear(x, aqt.dequantize())
    # The int4 kernel sums in another order than the float matmul (see test/kernels/test_linear_int4.py):
    # 2e-5 of the output's magnitude, far below what a leaked padded row or column would add.
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-5 * ref.abs().max().item())
    lin = torch.nn.Linear(96, 44, bias=False)
    lin.weight = torch.nn.Parameter(aqt, requires_grad=False)
    assert lin.state_dict()["weight"].shape == shape
    # The last, partly padded n-tile and the padded k-chunk slice like any other.
    tail = aqt.narrow(0, 40, 4)
    assert tail.shape == (4, 96) and tail.qdata.data_ptr() == aqt.qdata[5:].data_ptr()
    torch.testing.assert_close(tail.dequantize(), aqt.dequantize()[40:], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ slicing

def test_slices_at_tile_boundaries_are_views():
    aqt = _tiled((48, 512), group_size=32, inner_k_tiles=4)  # k-chunks of 64
    part = aqt[8:24, 128:256]
    assert part.shape == (16, 128)
    assert part.qdata.data_ptr() == aqt.qdata[1:, 2:].data_ptr()
    assert part.scale_and_zero.data_ptr() == aqt.scale_and_zero[4:, 8:].data_ptr()
    torch.testing.assert_close(part.dequantize(), aqt.dequantize()[8:24, 128:256], rtol=0, atol=0)
    x = _weight((3, 128), seed=1)
    ref = F.linear(x, part.dequantize())  # kernel vs float matmul: summation order only (see above)
    torch.testing.assert_close(F.linear(x, part), ref, rtol=0, atol=2e-5 * ref.abs().max().item())


def test_slices_off_tile_boundaries_raise():
    aqt = _tiled((48, 256), group_size=32, inner_k_tiles=8)  # k-chunks of 128
    with pytest.raises(ValueError, match=r"multiples of 8 \(or end at 48\)"):
        aqt.narrow(0, 4, 8)
    with pytest.raises(ValueError, match=r"TensorCoreTiledLayout\(inner_k_tiles=8\).*multiples of 128"):
        aqt[:, 32:64]  # a group boundary, but inside a k-chunk: no view possible, and no silent copy


# ------------------------------------------------------------------------------------------ supports / config

@pytest.mark.parametrize("config,reason", [
    (qk.IntxWeightOnlyConfig(bits=4, layout=qk.TensorCoreTiledLayout()), "stores uint4 codes"),
    (qk.IntxWeightOnlyConfig(bits=4, granularity=qk.PerRow(), layout=qk.TensorCoreTiledLayout()), "uint4"),
])
def test_weights_it_cannot_take_are_reported_with_the_reason(config, reason):
    model = torch.nn.Sequential(torch.nn.Linear(64, 16))
    with pytest.warns(UserWarning, match="left unquantized"):
        report = qk.quantize_(model, config)
    assert report["0"].status == "skipped" and reason in report["0"].reason
    assert type(model[0].weight) is torch.nn.Parameter and not isinstance(model[0].weight, qk.AffineQuantizedTensor)


@pytest.mark.parametrize("kwargs,reason", [
    (dict(qdtype=Q.uint4, block_size=(1, 16), zero_point_domain=qk.ZeroPointDomain.FLOAT), "groups of"),
    (dict(qdtype=Q.uint4, block_size=(1, 64), zero_point_domain=qk.ZeroPointDomain.INT), "float domain"),
    (dict(qdtype=Q.int4, block_size=(1, 64), zero_point_domain=qk.ZeroPointDomain.NONE), "uint4"),
    (dict(qdtype=Q.uint4, block_size=(8, 64), zero_point_domain=qk.ZeroPointDomain.FLOAT), "groups of"),
])
def test_supports_names_the_reason(kwargs, reason):
    text = qk.TensorCoreTiledLayout().supports(
        qk.layouts.WeightFormat.of(kwargs["qdtype"], kwargs["block_size"], (64, 128), kwargs["zero_point_domain"]))
    assert text is not None and reason in text


def test_inner_k_tiles_is_checked():
    with pytest.raises(ValueError, match=r"inner_k_tiles must be one of \(2, 4, 8\) \(or None: chosen per weight\), "
                                         r"got 3"):
        qk.TensorCoreTiledLayout(inner_k_tiles=3)
    with pytest.raises(ValueError, match=r"no k-chunk until a weight chooses its tiling: use layout.for_weight"):
        qk.TensorCoreTiledLayout().k_chunk


# Note [inner_k_tiles per weight]: the tiling that pads K least, 8 on a tie; the quantized weight records it, and a
# named tiling is kept whatever it pads.
@pytest.mark.parametrize("k, g, tiles, kt", [(576, 32, 4, 576), (576, 128, 8, 640), (96, 32, 2, 96), (4096, 32, 8, 4096),
                                            (1536, 64, 8, 1536), (960, 32, 4, 960), (320, 256, 8, 512)])
def test_inner_k_tiles_chosen_per_weight(k, g, tiles, kt):
    w = _weight((16, k))
    aqt = qk.quantize_weight(w, Q.uint4, qk.PerGroup(g), qk.TensorCoreTiledLayout(), **INT4)
    assert aqt.qlayout == qk.TensorCoreTiledLayout(inner_k_tiles=tiles)
    assert aqt.qdata.shape == (2, kt // (16 * tiles), 32, tiles // 2)
    named = qk.quantize_weight(w, Q.uint4, qk.PerGroup(g), qk.TensorCoreTiledLayout(inner_k_tiles=8), **INT4)
    assert named.qlayout.inner_k_tiles == 8
    torch.testing.assert_close(aqt.dequantize(), named.dequantize(), rtol=0, atol=0)  # the same codes, other tiles
    x = _weight((3, k), seed=1)
    torch.testing.assert_close(F.linear(x, aqt), F.linear(x, named), rtol=0, atol=2e-5 * k ** 0.5)


def test_int4_config_defaults_to_tiled_and_plain_stays_selectable():
    assert qk.Int4WeightOnlyConfig().layout == qk.TensorCoreTiledLayout()
    config = qk.Int4WeightOnlyConfig(group_size=64, layout=qk.TensorCoreTiledLayout(inner_k_tiles=4))
    assert qk.config_from_dict(config.to_dict()) == config
    models = [torch.nn.Sequential(torch.nn.Linear(128, 24)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    qk.quantize_(models[0], qk.Int4WeightOnlyConfig(group_size=64))
    qk.quantize_(models[1], qk.Int4WeightOnlyConfig(group_size=64, layout=qk.PlainLayout()))
    tiled, plain = models[0][0].weight, models[1][0].weight
    # the weight records the tiling chosen for it (K = 128: 8, no padding either way)
    assert tiled.qlayout == qk.TensorCoreTiledLayout(inner_k_tiles=8) and plain.qlayout == qk.PlainLayout()
    torch.testing.assert_close(tiled.dequantize(), plain.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, "float32"])
def test_int4_config_scale_dtype_on_a_float32_model(tmp_path, scale_dtype):
    # Note [int4 scale dtype]: the scales and zero points are rounded to scale_dtype, the codes chosen against
    # the rounded ones (as quantize_weight does for a weight of that dtype), and the report counts their bytes.
    dtype = getattr(torch, scale_dtype) if isinstance(scale_dtype, str) else scale_dtype
    base = torch.nn.Sequential(torch.nn.Linear(576, 200, bias=True))
    model = torch.nn.Sequential(torch.nn.Linear(576, 200, bias=True))
    model.load_state_dict(base.state_dict())
    config = qk.Int4WeightOnlyConfig(group_size=32, scale_dtype=scale_dtype)
    report = qk.quantize_(model, config)
    w = model[0].weight
    assert w.scale_and_zero.dtype == dtype and w.dtype == torch.float32
    assert report["0"].bytes_after == 200 * 576 // 2 + 18 * 200 * 2 * dtype.itemsize  # inner_k_tiles 4: K unpadded
    expected = qk.quantize_weight(base[0].weight.detach(), Q.uint4, qk.PerGroup(32), qk.TensorCoreTiledLayout(),
                                  scale_dtype=dtype, **INT4)
    torch.testing.assert_close(w.dequantize(), expected.dequantize(), rtol=0, atol=0)
    ref = base[0].weight.detach()
    err = (w.dequantize() - ref).abs().max() / ref.abs().max()
    assert 0 < err < 0.1  # the 4-bit grid's step, not the scales' rounding
    # every kernel route (decode M = 1, small M, prefill) against the reference math of this very weight
    for m in (1, 3, 40):
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        torch.testing.assert_close(model(x), F.linear(x, w.dequantize(), base[0].bias), rtol=2e-5, atol=2e-4)
    assert qk.config_from_dict(config.to_dict()) == config and config.scale_dtype in config.describe()
    qk.save_quantized(model, tmp_path / "m.safetensors")
    loaded = torch.nn.Sequential(torch.nn.Linear(576, 200, bias=True))
    qk.load_quantized(loaded, tmp_path / "m.safetensors")
    assert loaded[0].weight.scale_and_zero.dtype == dtype
    torch.testing.assert_close(loaded[0].weight.dequantize(), w.dequantize(), rtol=0, atol=0)


def test_float16_scales_that_would_overflow_are_refused():
    # (range / 15) past 65504 would be stored as inf and dequantize whole groups to inf / NaN.
    w = _weight((8, 64)) * 1e7
    with pytest.raises(ValueError, match=r"weight's scales reach \d\.\d+e\+0\d, past the largest torch\.float16 "
                                         r"\(6\.55e\+04\).*Use a wider scale_dtype"):
        qk.quantize_weight(w, Q.uint4, qk.PerGroup(32), qk.TensorCoreTiledLayout(), scale_dtype=torch.float16,
                           name="weight", **INT4)
    model = torch.nn.Sequential(torch.nn.Linear(64, 8))
    with torch.no_grad():
        model[0].weight.copy_(w)
    with pytest.raises(Exception, match="past the largest torch.float16"):
        qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=32, scale_dtype=torch.float16), strict=True)
    assert type(model[0].weight) is torch.nn.Parameter and torch.equal(model[0].weight, w)  # left as it was


@pytest.mark.parametrize("bad", [torch.int8, "half", 16])
def test_int4_config_scale_dtype_is_checked(bad):
    with pytest.raises(ValueError, match=r"Int4WeightOnlyConfig: scale_dtype must be one of"):
        qk.Int4WeightOnlyConfig(scale_dtype=bad)


def test_kernel_status_reports_the_int4_op():
    rows = [r for r in qk.kernels.status() if r["layout"] == "tensor_core_tiled"]
    assert rows[0]["path"].startswith("torchqkit::linear_int4wo_tiled") and rows[-1]["path"] == "reference"
