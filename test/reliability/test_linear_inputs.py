"""Every quantized linear takes exactly what F.linear takes: a wrong in_features or an integer input raises
F.linear's RuntimeError (eagerly, and at trace time under torch.compile, without a graph break), and
non-contiguous inputs and NaN / Inf rows give what F.linear(x, w.dequantize()) gives: only those rows
non-finite, the others as if the bad row were absent. One weight per layout case (conformance_cases.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk

from ..layouts.conformance_cases import all_cases


CASES = [pytest.param(layout, kwargs, shape, id=f"{layout.name}-{cid}") for layout, cid, shape, kwargs in all_cases()]


def _weight(layout_cls, kwargs, shape):
    kwargs = dict(kwargs)
    layout = kwargs.pop("layout", None) or layout_cls()
    g = torch.Generator().manual_seed(0)
    return qk.quantize_weight(torch.randn(shape, generator=g), kwargs.pop("qdtype"), kwargs.pop("granularity"),
                              layout, **kwargs)


def _x(m, k, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout,kwargs,shape", CASES)
def test_wrong_in_features_and_integer_inputs_raise_like_f_linear(layout, kwargs, shape):
    w = _weight(layout, kwargs, shape)
    n, k = shape
    for bad_k in sorted({k - 4, k + 4, 100, 128} - {k}):
        with pytest.raises(RuntimeError, match=rf"mat1 and mat2 shapes cannot be multiplied \(3x{bad_k} and {k}x{n}\)"):
            F.linear(_x(3, bad_k), w)
        with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
            _x(3, bad_k) @ w.t()  # the mm / addmm orientation reaches the same check
    with pytest.raises(RuntimeError, match="expected a floating-point input"):
        F.linear(torch.randint(-3, 3, (3, k)), w)
    with pytest.raises(RuntimeError, match="at least 1D"):
        F.linear(torch.tensor(1.0), w)
    with pytest.raises(RuntimeError, match=f"bias of {n + 1} elements"):
        F.linear(_x(3, k), w, torch.zeros(n + 1))
    assert F.linear(_x(3, k)[0], w).shape == (n,)  # a 1-d input is fine, as for F.linear


@pytest.mark.parametrize("layout,kwargs,shape", CASES)
def test_non_contiguous_input_equals_contiguous(layout, kwargs, shape):
    w = _weight(layout, kwargs, shape)
    n, k = shape
    x = _x(k, 6).t()  # (6, K), column-major
    assert not x.is_contiguous()
    torch.testing.assert_close(F.linear(x, w), F.linear(x.contiguous(), w), rtol=1e-5, atol=1e-5)
    x3 = _x(2 * 5, k).reshape(5, 2, k).transpose(0, 1)  # (2, 5, K), batch dims permuted
    torch.testing.assert_close(F.linear(x3, w), F.linear(x3.contiguous(), w), rtol=1e-5, atol=1e-5)


def _rows_behave_like_f_linear(w, bad_value):
    n, k = w.shape
    x = _x(6, k)
    x[2, 5] = bad_value
    out = F.linear(x, w)
    clean = x.clone()
    clean[2] = 0.0
    expected = F.linear(clean, w)
    finite_rows = torch.isfinite(out).all(dim=1)
    assert finite_rows.tolist() == [True, True, False, True, True, True]
    rows = [0, 1, 3, 4, 5]
    assert torch.equal(out[rows], expected[rows])  # the bad row changed nothing else


@pytest.mark.parametrize("layout,kwargs,shape", CASES)
def test_a_nan_row_gives_a_nan_row_only(layout, kwargs, shape):
    _rows_behave_like_f_linear(_weight(layout, kwargs, shape), float("nan"))


@pytest.mark.parametrize("layout,kwargs,shape", CASES)
def test_an_inf_row_gives_a_non_finite_row_only(layout, kwargs, shape):
    _rows_behave_like_f_linear(_weight(layout, kwargs, shape), float("inf"))


@pytest.mark.parametrize("config", [qk.Int4WeightOnlyConfig(group_size=32), qk.IntxWeightOnlyConfig(bits=4),
                                    qk.Float8DynamicActivationFloat8WeightConfig()],
                         ids=["int4-tiled", "packed-intx", "fp8-dynamic"])
def test_under_compile_the_check_is_a_trace_time_error_without_graph_break(config):
    model = torch.nn.Sequential(torch.nn.Linear(96, 64)).eval()
    qk.quantize_(model, config, strict=True)
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager")  # a graph break raises
    with torch.no_grad():
        torch.testing.assert_close(compiled(_x(3, 96)), model(_x(3, 96)))
        with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(3x100 and 96x64\)"):
            compiled(_x(3, 100))
        with pytest.raises(RuntimeError, match="expected a floating-point input"):
            compiled(torch.ones(3, 96, dtype=torch.int64))
