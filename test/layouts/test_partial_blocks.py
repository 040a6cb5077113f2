"""Weights whose in_features no group divides (Note [Partial blocks], core/primitives.py), through the C++
kernels at every ISA level this CPU runs: decode (M = 1), a small batch, and a prefill-sized M, against the
reference (dequantize + F.linear). The conformance suite covers the rest (dequantize, slicing, checkpoints,
compile) for the same cases."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.layouts.routes import reference_linear

from ..kernels.cpu_kernel_testing import cpu_levels, gen
from .conformance_cases import all_cases

PARTIAL = [pytest.param(layout, kwargs, shape, id=f"{layout.name}-{cid}")
           for layout, cid, shape, kwargs in all_cases() if "partial" in cid or "less-than" in cid]
LEVELS = cpu_levels("torchqkit::linear_int4wo_tiled") or ["none"]


def _quantize(layout_cls, kwargs, shape):
    kwargs = dict(kwargs)
    layout = kwargs.pop("layout", None) or layout_cls()
    w = torch.randn(shape, generator=gen(3))
    return qk.quantize_weight(w, kwargs.pop("qdtype"), kwargs.pop("granularity"), layout, **kwargs)


def test_every_layout_has_a_partial_block_case():
    assert {p.values[0].name for p in PARTIAL} == {L.name for L in qk.layouts.all_layouts()}


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("layout,kwargs,shape", PARTIAL)
def test_kernels_agree_with_the_reference_on_the_logical_k(layout, kwargs, shape, m, isa, monkeypatch):
    if isa != "none":
        monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    aqt = _quantize(layout, kwargs, shape)
    x = torch.randn(m, shape[1], generator=gen(4))
    bias = torch.randn(shape[0], generator=gen(5))
    out = F.linear(x, aqt, bias)
    assert out.shape == (m, shape[0])
    # The same codes summed in another order (and in int32 on the integer-activation paths).
    torch.testing.assert_close(out, reference_linear(aqt, x, bias), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout,kwargs,shape", PARTIAL)
def test_padding_is_storage_only(layout, kwargs, shape):
    aqt = _quantize(layout, kwargs, shape)
    assert tuple(aqt.shape) == shape and aqt.dequantize().shape == shape
    # Bytes: at least the codes of the logical weight (of its kept n / m for an N:M layout), and the padding is
    # counted (not hidden).
    kept = aqt.qlayout.n / aqt.qlayout.m if isinstance(aqt.qlayout, qk.NMSparseLayout) else 1
    assert aqt.packed_nbytes() >= shape[0] * shape[1] * kept * aqt.qdtype.bits // 8
    specs = aqt.qlayout.packed_specs(aqt.weight_format)
    for name, t in aqt.inner_tensors().items():
        if t is not None:
            assert tuple(t.shape) == specs[name].shape, name
