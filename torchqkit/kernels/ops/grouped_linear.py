"""torchqkit::grouped_linear_<format>(x, offs, <stack tensors>, ...): rows [offs[g - 1], offs[g]) of x (M, K) through
expert g of a stack of quantized experts, one call for every expert (Note [Grouped linear in C++] in
csrc/cpu/grouped_rows.h; the mixture-of-experts path that calls them: Note [Grouped quantized linear] in
torchqkit/tensor/grouped_linear.py).

    grouped_linear_int4wo_tiled(x, offs, qdata (E, N8/8, Kt/(16T), 32, T/2), scale_and_zero (E, Kt/g, N8, 2),
                                group_size, out_features)
    grouped_linear_int8wo_plain(x, offs, qdata (E, N, K) int8, scale (E, N[, groups]))
    grouped_linear_int8da_int8_plain(x, offs, qdata (E, N, K) int8, scale (E, N), act_symmetric)
    grouped_linear_mxwo(x, offs, qdata, scale)        grouped_linear_fp8wo(x, offs, qdata, scale)
    grouped_linear_nf4wo(x, offs, qdata, scale, scale_codes, scale_block_scale, scale_offset, block_size)
    grouped_linear_intxwo(x, offs, qdata, scale, zero_point, bits, signed, zero_point_domain)
    grouped_linear_nvfp4wo(x, offs, qdata, scale, global_scale)    grouped_linear_fp6wo(x, offs, qdata, scale, ebits)
    grouped_linear_ternarywo(x, offs, planes, scale)
    grouped_linear_int8da_int4_packed(x, offs, qdata, scale, zero_point, act_symmetric, act_group_size, act_bits)
(each tensor of a stack: its 2-d op's tensor with the experts on a new dim 0; the output has the 2-d op's N)

offs: E non-decreasing group ends, each at most M; rows past offs[-1] are zeros. The reference runs each expert with
rows through its 2-d op's reference; the C++ CPU kernel runs the 2-d op's CPU kernels in one loop. No autograd: the
expert stacks are inference weights (QAT of experts trains FakeQuantizedExperts).
"""
from __future__ import annotations

import torch

from ..registry import define_op
from .linear_int4wo_tiled import linear_int4wo_tiled_ref
from .linear_int8da_int8_plain import linear_int8da_int8_plain_ref
from .linear_int8wo_plain import linear_int8wo_plain_ref
from .linear_fp6wo import linear_fp6wo_ref
from .linear_fp8wo import linear_fp8wo_ref
from .linear_int8da_int4_packed import linear_int8da_int4_packed_ref
from .linear_nvfp4wo import linear_nvfp4wo_ref
from .linear_ternarywo import linear_ternarywo_ref
from .linear_intxwo import linear_intxwo_ref
from .linear_mxwo import linear_mxwo_ref
from .linear_nf4wo import linear_nf4wo_ref

__all__ = ["grouped_rows_ref", "grouped_linear_int4wo_tiled_ref", "grouped_linear_int8wo_plain_ref",
           "grouped_linear_int8da_int8_plain_ref", "grouped_linear_mxwo_ref", "grouped_linear_fp8wo_ref",
           "grouped_linear_nf4wo_ref", "grouped_linear_intxwo_ref", "grouped_linear_nvfp4wo_ref",
           "grouped_linear_fp6wo_ref", "grouped_linear_ternarywo_ref", "grouped_linear_int8da_int4_packed_ref"]


def grouped_rows_ref(name: str, x: torch.Tensor, offs: torch.Tensor, n: int, expert_linear) -> torch.Tensor:
    """(M, n) in x's dtype: rows [start, end) of group g are ``expert_linear(rows, g)``, zeros past the last end."""
    torch._check(x.dim() == 2, lambda: f"{name}: x must be 2-d (tokens, features), got {tuple(x.shape)}")
    out = x.new_zeros(x.shape[0], n)
    start = 0
    for g, end in enumerate(offs.tolist()):  # one host sync for all groups
        if end > x.shape[0] or end < start:
            raise RuntimeError(f"{name}: group ends must be non-decreasing and at most the {x.shape[0]} rows of x; "
                               f"offs[{g}] = {end}")
        if end > start:
            out[start:end] = expert_linear(x[start:end], g)
        start = end
    return out


def grouped_linear_int4wo_tiled_ref(x, offs, qdata, scale_and_zero, group_size, out_features):
    return grouped_rows_ref("grouped_linear_int4wo_tiled", x, offs, out_features, lambda rows, g: (
        linear_int4wo_tiled_ref(rows, qdata[g], scale_and_zero[g], group_size, out_features)))


def grouped_linear_int8wo_plain_ref(x, offs, qdata, scale):
    return grouped_rows_ref("grouped_linear_int8wo_plain", x, offs, qdata.shape[1], lambda rows, g: (
        linear_int8wo_plain_ref(rows, qdata[g], scale[g])))


def grouped_linear_int8da_int8_plain_ref(x, offs, qdata, scale, act_symmetric=True):
    return grouped_rows_ref("grouped_linear_int8da_int8_plain", x, offs, qdata.shape[1], lambda rows, g: (
        linear_int8da_int8_plain_ref(rows, qdata[g], scale[g], None, act_symmetric)))


def grouped_linear_mxwo_ref(x, offs, qdata, scale):
    return grouped_rows_ref("grouped_linear_mxwo", x, offs, qdata.shape[1],
                            lambda rows, g: linear_mxwo_ref(rows, qdata[g], scale[g]))


def grouped_linear_fp8wo_ref(x, offs, qdata, scale):
    return grouped_rows_ref("grouped_linear_fp8wo", x, offs, qdata.shape[1],
                            lambda rows, g: linear_fp8wo_ref(rows, qdata[g], scale[g]))


def _expert(t, g):
    return None if t is None else t[g]


def grouped_linear_nf4wo_ref(x, offs, qdata, scale, scale_codes, scale_block_scale, scale_offset, block_size):
    return grouped_rows_ref("grouped_linear_nf4wo", x, offs, qdata.shape[1], lambda rows, g: linear_nf4wo_ref(
        rows, qdata[g], _expert(scale, g), _expert(scale_codes, g), _expert(scale_block_scale, g),
        _expert(scale_offset, g), block_size))


def grouped_linear_intxwo_ref(x, offs, qdata, scale, zero_point, bits, signed, zero_point_domain):
    return grouped_rows_ref("grouped_linear_intxwo", x, offs, qdata.shape[1], lambda rows, g: linear_intxwo_ref(
        rows, qdata[g], scale[g], _expert(zero_point, g), bits, signed, zero_point_domain))


def grouped_linear_nvfp4wo_ref(x, offs, qdata, scale, global_scale):
    return grouped_rows_ref("grouped_linear_nvfp4wo", x, offs, qdata.shape[1],
                            lambda rows, g: linear_nvfp4wo_ref(rows, qdata[g], scale[g], global_scale[g]))


def grouped_linear_fp6wo_ref(x, offs, qdata, scale, ebits):
    return grouped_rows_ref("grouped_linear_fp6wo", x, offs, qdata.shape[1],
                            lambda rows, g: linear_fp6wo_ref(rows, qdata[g], scale[g], ebits))


def grouped_linear_ternarywo_ref(x, offs, planes, scale):
    return grouped_rows_ref("grouped_linear_ternarywo", x, offs, planes.shape[1],
                            lambda rows, g: linear_ternarywo_ref(rows, planes[g], scale[g]))


def grouped_linear_int8da_int4_packed_ref(x, offs, qdata, scale, zero_point, act_symmetric=True, act_group_size=0,
                                          act_bits=8):
    return grouped_rows_ref("grouped_linear_int8da_int4_packed", x, offs, qdata.shape[1], lambda rows, g: (
        linear_int8da_int4_packed_ref(rows, qdata[g], scale[g], _expert(zero_point, g), None, act_symmetric,
                                      act_group_size, act_bits)))


def _define(name: str, schema: str, reference, rows_of=lambda qdata, *_: qdata.shape[1]) -> None:
    """``torchqkit::<name>(Tensor x, Tensor offs, <schema>) -> Tensor``: an (M, N) output, N = ``rows_of(<schema's
    arguments>)`` (default: the stack's dim 1, the experts' rows)."""
    define_op(f"torchqkit::{name}", f"(Tensor x, Tensor offs, {schema}) -> Tensor", reference=reference,
              fake=lambda x, offs, *args: x.new_empty(x.shape[0], rows_of(*args)))


_define("grouped_linear_int4wo_tiled", "Tensor qdata, Tensor scale_and_zero, int group_size, int out_features",
        grouped_linear_int4wo_tiled_ref, rows_of=lambda qdata, sz, g, n: n)
_define("grouped_linear_int8wo_plain", "Tensor qdata, Tensor scale", grouped_linear_int8wo_plain_ref)
_define("grouped_linear_int8da_int8_plain", "Tensor qdata, Tensor scale, bool act_symmetric=True",
        grouped_linear_int8da_int8_plain_ref)
_define("grouped_linear_mxwo", "Tensor qdata, Tensor scale", grouped_linear_mxwo_ref)
_define("grouped_linear_fp8wo", "Tensor qdata, Tensor scale", grouped_linear_fp8wo_ref)
_define("grouped_linear_nf4wo", "Tensor qdata, Tensor? scale, Tensor? scale_codes, Tensor? scale_block_scale, "
        "Tensor? scale_offset, int block_size", grouped_linear_nf4wo_ref)
_define("grouped_linear_intxwo", "Tensor qdata, Tensor scale, Tensor? zero_point, int bits, bool signed, "
        "str zero_point_domain", grouped_linear_intxwo_ref)
_define("grouped_linear_nvfp4wo", "Tensor qdata, Tensor scale, Tensor global_scale", grouped_linear_nvfp4wo_ref)
_define("grouped_linear_fp6wo", "Tensor qdata, Tensor scale, int ebits", grouped_linear_fp6wo_ref)
_define("grouped_linear_ternarywo", "Tensor planes, Tensor scale", grouped_linear_ternarywo_ref)
_define("grouped_linear_int8da_int4_packed", "Tensor qdata, Tensor scale, Tensor? zero_point, bool act_symmetric=True, "
        "int act_group_size=0, int act_bits=8", grouped_linear_int8da_int4_packed_ref)
