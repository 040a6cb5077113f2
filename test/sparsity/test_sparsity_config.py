"""qk.SparsityConfig through quantize_: every method and base on a tiny LLaMA (logits of the pruned model equal the
dequantized float model's), exact 2:4 weights and zeros, compressed bytes in the report, the config's JSON form, and
bad input (a clear error naming the module, the model unchanged)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchqkit as qk

from ..common import dequantized_copy, one_torch_thread, small_hf_llama  # noqa: F401  (one_torch_thread: autouse)

pytest.importorskip("transformers")

BATCHES = [torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(3)]
IDS = torch.arange(24).reshape(2, 12) * 7 % 128
INT4 = qk.Int4WeightOnlyConfig(group_size=32)


def _is_2_of_4(w: torch.Tensor) -> bool:
    rows, k = w.shape
    return bool(((w.reshape(rows, k // 4, 4) != 0).sum(-1) <= 2).all())


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
@pytest.mark.parametrize("base", [None, INT4, qk.Int8WeightOnlyConfig(), qk.Float8WeightOnlyConfig()],
                         ids=["float", "int4", "int8", "fp8"])
@torch.no_grad()
def test_pruned_model_computes_its_dequantized_weights(method, base):
    model = small_hf_llama()
    config = qk.SparsityConfig(pattern=(2, 4), method=method, base=base)
    report = qk.quantize_(model, config, calibration_data=BATCHES, strict=True)
    assert len(report.quantized) == 14  # 7 Linears per block; the tied lm_head stays float
    for entry in report.quantized:
        w = model.get_submodule(entry.fqn).weight
        assert isinstance(w.qlayout, qk.NMSparseLayout) and _is_2_of_4(w.dequantize())
        assert entry.bytes_after == w.packed_nbytes() < entry.bytes_before * 0.57  # float values: 0.5625
    # The reference linear computes F.linear with the dequantized weight: the same numbers as the float twin.
    torch.testing.assert_close(model(IDS).logits, dequantized_copy(model)(IDS).logits, rtol=0, atol=1e-5)


@torch.no_grad()
def test_int4_float_zero_points_dequantize_pruned_entries_to_exactly_zero():
    lin = nn.Linear(96, 16)
    qk.quantize_(nn.Sequential(lin), qk.SparsityConfig(base=INT4))
    parts = lin.weight.qlayout.unpack(lin.weight)
    w = lin.weight.dequantize()
    assert lin.weight.zero_point_domain is qk.ZeroPointDomain.FLOAT
    assert parts.mask.sum() == 16 * 48 and torch.equal(w != 0, parts.mask)  # kept int4 values here are never 0
    # what the codes alone would give at a pruned entry: the nearest code to 0.0, not 0.0
    codes_only = qk.dequantize_affine(parts.qdata, lin.weight.qdtype, (1, 32), parts.scale, parts.zero_point,
                                      zero_point_domain="float")
    assert (codes_only[~parts.mask] != 0).any()


def test_report_counts_the_compressed_bytes():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))
    report = qk.quantize_(model, qk.SparsityConfig(base=INT4))
    # 32 rows: 32 kept int4 codes (16 bytes) + 32 2-bit positions (8 bytes) + 2 groups x float32 scale and zero (16)
    assert (report["0"].bytes_before, report["0"].bytes_after) == (64 * 32 * 4, 32 * (16 + 8 + 16))
    assert report["0"].config == "2:4 magnitude + int4 weight-only g32"
    model = nn.Sequential(nn.Linear(64, 32).to(torch.bfloat16))
    report = qk.quantize_(model, qk.SparsityConfig())
    # 32 kept bfloat16 values (64 bytes) + positions (8) + one unit scale (2) per row: 0.5625 of the dense bytes
    assert report["0"].bytes_after == 32 * (64 + 8 + 2) and model[0].weight.qdtype is qk.qdtypes.bfloat16


@torch.no_grad()
def test_magnitude_keeps_an_already_sparse_weight_exactly():
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(64, 24, bias=False)
    keep = torch.rand(24, 64, generator=g).reshape(24, 16, 4).argsort(-1).argsort(-1) < 2
    keep[3, :4] = torch.tensor([False, True, False, False])  # one block with a single nonzero
    w = torch.randn(24, 64, generator=g) * keep.reshape(24, 64)
    lin.weight = nn.Parameter(w.clone())
    qk.quantize_(nn.Sequential(lin), qk.SparsityConfig(pattern=(2, 4)))
    assert torch.equal(lin.weight.dequantize(), w)


@torch.no_grad()
def test_in_features_that_m_does_not_divide_are_padded():
    lin = nn.Linear(70, 16)  # the last block of 4 holds two real columns
    x = torch.randn(3, 70)
    qk.quantize_(nn.Sequential(lin), qk.SparsityConfig(pattern=(2, 4), base=qk.Int8WeightOnlyConfig()), strict=True)
    w = lin.weight.dequantize()
    assert w.shape == (16, 70) and _is_2_of_4(torch.nn.functional.pad(w, (0, 2)))
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, lin.bias), rtol=0, atol=1e-6)


def test_config_json_round_trip_and_module_configs():
    config = qk.SparsityConfig(pattern=(4, 8), method="sparsegpt", base=INT4, damp=0.02)
    assert qk.config_from_dict(config.to_dict()) == config and config.needs_calibration_data()
    assert config.describe() == "4:8 sparsegpt + int4 weight-only g32"
    configs = qk.ModuleConfigs({"re:.*down_proj": None, "_default": qk.SparsityConfig()})
    assert qk.ModuleConfigs.from_dict(configs.to_dict()) == configs
    assert not qk.SparsityConfig().needs_calibration_data() and qk.SparsityConfig().layout == qk.NMSparseLayout(2, 4)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(pattern=(4, 4)), ValueError, r"pattern \(4, 4\) is not an N:M pattern"),
    (dict(pattern=(2, 4, 8)), ValueError, "pattern must be"),
    (dict(method="random"), ValueError, "method must be one of"),
    (dict(base=qk.NF4WeightOnlyConfig()), ValueError, "nf4 codes, which NMSparseLayout can't hold"),
    (dict(base=qk.GPTQConfig(INT4)), TypeError, "method='sparsegpt'"),
    (dict(pattern=(2, 64), base=INT4), ValueError, "groups of 32 input features, which don't hold whole blocks"),
])
def test_bad_configs_are_refused_when_built(kwargs, error, match):
    with pytest.raises(error, match=match):
        qk.SparsityConfig(**kwargs)


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_methods_that_need_data_refuse_to_run_without_it(method):
    model = small_hf_llama()
    before = {name: p.clone() for name, p in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"SparsityConfig need\(s\) calibration data \(for "
                                         rf"model\.layers\.0\.self_attn\.q_proj, .* and \d+ more\)"):
        qk.quantize_(model, qk.SparsityConfig(method=method))
    after = model.state_dict()
    assert all(type(after[n]) is torch.Tensor and torch.equal(after[n], t) for n, t in before.items())


def test_a_weight_the_layout_cannot_take_is_named_and_nothing_changes():
    model = nn.Sequential(nn.Linear(64, 8), nn.Linear(8, 8).double())  # float64: no float value format for it
    first = model[0].weight
    with pytest.raises(qk.QuantizationError, match=r"1: 1\.weight: no identity qdtype for torch\.float64"):
        qk.quantize_(model, qk.SparsityConfig(), strict=True)
    assert model[0].weight is first
    with pytest.warns(UserWarning, match="1 selected layer"):
        report = qk.quantize_(copy.deepcopy(model), qk.SparsityConfig())
    assert report["1"].status == "skipped" and report["0"].status == "quantized"


def test_status_lists_the_layouts_reference_path():
    rows = [r for r in qk.kernels.status() if r["layout"] == "nm_sparse"]
    assert rows and rows[-1]["path"] == "reference"


@torch.no_grad()
def test_fusing_shared_input_linears_keeps_the_kept_entries():
    model = small_hf_llama()
    qk.quantize_(model, qk.SparsityConfig(base=INT4))
    expected = model(IDS).logits
    fused = qk.fuse_shared_input_linears(model)
    assert set(fused.values()) == {"fused"}
    assert torch.equal(model(IDS).logits, expected)


def test_gguf_export_refuses_int4_float_zero_points_it_cannot_hold():
    from torchqkit.integrations.gguf_encode import encode_exact
    lin = nn.Linear(64, 8)
    qk.quantize_(nn.Sequential(lin), qk.SparsityConfig(base=INT4))
    assert encode_exact(lin.weight, "w")[1].startswith("it is N:M sparse with float zero points")
    int8 = nn.Linear(64, 8)
    qk.quantize_(nn.Sequential(int8), qk.SparsityConfig(base=qk.Int8WeightOnlyConfig(group_size=32)))
    encoded, _ = encode_exact(int8.weight, "w")  # symmetric codes: the pruned entries are code 0, exactly 0.0
    assert encoded is not None and encoded.type_name == "Q8_0" and encoded.max_abs_change < 1e-3  # float16 scales
