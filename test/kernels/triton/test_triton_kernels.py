"""Every Triton kernel under TRITON_INTERPRET=1 (set by test/conftest.py) against its reference, on small
odd shapes: M = 1, 3, 33; K at the smallest size the format allows; N not a multiple of the column block
(37; 70 spans two blocks of 64). Weights come from quantize_, so the kernels read the layouts' real bytes.

Activations are float16 and float32, never bfloat16: the interpreter computes bf16 ``tl.dot`` wrongly
(triton-lang/triton#11584; docs/platform.md), so a bf16 test would test the interpreter, not the kernel.

Tolerances: float32 activations run ``tl.dot`` with IEEE precision, so only summation order differs from
the float32 reference: 1e-4. float16 activations multiply float16-rounded dequantized weights (half an
ulp, 2^-11 relative, per weight) and store a float16 output: 1e-2 absolute + relative on outputs of
magnitude ~ 1..30. float8 row-wise: both operands decode exactly to float16 and products are exact in
float32, so only summation order and the final cast differ: 1e-4 (float32 out).

On a GPU (the ``device`` fixture's "cuda" case, ``pytest -m gpu``: test/devices.py) the same tests compile the
kernels natively and add what the interpreter can't check: bfloat16 activations, whose dequantized weights round
to 8 bits (2^-9 relative) and whose outputs are bfloat16: 3e-2; and a prefill M of 256 (the GEMMs' big tiles).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.core.qdtype import float8_e5m2
from torchqkit.kernels import reference
from torchqkit.kernels.triton import (INTERPRET, float8_rowwise, int4_tiled_gemm, int4_tiled_gemv, int8_weight_only,
                                      mx_weight_only, nf4_weight_only)

MS = [1, 3, 33, 256]
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.float32, id="fp32"),
          pytest.param(torch.bfloat16, id="bf16")]
TOL = {torch.float16: dict(atol=1e-2, rtol=1e-2), torch.float32: dict(atol=1e-4, rtol=1e-4),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _check_case(device, m=1, dtype=torch.float32):
    """Skip what only a GPU can check (the module docstring says why); the rest runs everywhere."""
    if device == "cpu" and not INTERPRET:
        pytest.skip("Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter computes bf16 tl.dot wrongly (triton-lang/triton#11584): bf16 runs on the GPU")
    if device == "cpu" and m > 64:
        pytest.skip("prefill-sized M runs on the GPU; the interpreter takes small shapes")


def _weight(config, n, k, dtype, device="cpu"):
    torch.manual_seed(n * 1000 + k)
    lin = torch.nn.Linear(k, n, bias=False).to(device=device, dtype=dtype)
    qk.quantize_(lin, config)
    return lin.weight


def _x(m, k, dtype, bias_n=None, device="cpu"):
    torch.manual_seed(m)
    x = torch.randn(m, k, dtype=dtype).to(device)
    return x, (torch.randn(bias_n, dtype=dtype).to(device) if bias_n else None)


def _expected(x, w, bias):
    """What every kernel must compute: F.linear with the dequantized weight, in float32."""
    return F.linear(x.float(), w.dequantize().float(), None if bias is None else bias.float())


# ------------------------------------------------------------------------------------------------
# int4 tensor-core tiled: the GEMM and the split-K GEMV, each on every M, and the op's M switch
# ------------------------------------------------------------------------------------------------
# Smallest legal K: one group of 32 with inner_k_tiles = 2 (one 32-wide k-chunk); 128 with the default 8.
INT4_CASES = [pytest.param(32, 32, 2, id="K32-g32-T2"), pytest.param(128, 64, 8, id="K128-g64-T8")]


@pytest.mark.parametrize("kernel", ["gemm", "gemv"])
@pytest.mark.parametrize("k,group,tiles", INT4_CASES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_tiled(kernel, k, group, tiles, m, dtype, device):
    _check_case(device, m, dtype)
    n = 37
    w = _weight(qk.Int4WeightOnlyConfig(group_size=group, layout=qk.TensorCoreTiledLayout(inner_k_tiles=tiles)),
                n, k, dtype, device)
    x, bias = _x(m, k, dtype, n, device)
    launch = int4_tiled_gemm.launch_gemm if kernel == "gemm" else int4_tiled_gemv.launch
    out = launch(x, w.qdata, w.scale_and_zero, group, n, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), _expected(x, w, bias), **TOL[dtype])


@pytest.mark.parametrize("m", [1, 33])
def test_int4_tiled_op_picks_gemv_for_decode_and_gemm_otherwise(m, monkeypatch, device):
    _check_case(device)
    calls = []
    for mod, name in ((int4_tiled_gemv, "launch"), (int4_tiled_gemm, "launch_gemm")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    w = _weight(qk.Int4WeightOnlyConfig(group_size=32, layout=qk.TensorCoreTiledLayout(inner_k_tiles=2)),
                70, 32, torch.float32, device)
    x = torch.randn(2, (m + 1) // 2, 32, device=device)  # leading dims are flattened
    out = torch.ops.torchqkit_triton.linear_int4wo_tiled(x, w.qdata, w.scale_and_zero, 32, 70)
    assert calls == (["launch"] if m == 1 else ["launch_gemm"])
    torch.testing.assert_close(out.reshape(-1, 70), _expected(x.reshape(-1, 32), w, None), **TOL[torch.float32])


# ------------------------------------------------------------------------------------------------
# int8 weight-only, NF4 (with and without double quantization), MXFP4 / MXFP8
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("group", [pytest.param(None, id="per-channel"), pytest.param(16, id="g16")])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_weight_only(group, m, dtype, device):
    _check_case(device, m, dtype)
    n, k = 70, 32  # smallest K with two groups of 16
    w = _weight(qk.Int8WeightOnlyConfig(group_size=group), n, k, dtype, device)
    x, bias = _x(m, k, dtype, n, device)
    out = torch.ops.torchqkit_triton.linear_int8wo_plain(x, w.qdata, w.scale, bias)
    torch.testing.assert_close(out.float(), _expected(x, w, bias), **TOL[dtype])


@pytest.mark.parametrize("double_quant", [False, True], ids=["absmax", "double-quant"])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nf4(double_quant, m, dtype, device):
    _check_case(device, m, dtype)
    n, k = 37, 64  # K = one NF4 block of 64
    w = _weight(qk.NF4WeightOnlyConfig(block_size=64, double_quant=double_quant), n, k, dtype, device)
    assert (w.scale is None) == double_quant
    x, bias = _x(m, k, dtype, n, device)
    out = torch.ops.torchqkit_triton.linear_nf4wo(x, w.qdata, w.scale, w.scale_codes, w.scale_block_scale,
                                                  w.scale_offset, 64, bias)
    torch.testing.assert_close(out.float(), _expected(x, w, bias), **TOL[dtype])


def test_nf4_double_quant_spans_several_second_level_groups(device):
    """260 rows x 1 block: the 8-bit absmax codes span two groups of 256 (two block scales)."""
    _check_case(device)
    w = _weight(qk.NF4WeightOnlyConfig(block_size=64, double_quant=True), 260, 64, torch.float32, device)
    assert w.scale_block_scale.numel() == 2
    x, _ = _x(3, 64, torch.float32, device=device)
    out = torch.ops.torchqkit_triton.linear_nf4wo(x, w.qdata, None, w.scale_codes, w.scale_block_scale,
                                                  w.scale_offset, 64)
    torch.testing.assert_close(out, _expected(x, w, None), **TOL[torch.float32])


@pytest.mark.parametrize("config", [pytest.param(qk.MXFP4WeightOnlyConfig(), id="mxfp4"),
                                    pytest.param(qk.MXFP8WeightOnlyConfig(), id="mxfp8")])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mx(config, m, dtype, device):
    _check_case(device, m, dtype)
    n, k = 37, 32  # K = one MX block
    w = _weight(config, n, k, dtype, device)
    x, bias = _x(m, k, dtype, n, device)
    out = torch.ops.torchqkit_triton.linear_mxwo(x, w.qdata, w.scale, bias)
    torch.testing.assert_close(out.float(), _expected(x, w, bias), **TOL[dtype])


@pytest.mark.parametrize("config", [pytest.param(qk.NVFP4WeightOnlyConfig(), id="nvfp4"),
                                    pytest.param(qk.FP6WeightOnlyConfig(), id="fp6-e3m2-row"),
                                    pytest.param(qk.FP6WeightOnlyConfig(ebits=2, group_size=16), id="fp6-e2m3-g16")])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_and_fp6(config, m, dtype, device):
    _check_case(device, m, dtype)
    n, k = 37, 48  # K = three NVFP4 blocks, 36 bytes of FP6 codes: a 64-wide K step reads past K (masked)
    w = _weight(config, n, k, dtype, device)
    x, bias = _x(m, k, dtype, n, device)
    if isinstance(w.qlayout, qk.NVFP4Layout):
        out = torch.ops.torchqkit_triton.linear_nvfp4wo(x, w.qdata, w.scale, w.global_scale, bias)
    else:
        out = torch.ops.torchqkit_triton.linear_fp6wo(x, w.qdata, w.scale, 3 if w.qdtype.name == "fp6_e3m2" else 2,
                                                      bias)
    torch.testing.assert_close(out.float(), _expected(x, w, bias), **TOL[dtype])


@pytest.mark.parametrize("config", [
    pytest.param(qk.IntxWeightOnlyConfig(bits=3, granularity=qk.PerGroup(16)), id="bits3-sym-g16"),
    pytest.param(qk.IntxWeightOnlyConfig(bits=5, granularity=qk.PerRow(), mapping="asymmetric"), id="bits5-asym-row"),
    pytest.param(qk.IntxWeightOnlyConfig(bits=2, granularity=qk.PerGroup(16), algorithm="hqq"), id="bits2-hqq-g16"),
    pytest.param(qk.IntxWeightOnlyConfig(bits=7, granularity=qk.PerGroup(16)), id="bits7-g16"),
    pytest.param(qk.Int4DynamicActivationInt4WeightConfig(group_size=16), id="w4a4-g16"),
])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_intx(config, m, dtype, device):
    _check_case(device, m, dtype)
    n, k = 37, 48  # 48 * bits / 8 bytes: a 64-wide K step reads past K (masked); bits 3 / 5 / 7 fields cross bytes
    w = _weight(config, n, k, dtype, device)
    x, bias = _x(m, k, dtype, n, device)
    out = torch.ops.torchqkit_triton.linear_intxwo(x, w.qdata, w.scale, w.zero_point, w.qdtype.bits,
                                                   w.qdtype.signed, w.zero_point_domain.value, bias)
    torch.testing.assert_close(out.float(), _expected(x, w, bias), **TOL[dtype])


@pytest.mark.parametrize("k,granularity", [pytest.param(48, qk.PerGroup(16), id="K48-g16"),
                                           pytest.param(40, qk.PerRow(), id="K40-row")])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ternary(k, granularity, m, dtype, device):
    _check_case(device, m, dtype)
    n = 37
    config = qk.IntxWeightOnlyConfig(bits=2, granularity=granularity, mapping="symmetric_no_clipping_err",
                                     layout=qk.PackedIntxLayout(ternary=True))
    w = _weight(config, n, k, dtype, device)
    assert set(w.dequantize().sign().unique().tolist()) == {-1.0, 0.0, 1.0}
    x, bias = _x(m, k, dtype, n, device)
    out = torch.ops.torchqkit_triton.linear_ternarywo(x, w.qdata, w.scale, bias)
    torch.testing.assert_close(out.float(), _expected(x, w, bias), **TOL[dtype])


@pytest.mark.parametrize("make, message", [
    (lambda x, w: torch.ops.torchqkit_triton.linear_intxwo(x, w.qdata, w.scale, None, 4, True, "none"),
     r"qdata \(N, ceil\(K \* bits / 8\)\) uint8 for K = 48"),
    (lambda x, w: torch.ops.torchqkit_triton.linear_intxwo(x, w.qdata, w.scale, None, 3, True, "int"),
     "'int' or 'float' with one"),
    (lambda x, w: torch.ops.torchqkit_triton.linear_ternarywo(x, w.qdata, w.scale),
     r"planes must be \(N, 2 \* ceil\(K / 8\)\) uint8 for K = 48"),
], ids=["intx-bits", "intx-zero-point", "ternary-planes"])
def test_packed_intx_bad_input(make, message):
    if not INTERPRET:
        pytest.skip("Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    w = _weight(qk.IntxWeightOnlyConfig(bits=3, granularity=qk.PerGroup(16)), 37, 48, torch.float32)
    with pytest.raises(ValueError, match=message):
        make(torch.randn(2, 48), w)


@pytest.mark.parametrize("config", [
    pytest.param(qk.Float8WeightOnlyConfig(), id="e4m3fn-per-row"),
    pytest.param(qk.Float8WeightOnlyConfig(weight_dtype=float8_e5m2, granularity=qk.PerTensor()), id="e5m2-tensor"),
    pytest.param(qk.Float8WeightOnlyConfig(granularity=qk.PerBlock((8, 16))), id="e4m3fn-block8x16"),
    pytest.param(qk.Float8WeightOnlyConfig(weight_dtype="float8_e4m3fnuz"), id="e4m3fnuz-per-row"),
    pytest.param(qk.Float8WeightOnlyConfig(weight_dtype="float8_e5m2fnuz", granularity=qk.PerBlock((8, 16))),
                 id="e5m2fnuz-block8x16"),
])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_float8_weight_only(config, m, dtype, device):
    _check_case(device, m, dtype)
    n, k = 40, 32  # K: two 16-wide scale blocks; N = 5 blocks of 8, not a multiple of the 64-column tile
    w = _weight(config, n, k, dtype, device)
    x, bias = _x(m, k, dtype, n, device)
    out = torch.ops.torchqkit_triton.linear_fp8wo(x, w.qdata, w.scale, bias)
    torch.testing.assert_close(out.float(), _expected(x, w, bias), **TOL[dtype])


# ------------------------------------------------------------------------------------------------
# float8 row-wise scaled matmul; every e4m3fn / e5m2 / e4m3fnuz / e5m2fnuz byte decodes to its float8 value
# ------------------------------------------------------------------------------------------------

FLOAT8 = [pytest.param(torch.float8_e4m3fn, id="e4m3fn"), pytest.param(torch.float8_e5m2, id="e5m2"),
          pytest.param(torch.float8_e4m3fnuz, id="e4m3fnuz"), pytest.param(torch.float8_e5m2fnuz, id="e5m2fnuz")]


@pytest.mark.parametrize("fmt", FLOAT8)
@pytest.mark.parametrize("m", MS)
def test_float8_rowwise(fmt, m, device):
    _check_case(device, m)
    n, k = 37, 16  # K = one tl.dot step
    torch.manual_seed(m)
    a = (torch.randn(m, k) * 8).to(fmt).to(device)
    b = (torch.randn(n, k) * 8).to(fmt).to(device)
    sa, sb, bias = (t.to(device) for t in (torch.rand(m, 1) + 0.5, torch.rand(n, 1) + 0.5, torch.randn(n)))
    out = torch.ops.torchqkit_triton.scaled_mm_fp8_rowwise(a, b, sa, sb, bias, torch.float32)
    torch.testing.assert_close(out, reference.scaled_mm_fp8_rowwise_ref(a, b, sa, sb, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", FLOAT8)
def test_float8_decoder_covers_every_byte(fmt, device):
    """All 256 bytes but NaN and inf through the kernel: row i of a holds byte i, b is the identity; fnuz's NaN
    byte 0x80 decodes to NaN (e4m3fn's NaN bytes are not produced: its decoder reads them as +-480)."""
    _check_case(device)
    codes = torch.arange(256, dtype=torch.uint8).view(fmt)
    finite = codes.float().isfinite()
    a = codes[finite].reshape(-1, 1).to(device)
    eye = torch.ones(1, 1).to(fmt).to(device)
    out = float8_rowwise.scaled_mm_fp8_rowwise(a, eye, torch.ones(a.shape[0], 1, device=device),
                                               torch.ones(1, 1, device=device))
    torch.testing.assert_close(out, a.float(), atol=0, rtol=0)
    if fmt in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        nan = codes[128:129].reshape(1, 1).to(device)
        assert float8_rowwise.scaled_mm_fp8_rowwise(nan, eye, torch.ones(1, 1, device=device),
                                                    torch.ones(1, 1, device=device)).isnan().all()


# ------------------------------------------------------------------------------------------------
# registration: the interpreter path is a custom op with a fake impl, so it compiles and passes opcheck
# ------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not INTERPRET, reason="the interpreter registration: TRITON_INTERPRET=1")
def test_interpreter_ops_pass_opcheck():
    w = _weight(qk.Int8WeightOnlyConfig(), 37, 16, torch.float32)
    x, bias = _x(3, 16, torch.float32, 37)
    torch.library.opcheck(torch.ops.torchqkit_triton.linear_int8wo_plain.default, (x, w.qdata, w.scale, bias))


@pytest.mark.skipif(not INTERPRET, reason="the interpreter registration: TRITON_INTERPRET=1")
def test_interpreter_op_compiles_fullgraph():
    w = _weight(qk.MXFP4WeightOnlyConfig(), 37, 32, torch.float32)
    x, _ = _x(3, 32, torch.float32)
    fn = torch.compile(lambda x: torch.ops.torchqkit_triton.linear_mxwo(x, w.qdata, w.scale), fullgraph=True)
    torch.testing.assert_close(fn(x), mx_weight_only.linear_mxwo(x, w.qdata, w.scale), atol=0, rtol=0)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter registration: TRITON_INTERPRET=1")
def test_launchers_raise_on_wrong_inputs():
    w = _weight(qk.Int8WeightOnlyConfig(), 37, 16, torch.float32)
    with pytest.raises(ValueError, match="int8 qdata"):
        int8_weight_only.linear_int8wo_plain(torch.randn(2, 17), w.qdata, w.scale)
    with pytest.raises(ValueError, match="scale_codes"):
        nf4_weight_only.linear_nf4wo(torch.randn(2, 64), torch.zeros(3, 32, dtype=torch.uint8), None, None, None,
                                     None, 64)


def test_nf4_level_select_tree_is_the_oracle_table(device):
    """One weight row holding every code once, absmax 1: the kernel's output is the level table itself."""
    from torchqkit.core.qdtype import nf4
    _check_case(device)
    codes = torch.arange(16, dtype=torch.uint8)
    qdata = ((codes[0::2] << 4) | codes[1::2]).reshape(1, 8).to(device)   # high nibble = even k
    eye = torch.eye(16, device=device)
    out = nf4_weight_only.linear_nf4wo(eye, qdata, torch.ones(1, 1, device=device), None, None, None, 16)  # (16, 1)
    torch.testing.assert_close(out.reshape(16).cpu(), torch.tensor(nf4.levels), atol=0, rtol=0)
