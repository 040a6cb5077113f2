"""Every torchqkit custom op: its schema and its fake impl (shapes and dtypes only), side by side.

Op names say the math and the format, never the device (see STYLE.md §2); the dispatch key picks the
backend. Each op also has a pure-PyTorch reference (``reference.py``, registered for every device as the
CompositeExplicitAutograd kernel) and, where built, a C++ CPU kernel (``csrc/cpu``, registered for the
CPU dispatch key, which takes precedence over the reference).

Ops
---
linear_int8wo_plain(x, qdata, scale, bias)
    Weight-only int8 linear on PlainLayout bytes: ``y = x @ (qdata * scale).T + bias``.
    x: (..., K) float32 / bfloat16 / float16; qdata: (N, K) int8 codes (symmetric, no zero point);
    scale: (N, G), G dividing K (G = 1: per channel, else group size K / G); bias: (N) or None.
    Returns (..., N) in x.dtype; computed in float32.
linear_int8da_int8_plain(x, qdata, scale, bias, act_symmetric)
    int8 dynamic activation x int8 weight: each row of x is quantized per token inside the op (symmetric,
    or asymmetric with an integer zero point; the oracle's choose_qparams / quantize_affine numerics),
    then an exact integer matmul, then ``* act_scale * scale + bias``.
    qdata: (N, K) int8 symmetric per-channel codes; scale: (N, 1). Returns (..., N) in x.dtype.
"""
from __future__ import annotations

import torch

__all__ = ["OPS"]

OPS = ("torchqkit::linear_int8wo_plain", "torchqkit::linear_int8da_int8_plain")
# GPU-first ops: CUDA C++ and Triton backends; everywhere else their reference. See GPU_OPS_DOC.
GPU_OPS = ("torchqkit::linear_int4wo_tiled", "torchqkit::linear_nf4wo", "torchqkit::linear_fp8wo",
           "torchqkit::linear_mxwo", "torchqkit::scaled_mm_fp8_rowwise")
# Weight-only ops whose CPU kernels read the packed layouts' bytes (csrc/cpu/linear_lowbit*.cpp).
# linear_nf4wo and linear_fp8wo are GPU_OPS too; linear_intxwo is defined below.
LOWBIT_CPU_OPS = ("torchqkit::linear_nf4wo", "torchqkit::linear_fp8wo", "torchqkit::linear_intxwo",
                  "torchqkit::linear_mxwo")
_DEFINED: list[str] = []  # every op this module defines, in order: ALL_OPS (at the end) is derived from it


def _define(qualname: str, schema: str) -> None:
    torch.library.define(qualname, schema)
    _DEFINED.append(qualname)


def _linear_out(x, qdata, name):
    torch._check(qdata.dim() == 2, lambda: f"{name}: qdata must be 2-D (N, K), got {tuple(qdata.shape)}")
    torch._check(x.shape[-1] == qdata.shape[1],
                 lambda: f"{name}: x has {x.shape[-1]} features but the weight has K = {qdata.shape[1]}")
    return x.new_empty(*x.shape[:-1], qdata.shape[0])


_define(
    "torchqkit::linear_int8wo_plain",
    "(Tensor x, Tensor qdata, Tensor scale, Tensor? bias=None) -> Tensor")


@torch.library.register_fake("torchqkit::linear_int8wo_plain")
def _linear_int8wo_plain_fake(x, qdata, scale, bias=None):
    return _linear_out(x, qdata, "linear_int8wo_plain")


_define(
    "torchqkit::linear_int8da_int8_plain",
    "(Tensor x, Tensor qdata, Tensor scale, Tensor? bias=None, bool act_symmetric=True) -> Tensor")


@torch.library.register_fake("torchqkit::linear_int8da_int8_plain")
def _linear_int8da_int8_plain_fake(x, qdata, scale, bias=None, act_symmetric=True):
    return _linear_out(x, qdata, "linear_int8da_int8_plain")


GPU_OPS_DOC = """
linear_int4wo_tiled(x, qdata, scale_and_zero, group_size, out_features, bias)
    TensorCoreTiledLayout bytes as stored: qdata int32 [N8/8][Kt/(16T)][32][T/2], scale_and_zero
    [Kt/g][N8][2]; w = (q - 8) * scale + zero. x: (..., K) with K = in_features <= Kt.
linear_nf4wo(x, qdata, scale, scale_codes, scale_block_scale, scale_offset, block_size, bias)
    NF4Layout bytes: qdata (N, K/2) uint8 (high nibble first); absmax either ``scale`` (N, K/B) or, with
    double quantization, scale_codes (N, K/B) int8 * scale_block_scale[flat // 256] + scale_offset.
linear_fp8wo(x, qdata, scale, bias)
    Float8Layout bytes: qdata (N, K) float8_e4m3fn / e5m2; scale (N/bn, K/bk) float32 (per tensor, row, block).
linear_mxwo(x, qdata, scale, bias)
    MXLayout bytes: qdata (N, K/2) uint8 MXFP4 (low nibble first) or (N, K) float8 MXFP8; scale (N, K/32)
    uint8 E8M0.
scaled_mm_fp8_rowwise(a, b, scale_a, scale_b, bias, out_dtype)
    a (M, K) and b (N, K) float8 codes, scale_a (M, 1), scale_b (N, 1) float32: a @ b.T * scale_a * scale_b.T.
"""


def _check_x(x, k, name):
    torch._check(x.shape[-1] == k, lambda: f"{name}: x has {x.shape[-1]} features but the weight has K = {k}")


_define(
    "torchqkit::linear_int4wo_tiled",
    "(Tensor x, Tensor qdata, Tensor scale_and_zero, int group_size, int out_features, Tensor? bias=None) -> Tensor")


@torch.library.register_fake("torchqkit::linear_int4wo_tiled")
def _linear_int4wo_tiled_fake(x, qdata, scale_and_zero, group_size, out_features, bias=None):
    torch._check(qdata.dim() == 4, lambda: f"linear_int4wo_tiled: qdata must be 4-d tiles, got {tuple(qdata.shape)}")
    return x.new_empty(*x.shape[:-1], out_features)


_define(
    "torchqkit::linear_nf4wo",
    "(Tensor x, Tensor qdata, Tensor? scale, Tensor? scale_codes, Tensor? scale_block_scale, Tensor? scale_offset, "
    "int block_size, Tensor? bias=None) -> Tensor")


@torch.library.register_fake("torchqkit::linear_nf4wo")
def _linear_nf4wo_fake(x, qdata, scale, scale_codes, scale_block_scale, scale_offset, block_size, bias=None):
    _check_x(x, 2 * qdata.shape[1], "linear_nf4wo")
    return x.new_empty(*x.shape[:-1], qdata.shape[0])


_define("torchqkit::linear_fp8wo", "(Tensor x, Tensor qdata, Tensor scale, Tensor? bias=None) -> Tensor")


@torch.library.register_fake("torchqkit::linear_fp8wo")
def _linear_fp8wo_fake(x, qdata, scale, bias=None):
    return _linear_out(x, qdata, "linear_fp8wo")


_define("torchqkit::linear_mxwo", "(Tensor x, Tensor qdata, Tensor scale, Tensor? bias=None) -> Tensor")


@torch.library.register_fake("torchqkit::linear_mxwo")
def _linear_mxwo_fake(x, qdata, scale, bias=None):
    _check_x(x, 32 * scale.shape[1], "linear_mxwo")
    return x.new_empty(*x.shape[:-1], qdata.shape[0])


_define(
    "torchqkit::scaled_mm_fp8_rowwise",
    "(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias=None, ScalarType out_dtype=float) -> Tensor")


@torch.library.register_fake("torchqkit::scaled_mm_fp8_rowwise")
def _scaled_mm_fp8_rowwise_fake(a, b, scale_a, scale_b, bias=None, out_dtype=torch.float32):
    _check_x(a, b.shape[1], "scaled_mm_fp8_rowwise")
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


# linear_intxwo(x, qdata, scale, zero_point, bits, signed, zero_point_domain, bias)
#     PackedIntxLayout bytes (not ternary): qdata (N, ceil(K * bits / 8)) uint8, bits 1..7, each row a
#     little-endian stream of offset-binary fields u = q - qmin (Note [Packed intx bits]); scale (N / bn, K / bk)
#     and zero_point (same shape, or None) as the oracle stores them; zero_point_domain "none" | "int" | "float".
#     w = dequantize_affine(u + qmin, int<bits> / uint<bits>, (bn, bk), scale, zero_point). Returns (..., N).
_define(
    "torchqkit::linear_intxwo",
    "(Tensor x, Tensor qdata, Tensor scale, Tensor? zero_point, int bits, bool signed, str zero_point_domain, "
    "Tensor? bias=None) -> Tensor")


@torch.library.register_fake("torchqkit::linear_intxwo")
def _linear_intxwo_fake(x, qdata, scale, zero_point, bits, signed, zero_point_domain, bias=None):
    torch._check(qdata.dim() == 2 and qdata.shape[1] == -(-x.shape[-1] * bits // 8),
                 lambda: f"linear_intxwo: qdata must be (N, ceil(K * bits / 8)) for K = {x.shape[-1]}, bits = {bits}, "
                         f"got {tuple(qdata.shape)}")
    return x.new_empty(*x.shape[:-1], qdata.shape[0])


# linear_int8da_int4_packed(x, qdata, scale, zero_point, bias, act_symmetric)  (CPU kernel)
#     int8 dynamic activation (per token, quantized inside the op like linear_int8da_int8_plain) x int4
#     PackedIntxLayout bytes: qdata (N, ceil(K / 2)) uint8, code k in byte k // 2, low nibble first, stored
#     as u = q + 8; scale (N, G) group-wise (G = K / group_size) or per channel (G = 1); zero_point None or
#     integer codes shaped like scale: w = (q - zero_point) * scale. Returns (..., N) in x.dtype.
INT8DA_INT4_OP = "torchqkit::linear_int8da_int4_packed"
_define(
    INT8DA_INT4_OP,
    "(Tensor x, Tensor qdata, Tensor scale, Tensor? zero_point, Tensor? bias=None, bool act_symmetric=True) -> Tensor")


@torch.library.register_fake(INT8DA_INT4_OP)
def _linear_int8da_int4_packed_fake(x, qdata, scale, zero_point, bias=None, act_symmetric=True):
    torch._check(qdata.dim() == 2 and qdata.shape[1] == (x.shape[-1] + 1) // 2,
                 lambda: f"linear_int8da_int4_packed: qdata must be (N, ceil(K / 2)) for K = {x.shape[-1]}, "
                         f"got {tuple(qdata.shape)}")
    return x.new_empty(*x.shape[:-1], qdata.shape[0])

ALL_OPS = tuple(_DEFINED)  # every torchqkit op, linear_int8da_int4_packed included
