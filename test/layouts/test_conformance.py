"""The conformance suite every layout passes: pack/unpack exactness, dequantize == oracle, linear and
mm/addmm in both orientations, slicing at block boundaries (aliasing the storage), copy_, to/clone/
detach, weights_only save/load, torch.compile(fullgraph=True) == eager, and the loud unsupported-op error."""
from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.core import choose_qparams_affine, dequantize_affine, quantize_affine
from torchqkit.layouts import all_layouts
from torchqkit.layouts.routes import reference_linear

from .conformance_cases import CASES, all_cases

CASE_PARAMS = [pytest.param(layout, kwargs, shape, id=f"{layout.name}-{cid}") for layout, cid, shape, kwargs in all_cases()]


def _weight(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def _quantize(layout_cls, kwargs, shape, seed=0):
    kwargs = dict(kwargs)
    layout = kwargs.pop("layout", None) or layout_cls()  # a case may give the layout's knobs as an instance
    return qk.quantize_weight(_weight(shape, seed), kwargs.pop("qdtype"), kwargs.pop("granularity"), layout,
                              **kwargs)


def _slice_step(aqt, dim, at_least=1):
    """A slice length along ``dim`` that the layout can cut twice in a row (whole blocks and storage tiles,
    see Layout.slice_multiple), or the whole dim when it can't."""
    size, b = aqt.logical_shape[dim], aqt.block_size[dim]
    m = aqt.qlayout.slice_multiple(aqt.weight_format, dim)
    m = m if b == size else math.lcm(m, b)
    if b == size and m == 1:
        return size  # one block and no tiles: slicing shrinks the block; the whole dim is the useful case
    step = m * -(-at_least // m)
    return step if 2 * step <= size else size


def test_every_layout_enrolled():
    missing = [L.name for L in all_layouts() if not CASES.get(L.name)]
    assert not missing, f"layouts without conformance cases in conformance_cases.py: {missing}"


@pytest.mark.parametrize("layout,kwargs,shape", CASE_PARAMS)
class TestLayoutConformance:
    def test_unpack_equals_oracle_and_dequantize_bit_exact(self, layout, kwargs, shape):
        aqt = _quantize(layout, kwargs, shape)
        w = _weight(shape)
        q = kwargs["qdtype"]
        opts = {k: kwargs[k] for k in ("mapping", "zero_point_domain", "scale_rounding") if k in kwargs}
        scale, zp = choose_qparams_affine(w, q, aqt.block_size, **opts)
        codes = quantize_affine(w, q, aqt.block_size, scale, zp, zero_point_domain=aqt.zero_point_domain)
        scale = aqt.qlayout.stored_scale(scale)  # what a layout keeps of the oracle's scale (Layout.stored_scale)
        parts = aqt.qlayout.unpack(aqt)
        oracle = dequantize_affine(codes, q, aqt.block_size, scale, zp, zero_point_domain=aqt.zero_point_domain)
        if parts.mask is not None:  # a layout storing some entries: the others read as the code of 0.0, and as 0
            zero_codes = quantize_affine(torch.zeros(shape), q, aqt.block_size, scale, zp,
                                         zero_point_domain=aqt.zero_point_domain)
            codes = torch.where(parts.mask, codes, zero_codes)
            oracle = torch.where(parts.mask, oracle, torch.zeros(()))
        assert torch.equal(parts.qdata.view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(parts.scale, scale)
        assert (parts.zero_point is None) == (zp is None)
        if zp is not None:
            assert torch.equal(parts.zero_point, zp)
        torch.testing.assert_close(aqt.dequantize(), oracle, rtol=0, atol=0)

    def test_linear_matches_reference(self, layout, kwargs, shape):
        aqt = _quantize(layout, kwargs, shape)
        x = _weight((3, shape[1]), seed=1)
        bias = _weight((shape[0],), seed=2)
        # Same quantized inputs, different float summation order (and exact int32 accumulation on the
        # integer paths): differences are float32 rounding of K-term sums.
        torch.testing.assert_close(F.linear(x, aqt, bias), reference_linear(aqt, x, bias), rtol=1e-4, atol=1e-4)

    def test_mm_and_addmm_both_orientations(self, layout, kwargs, shape):
        aqt = _quantize(layout, kwargs, shape)
        x, g = _weight((3, shape[1]), seed=1), _weight((3, shape[0]), seed=3)
        bias = _weight((shape[0],), seed=2)
        expected = F.linear(x, aqt, bias)
        torch.testing.assert_close(torch.addmm(bias, x, aqt.t()), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.mm(x, aqt.t()) + bias, expected, rtol=1e-5, atol=1e-5)
        # Backward orientation: grad (M, N) @ W (N, K), served by the dequantized weight.
        torch.testing.assert_close(torch.mm(g, aqt), g @ aqt.dequantize(), rtol=1e-5, atol=1e-5)

    def test_backward_reaches_input(self, layout, kwargs, shape):
        aqt = _quantize(layout, kwargs, shape)
        x = _weight((3, shape[1]), seed=1).requires_grad_()
        F.linear(x, aqt).sum().backward()
        torch.testing.assert_close(x.grad, aqt.dequantize().sum(0).expand(3, -1), rtol=1e-5, atol=1e-5)

    def test_slice_out_features_aliases_storage(self, layout, kwargs, shape):
        aqt = _quantize(layout, kwargs, shape)
        step = _slice_step(aqt, 0, at_least=8)
        start = 0 if step == shape[0] else step
        part = aqt.narrow(0, start, step)
        torch.testing.assert_close(part.dequantize(), aqt.dequantize()[start:start + step], rtol=0, atol=0)
        first = aqt.inner_tensors()[aqt.qlayout.tensor_names[0]]
        assert part.inner_tensors()[aqt.qlayout.tensor_names[0]].untyped_storage().data_ptr() == \
            first.untyped_storage().data_ptr()

    def test_slice_in_features_at_block_boundary(self, layout, kwargs, shape):
        aqt = _quantize(layout, kwargs, shape)
        k = shape[1]
        length = _slice_step(aqt, 1)
        start = 0 if length == k else length
        part = aqt[:, start:start + length]
        torch.testing.assert_close(part.dequantize(), aqt.dequantize()[:, start:start + length], rtol=0, atol=0)
        if start and length > 1:
            with pytest.raises(ValueError, match="multiples of"):
                aqt[:, 1:length]

    def test_copy_clone_detach_to(self, layout, kwargs, shape):
        src, dst = _quantize(layout, kwargs, shape, seed=0), _quantize(layout, kwargs, shape, seed=5)
        dst.copy_(src)
        torch.testing.assert_close(dst.dequantize(), src.dequantize(), rtol=0, atol=0)
        for t in (src.clone(), src.detach(), src.to("cpu")):
            torch.testing.assert_close(t.dequantize(), src.dequantize(), rtol=0, atol=0)
        half = src.to(torch.bfloat16)
        assert half.dtype == torch.bfloat16 and half.dequantize().dtype == torch.bfloat16
        with pytest.raises(ValueError, match="same format"):
            dst.copy_(torch.zeros(shape))

    def test_views_and_matmuls_under_inference_mode(self, layout, kwargs, shape):
        """A weight made outside torch.inference_mode, used inside it (Note [Views under inference mode]): the views
        alias it as outside, and matmuls through them give the same numbers."""
        aqt = _quantize(layout, kwargs, shape)
        x = _weight((3, shape[1]), seed=1)
        expected = F.linear(x, aqt)
        step = _slice_step(aqt, 0, at_least=8)
        with torch.inference_mode():
            views = {"t": aqt.t(), "detach": aqt.detach(), "slice": aqt.narrow(0, 0, step)}
            assert not any(v.is_inference() for v in views.values())  # torch's rule: a view of a normal tensor
            torch.testing.assert_close(x @ views["t"], expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(F.linear(x, views["detach"]), expected, rtol=0, atol=0)
            torch.testing.assert_close(F.linear(x, aqt), expected, rtol=0, atol=0)
            torch.testing.assert_close(views["slice"].dequantize(), aqt.dequantize()[:step], rtol=0, atol=0)

    def test_weights_only_save_load(self, layout, kwargs, shape):
        aqt = _quantize(layout, kwargs, shape)
        buf = io.BytesIO()
        torch.save({"w": aqt}, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)["w"]
        assert type(loaded) is type(aqt) and loaded.attributes() == aqt.attributes()
        torch.testing.assert_close(loaded.dequantize(), aqt.dequantize(), rtol=0, atol=0)

    def test_compile_fullgraph_matches_eager(self, layout, kwargs, shape):
        torch._dynamo.reset()
        aqt = _quantize(layout, kwargs, shape)
        lin = torch.nn.Linear(shape[1], shape[0])
        lin.weight = torch.nn.Parameter(aqt, requires_grad=False)
        x = _weight((4, shape[1]), seed=1)
        with torch.no_grad():
            eager = lin(x)
            compiled = torch.compile(lin, fullgraph=True)(x)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)

    def test_unsupported_op_is_loud(self, layout, kwargs, shape):
        aqt = _quantize(layout, kwargs, shape)
        with pytest.raises(NotImplementedError, match=r"aten::add.*\.dequantize\(\)"):
            torch.add(aqt, 1.0)

    def test_repr_names_format(self, layout, kwargs, shape):
        aqt = _quantize(layout, kwargs, shape)
        text = repr(aqt)
        assert f"qdtype={kwargs['qdtype'].name}" in text and repr(aqt.qlayout) in text and f"shape={shape}" in text
