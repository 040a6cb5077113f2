"""Tied and shared weights: quantize_ keeps a shared Parameter one weight (quantized once or kept once,
counted once in the report), and an embedding reading a quantized weight gathers only the rows it needs,
for every layout, equal to F.embedding on the dequantized weight."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.utils import run_and_get_code

import torchqkit as qk
from torchqkit.core import qdtypes as Q
from torchqkit.tensor import embedding as qembedding

from ..layouts.conformance_cases import all_cases

CASE_PARAMS = [pytest.param(layout, kwargs, shape, id=f"{layout.name}-{cid}") for layout, cid, shape, kwargs in all_cases()]


def _quantize(layout_cls, kwargs, shape, seed=0):
    kwargs = dict(kwargs)
    layout = kwargs.pop("layout", None) or layout_cls()
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return qk.quantize_weight(w, kwargs.pop("qdtype"), kwargs.pop("granularity"), layout, **kwargs)


def _ids(n: int) -> torch.Tensor:
    """(3, 6) ids over n rows: the first and last row, repeats, and ids out of order."""
    ids = torch.randint(0, n, (3, 6), generator=torch.Generator().manual_seed(1))
    ids[0, :3] = torch.tensor([n - 1, 0, n - 1])
    ids[2, 5] = ids[1, 2]
    return ids


@pytest.fixture
def dequantize_calls(monkeypatch):
    """Logical shapes of the (sliced) weights dequantized while the test runs."""
    calls, original = [], qk.AffineQuantizedTensor.dequantize

    def spy(self, *args, **kwargs):
        calls.append(tuple(self.shape))
        return original(self, *args, **kwargs)
    monkeypatch.setattr(qk.AffineQuantizedTensor, "dequantize", spy)
    return calls


# --------------------------------------------------------------------------------- aten.embedding

@pytest.mark.parametrize("layout, kwargs, shape", CASE_PARAMS)
def test_embedding_equals_dequantized_gather(layout, kwargs, shape, monkeypatch):
    w = _quantize(layout, kwargs, shape)
    ids = _ids(shape[0])
    expected = F.embedding(ids, w.dequantize())
    assert torch.equal(F.embedding(ids, w), expected)
    assert torch.equal(F.embedding(ids.int(), w), expected)
    # One slice per needed tile (no merging, smallest chunks): every tile boundary of the layout is cut,
    # row-major layouts included (their direct row gather switched off).
    monkeypatch.setattr(type(w.qlayout), "gather_rows", lambda self, aqt, rows: None)
    monkeypatch.setattr(qembedding, "GAP_ELEMS", 0)
    monkeypatch.setattr(qembedding, "CHUNK_ELEMS", 1)
    assert torch.equal(F.embedding(ids, w), expected)


def test_embedding_dequantizes_only_the_tiles_it_needs(dequantize_calls, monkeypatch):
    # int4 tiled: 8-row tiles; 64 x 128 -> 8 tiles.
    w = qk.quantize_weight(torch.randn(64, 128), Q.uint4, qk.PerGroup(32), qk.TensorCoreTiledLayout(),
                           mapping=qk.MappingType.ASYMMETRIC, zero_point_domain=qk.ZeroPointDomain.FLOAT)
    ref = w.dequantize()
    dequantize_calls.clear()
    monkeypatch.setattr(qembedding, "GAP_ELEMS", 0)
    ids = torch.tensor([[41, 3, 63], [17, 5, 40]])
    assert torch.equal(F.embedding(ids, w), F.embedding(ids, ref))
    assert dequantize_calls == [(8, 128)] * 4  # tiles 0, 2, 5, 7: each sliced and dequantized once
    dequantize_calls.clear()
    F.embedding(torch.arange(8, 24).flip(0), w)
    assert dequantize_calls == [(16, 128)]  # a run of tiles: one slice
    dequantize_calls.clear()
    monkeypatch.setattr(qembedding, "GAP_ELEMS", 8 * 128)  # one unneeded tile costs less than a call, two don't
    F.embedding(ids, w)
    assert dequantize_calls == [(24, 128), (24, 128)]  # tiles 0-2 and 5-7
    dequantize_calls.clear()
    monkeypatch.setattr(qembedding, "CHUNK_ELEMS", 16 * 128)  # bounded temporaries: at most 16 rows at once
    F.embedding(torch.arange(64), w)
    assert dequantize_calls == [(16, 128)] * 4


def test_embedding_decode_step_reads_one_tile(dequantize_calls):
    w = qk.quantize_weight(torch.randn(4096, 64), Q.int8, qk.PerRow(), qk.PlainLayout())
    dequantize_calls.clear()
    out = F.embedding(torch.tensor([[1234]]), w)
    assert dequantize_calls == [(1, 64)] and torch.equal(out[0, 0], w.dequantize()[1234])


@pytest.mark.parametrize("layout", [qk.PlainLayout(), qk.PackedIntxLayout(), qk.NF4Layout(block_size=32),
                                    qk.NF4Layout(block_size=32, double_quant=True), qk.TensorCoreTiledLayout()])
def test_row_major_layouts_dequantize_exactly_the_unique_rows(layout, dequantize_calls):
    qdtype, mapping, zpd = {"plain": (Q.int8, "symmetric", None), "packed_intx": (Q.int4, "symmetric", None),
                            "nf4": (Q.nf4, "symmetric", None),
                            "tensor_core_tiled": (Q.uint4, "asymmetric", qk.ZeroPointDomain.FLOAT)}[layout.name]
    w = qk.quantize_weight(torch.randn(64, 96), qdtype, qk.PerGroup(32), layout, mapping=mapping,
                           zero_point_domain=zpd)
    ids = torch.tensor([[41, 3, 41], [9, 3, 60]])
    ref = F.embedding(ids, w.dequantize())
    dequantize_calls.clear()
    assert torch.equal(F.embedding(ids, w), ref)
    tiled = layout.name == "tensor_core_tiled" or getattr(layout, "double_quant", False)
    # Row-major storage: one dequantize of the 4 unique rows; tiles or shared scales: whole row tiles.
    assert (dequantize_calls[0][0] > 4) if tiled else dequantize_calls == [(4, 96)]


@pytest.mark.parametrize("bad", [48, -1])
def test_embedding_out_of_range_is_an_index_error(bad):
    w = _quantize(*_first_case("plain"))
    with pytest.raises(IndexError):
        F.embedding(torch.tensor([0, bad]), w.dequantize())  # what torch does with a float weight
    with pytest.raises(IndexError, match=f"index out of range in self: id {bad} in an embedding of 48 rows"):
        F.embedding(torch.tensor([0, bad]), w)


def test_embedding_argument_checks_and_edge_cases():
    w = _quantize(*_first_case("plain"))
    with pytest.raises(RuntimeError, match="Long, Int"):
        F.embedding(torch.tensor([1.0]), w)
    assert F.embedding(torch.zeros(0, 3, dtype=torch.long), w).shape == (0, 3, 64)
    emb = nn.Embedding(48, 64, padding_idx=2)
    emb.weight = nn.Parameter(w, requires_grad=False)
    ids = torch.tensor([[2, 7, 2]])
    assert torch.equal(emb(ids), F.embedding(ids, w.dequantize()))  # padding_idx only changes gradients
    assert "weight=int8" not in repr(emb)  # only quantize_ / load_quantized patch the repr


@pytest.mark.parametrize("layout", ["plain", "tensor_core_tiled"])
def test_embedding_of_a_transposed_weight(layout):
    w = _quantize(*_first_case(layout)).t()  # rows are in_features: slices cut along the stored K
    ids = torch.randint(0, w.shape[0], (4, 5), generator=torch.Generator().manual_seed(2))
    assert torch.equal(F.embedding(ids, w), F.embedding(ids, w.dequantize()))


def _first_case(layout_name):
    return next((L, kwargs, shape) for L, _, shape, kwargs in all_cases() if L.name == layout_name)


# --------------------------------------------------------------------------------- quantize_

class Tied(nn.Module):
    """embed tied to head (a LM's tie_word_embeddings); a and b: two Linears on one Parameter."""

    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim, bias=False)
        self.b.weight = self.a.weight
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        x = x + torch.tanh(self.b(torch.relu(self.a(x))))
        return self.head(self.mid(x))


def _tied(seed=0) -> Tied:
    torch.manual_seed(seed)
    return Tied().eval()


def _linear_weight_bytes(model) -> int:
    """Bytes of the distinct weight storages Linear modules hold (a shared Parameter once)."""
    seen = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(w.packed_nbytes() if isinstance(w, qk.AffineQuantizedTensor) else w.numel() * w.element_size()
               for w in seen.values())


IDS = torch.tensor([[1, 5, 63, 5], [0, 9, 33, 62]])


def test_default_keeps_the_tied_head_and_counts_shared_bytes_once():
    model = _tied()
    before = _linear_weight_bytes(model)
    report = qk.quantize_(model, qk.Int8WeightOnlyConfig(), strict=True)
    head = report["head"]
    assert head.status == "kept" and head.bytes_before == head.bytes_after == 64 * 32 * 4
    assert "tied to embed.weight (Embedding)" in head.reason and "name 'head' in ModuleConfigs" in head.reason
    assert model.head.weight is model.embed.weight and not isinstance(model.head.weight, qk.AffineQuantizedTensor)
    assert report["a"].status == "quantized" and model.a.weight is model.b.weight
    assert isinstance(model.a.weight, qk.AffineQuantizedTensor)
    b = report["b"]
    assert (b.status, b.bytes_before, b.bytes_after, b.shared_with) == ("shared", 0, 0, "a.weight")
    assert (report.bytes_before, report.bytes_after) == (before, _linear_weight_bytes(model))
    assert "3 quantized" not in str(report) and "2 quantized, 1 shared, 0 skipped, 1 kept" in str(report)


def test_explicitly_named_head_is_quantized_once_and_stays_tied():
    model = _tied()
    reference = copy.deepcopy(model)
    configs = qk.ModuleConfigs({"head": qk.Int4WeightOnlyConfig(group_size=32), "_default": qk.Int8WeightOnlyConfig()})
    report = qk.quantize_(model, configs, strict=True)
    w = model.head.weight
    assert isinstance(w, qk.AffineQuantizedTensor) and isinstance(w, nn.Parameter) and w is model.embed.weight
    assert report["head"].status == "quantized" and report["head"].bytes_after == w.packed_nbytes()
    assert report["embed"].status == "shared" and report["embed"].shared_with == "head.weight"
    assert report.bytes_after == _linear_weight_bytes(model)
    assert "weight=uint4" in repr(model.embed) and "weight=uint4" in repr(model.head)
    # The same model with every quantized weight replaced by its dequantized copy (still tied).
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name != "b":
            reference.get_submodule(name).weight = nn.Parameter(m.weight.dequantize())
    reference.b.weight, reference.embed.weight = reference.a.weight, reference.head.weight
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), reference(IDS), rtol=1e-5, atol=1e-5)


def test_second_holder_with_another_config_follows_the_first():
    model = _tied()
    report = qk.quantize_(model, qk.ModuleConfigs({"a": qk.Int8WeightOnlyConfig(),
                                                   "b": qk.Int4WeightOnlyConfig(group_size=32)}))
    assert model.b.weight is model.a.weight and model.a.weight.qdtype is Q.int8
    assert report["b"].status == "shared" and report["b"].config == "int8 weight-only per-channel"
    assert "its own config (int4 weight-only g32) was not applied" in report["b"].reason


def test_unselected_holder_reads_the_new_weight_and_is_reported():
    model = _tied()
    report = qk.quantize_(model, qk.Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn == "a")
    assert model.b.weight is model.a.weight and isinstance(model.b.weight, qk.AffineQuantizedTensor)
    assert [(e.fqn, e.status) for e in report.entries] == [("a", "quantized"), ("b", "shared")]


def test_kept_owner_keeps_the_other_holder_in_float():
    model = _tied()
    report = qk.quantize_(model, qk.ModuleConfigs({"a": None, "_default": qk.Int8WeightOnlyConfig()}))
    assert not isinstance(model.b.weight, qk.AffineQuantizedTensor) and model.b.weight is model.a.weight
    assert report["b"].status == "shared" and "its own config (int8 weight-only per-channel) was not" in report["b"].reason


class ScaledTie(nn.Module):
    """A Linear whose weight another kind of module also uses (here as a matrix in its own forward)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.mix = nn.Module()
        self.mix.weight = self.proj.weight


def test_weight_tied_to_a_module_that_cant_read_it_is_refused_even_when_named():
    model = ScaledTie()
    with pytest.raises(qk.QuantizationError, match=r"tied to mix\.weight, a Module, which can't read a quantized"):
        qk.quantize_(model, qk.ModuleConfigs({"proj": qk.Int8WeightOnlyConfig()}), strict=True)
    assert not isinstance(model.proj.weight, qk.AffineQuantizedTensor)
    assert qk.quantize_(model, qk.Int8WeightOnlyConfig())["proj"].status == "kept"


def test_compiled_model_with_quantized_tied_head_and_embedding():
    torch._dynamo.reset()
    model = _tied()
    qk.quantize_(model, qk.ModuleConfigs({"head": qk.Int8WeightOnlyConfig(), "_default": qk.Int8WeightOnlyConfig()}),
                 strict=True)
    with torch.no_grad():
        eager = model(IDS)
        compiled, code = run_and_get_code(torch.compile(model, fullgraph=True), IDS)  # fullgraph: no graph break
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    # Inductor fuses the traced dequantize into the gather: no (64, 32) float weight is ever allocated.
    assert "empty_strided_cpu((2, 4, 32)" in "".join(code) and "empty_strided_cpu((64, 32)" not in "".join(code)


def test_save_and_load_quantized_keep_the_quantized_tie(tmp_path):
    model = _tied()
    qk.quantize_(model, qk.ModuleConfigs({"head": qk.NF4WeightOnlyConfig(block_size=32), "_default": None}),
                 strict=True)
    summary = qk.save_quantized(model, tmp_path / "m.safetensors")
    assert summary.tied == {"b.weight": "a.weight", "head.weight": "embed.weight"}
    assert summary.quantized == ["embed.weight"]  # the quantized tie: stored once
    with torch.device("meta"):
        fresh = Tied().eval()
    qk.load_quantized(fresh, tmp_path / "m.safetensors")
    assert fresh.head.weight is fresh.embed.weight and isinstance(fresh.embed.weight, qk.AffineQuantizedTensor)
    assert fresh.a.weight is fresh.b.weight
    with torch.no_grad():
        assert torch.equal(fresh(IDS), model(IDS))
