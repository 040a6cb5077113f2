"""Layout.packed_specs (what the loader checks files against) matches what pack() really stores, for
every conformance case of every registered layout, and for slices (what a tensor-parallel shard saves)."""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk
from torchqkit.layouts import all_layouts

from ..layouts.conformance_cases import all_cases


def _specs(w):
    return w.qlayout.packed_specs(w.weight_format)


def _assert_matches(w):
    specs = _specs(w)
    stored = {n: t for n, t in w.inner_tensors().items() if t is not None}
    assert sorted(stored) == sorted(specs)
    for name, t in stored.items():
        assert tuple(t.shape) == specs[name].shape, name
        assert t.dtype in specs[name].dtypes, name


@pytest.mark.parametrize("layout_cls,case_id,shape,kwargs", all_cases(),
                         ids=[f"{c[0].name}-{c[1]}" for c in all_cases()])
def test_packed_specs_match_pack(layout_cls, case_id, shape, kwargs):
    kwargs = dict(kwargs)
    layout = kwargs.pop("layout", layout_cls())
    w = qk.quantize_weight(torch.randn(shape, generator=torch.Generator().manual_seed(0)),
                           kwargs.pop("qdtype"), kwargs.pop("granularity"), layout, **kwargs)
    _assert_matches(w)
    rows = layout.slice_multiple(w.weight_format, 0)
    if rows < shape[0]:
        _assert_matches(w[rows:])  # a slice to the end: the shard a tensor-parallel rank keeps


def test_layouts_that_pack_codes_declare_their_own_packed_specs():
    """The default (one code per element, the oracle's scales) fits the plain and float8 layouts only; every layout
    that packs codes into bytes or tiles must say what it stores."""
    one_code_per_element = {qk.PlainLayout, qk.Float8Layout}
    for cls in all_layouts():
        assert (cls.packed_specs is qk.Layout.packed_specs) == (cls in one_code_per_element), cls.__name__
