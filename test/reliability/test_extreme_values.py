"""Finite weights at the edge of their dtype's range (float32 values of 3e38, a row of 3.4e38, float16 / bfloat16
at their max, values near float32's smallest normal) and float64 weights past float32's range: for every config the
quantized F.linear is finite wherever the float F.linear is, or quantize_ refuses the weight with a message naming
the module and the reason and leaves the model as it was (Note [Finite range] in torchqkit/core/primitives.py)."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.core import qdtypes as Q

from .configs import ACTIVATION_CONFIGS, CONFIGS, config_params

N, K = 32, 128


def _base():
    return torch.randn(N, K, generator=torch.Generator().manual_seed(0))


def _row_at_max():
    w = _base() * 1e-3
    w[3] = 3.4e38 * _base()[3].sign()
    return w


WEIGHTS = {
    "pm-3e38": lambda: _base().sign() * 3e38,
    "row-3.4e38": _row_at_max,
    "tiny": lambda: _base() * 1e-38,
    "float16-max": lambda: (_base().sign() * 65504).half(),
    "bfloat16-max": lambda: (_base().sign() * torch.finfo(torch.bfloat16).max).bfloat16(),
}


def _model(w):
    model = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False, dtype=w.dtype)).eval()
    with torch.no_grad():
        model[0].weight.copy_(w)
    return model


def _input(w):
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(1))
    return (x / (K * 8) if w.abs().max() > 1 else x).to(w.dtype)  # small enough that the float F.linear is finite


@pytest.mark.parametrize("weight", list(WEIGHTS))
@pytest.mark.parametrize("config", config_params())
def test_extreme_weights_give_finite_outputs_or_a_named_refusal(config, weight):
    w = WEIGHTS[weight]()
    model, x = _model(w), _input(w)
    expected = F.linear(x, w)
    assert torch.isfinite(expected).all()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qk.quantize_(model, config, strict=True)
    except qk.QuantizationError as e:
        assert "0.weight" in str(e) and "float32" in str(e), str(e)  # the module and the reason
        assert type(model[0].weight) is torch.nn.Parameter and torch.equal(model[0].weight, w)  # left unchanged
        return
    with torch.no_grad():
        out = model(x)
    assert torch.isfinite(model[0].weight.dequantize()).all()
    assert torch.isfinite(out).all(), f"{weight}: {out}"


def test_float64_weights_past_float32_are_refused_with_the_reason():
    w = _base().double() * 1e300
    model = _model(w)
    with pytest.raises(qk.QuantizationError, match=r"0\.weight \(torch.float64\) reaches .*past float32's largest"):
        qk.quantize_(model, qk.Int8WeightOnlyConfig(), strict=True)
    assert torch.equal(model[0].weight, w)


@pytest.mark.parametrize("qdtype,mapping,zpd", [(Q.int8, "symmetric", None), (Q.int4, "symmetric_no_clipping_err", None),
                                                (Q.uint4, "asymmetric", "float"), (Q.uint4, "asymmetric", "int"),
                                                (Q.float8_e4m3fn, "symmetric", None), (Q.nf4, "symmetric", None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_oracle_dequantizes_a_block_at_the_dtype_max_to_finite_values(qdtype, mapping, zpd, dtype):
    top = torch.finfo(dtype).max
    x = torch.tensor([[-top, -top / 3, 0.0, top / 7, top]], dtype=dtype).repeat(2, 1)
    scale, zp = qk.choose_qparams_affine(x, qdtype, (1, 5), mapping=mapping, zero_point_domain=zpd)
    codes = qk.quantize_affine(x, qdtype, (1, 5), scale, zp, zero_point_domain=zpd)
    out = qk.dequantize_affine(codes, qdtype, (1, 5), scale, zp, zero_point_domain=zpd, output_dtype=dtype)
    assert torch.isfinite(out).all(), out
    assert (out.float() - x.float()).abs().max() <= 0.25 * top  # the ends lose at most a step, not their sign


def test_a_block_away_from_the_edge_keeps_its_qparams_bit_for_bit():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3)) * 1e30
    scale, zp = qk.choose_qparams_affine(x, Q.uint4, (1, 32), mapping="asymmetric", zero_point_domain="float")
    lo, hi = x.reshape(8, 2, 32).amin(-1), x.reshape(8, 2, 32).amax(-1)
    assert torch.equal(scale, (hi - lo) / 15)
    assert torch.equal(zp, lo - (0 - 8) * scale)


def _reference_twin(name):
    return pytest.param(dataclasses.replace(CONFIGS[name], kernel_preference="reference"), id=f"{name}-reference")


def _activation_params():
    return list(config_params(ACTIVATION_CONFIGS)) + [_reference_twin("int8da-int4"),
                                                      _reference_twin("int8da-int4-float-zero")]


@pytest.mark.parametrize("config", _activation_params())
def test_huge_finite_activations_into_activation_configs_stay_finite(config):
    model = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False)).eval()
    with torch.no_grad():
        model[0].weight.copy_(_base() * 1e-4)
    qk.quantize_(model, config, strict=True)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(2)).sign() * 3e38
    with torch.no_grad():
        expected, out = F.linear(x, model[0].weight.dequantize()), model(x)
    assert torch.isfinite(expected).all()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["int8da-int4", "int8da-int4-float-zero"])
def test_kernel_activation_scales_at_float32s_edge_match_the_oracle(name):
    """The C++ activation quantizer takes a row's range and caps its scale as the oracle does (Note [Finite
    range]): outputs at float32's edge agree with the reference path's to float32 rounding."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(K, N, bias=False) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    qk.quantize_(layers[0], CONFIGS[name], strict=True)
    qk.quantize_(layers[1], dataclasses.replace(CONFIGS[name], kernel_preference="reference"), strict=True)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(3)) * 1e37
    x[:, 0], x[:, 1] = 3.4e38, -3.4e38  # hi - lo overflows float32
    with torch.no_grad():
        out, ref = layers[0](x), layers[1](x)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=0)
