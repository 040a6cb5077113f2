"""compressed-tensors export (save_compressed_tensors) and import (from_pretrained), cross-checked with the
compressed_tensors package's own packer, compressor and decompressor, and with transformers loading the export in
a process that never imports torchqkit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import torchqkit as qk
from torchqkit.integrations import compressed_tensors_export
from torchqkit.integrations.int32_packing import (awq_deinterleave, awq_interleave, pack_int32,
                                                  stream_padding_is_zero, unpack_int32)

from .hub_fixtures import quantized_linears, tiny_llama

IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 101, 127, 0, 64]])

# Configs with an exact compressed-tensors form, and the format each becomes.
EXPORTABLE = {
    "int4_g32_asym": (lambda: qk.IntxWeightOnlyConfig(bits=4, granularity=qk.PerGroup(32), mapping="asymmetric"),
                      "pack-quantized"),
    "int4_g32_sym": (lambda: qk.IntxWeightOnlyConfig(bits=4, granularity=qk.PerGroup(32)), "pack-quantized"),
    "int2_channel": (lambda: qk.IntxWeightOnlyConfig(bits=2, granularity=qk.PerRow()), "pack-quantized"),
    "int8_weight_only": (lambda: qk.Int8WeightOnlyConfig(), "pack-quantized"),
    "w8a8_int": (lambda: qk.Int8DynamicActivationInt8WeightConfig(), "int-quantized"),
    "w8a8_fp8": (lambda: qk.Float8DynamicActivationFloat8WeightConfig(granularity=qk.PerRow()), "float-quantized"),
}


def _quantized(key):
    model = tiny_llama()
    qk.quantize_(model, EXPORTABLE[key][0]())
    return model


def test_pack_int32_known_words():
    # 4-bit fields 1..8 of one row: field j at bits 4 j -> 0x87654321
    assert pack_int32(torch.arange(1, 9).view(1, 8), 4).item() == 0x87654321 - 2 ** 32
    assert unpack_int32(torch.tensor([[0x87654321 - 2 ** 32]], dtype=torch.int32), 4, 8).tolist() == [list(range(1, 9))]
    # AWQ: field j holds column ORDER[j] = 0 2 4 6 1 3 5 7
    assert awq_interleave(torch.arange(8).view(1, 8)).tolist() == [[0, 2, 4, 6, 1, 3, 5, 7]]
    x = torch.randint(0, 16, (3, 24))
    assert torch.equal(awq_deinterleave(awq_interleave(x)), x)
    # 2-bit codes of 20 columns: 2 words, the last 12 fields zero; a set padding bit is caught
    words = pack_int32(torch.full((1, 20), 3), 2)
    assert stream_padding_is_zero(words, 2, 20) and not stream_padding_is_zero(words, 2, 19)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_int32_equals_compressed_tensors(bits):
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    half = 1 << (bits - 1)
    signed = torch.randint(-half, half, (6, 72), dtype=torch.int8)
    assert torch.equal(pack_int32(signed.to(torch.int32) + half, bits), ct.pack_to_int32(signed, bits))
    along_n = ct.pack_to_int32(signed, bits, packed_dim=0)
    assert torch.equal(pack_int32(signed.t().to(torch.int32) + half, bits).t(), along_n)


@pytest.mark.parametrize("key", sorted(EXPORTABLE))
def test_export_decompressed_by_compressed_tensors_bit_exact(tmp_path, key):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    model = _quantized(key)
    export = qk.save_compressed_tensors(model, tmp_path)
    assert [f.name for f in export.files] == ["config.json", "model.safetensors"]
    assert any(what.startswith(EXPORTABLE[key][1]) and what.endswith("exact") for _, what in export.tensors)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == EXPORTABLE[key][1]
    (group,) = qc["config_groups"].values()
    scheme = QuantizationScheme(**{k: v for k, v in group.items() if k != "format"})
    compressor = BaseCompressor.load_from_registry(qc["format"])
    stored = load_file(tmp_path / "model.safetensors")
    for name in group["targets"]:
        local = {k[len(name) + 1:]: v for k, v in stored.items() if k.startswith(name + ".")}
        theirs = compressor.decompress(local, scheme)["weight"]
        ours = model.get_submodule(name).weight.dequantize()
        assert theirs.dtype == ours.dtype and torch.equal(theirs, ours), name


@pytest.mark.parametrize("key", ["int4_g32_asym", "w8a8_int", "w8a8_fp8"])
def test_export_reimports_with_the_same_weights_and_logits(tmp_path, key):
    model = _quantized(key)
    qk.save_compressed_tensors(model, tmp_path)
    loaded = qk.from_pretrained(tmp_path)
    for name in quantized_linears(model):
        a, b = model.get_submodule(name).weight, loaded.get_submodule(name).weight
        assert torch.equal(a.dequantize(), b.dequantize()) and _act(a) == _act(b), name
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, loaded(IDS).logits)


def _act(w):
    """What an activation spec does (PerRow and PerToken both mean one scale per token)."""
    a = w.act_quant
    return None if a is None else (a.qdtype, a.mapping, a.per_tensor, a.static_scale)


def test_unmappable_weight_refused_before_anything_is_written(tmp_path):
    model = tiny_llama()
    qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=32))  # float-domain zero points
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError) as e:
        qk.save_compressed_tensors(model, tmp_path)
    text = str(e.value)
    assert "15 weight(s) have no exact compressed-tensors form, nothing was written" in text
    assert "model.layers.0.self_attn.q_proj.weight (uint4, block_size (1, 32), zero point float, " in text
    assert "TensorCoreTiledLayout" in text and "zero point is in the float domain" in text
    assert "Options: IntxWeightOnlyConfig(bits=2|4|8" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    assert (tmp_path / "config.json").read_text() == "{}"


def test_failed_export_leaves_the_previous_one(tmp_path, monkeypatch):
    qk.save_compressed_tensors(_quantized("int4_g32_sym"), tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    calls = []

    def failing(w, scheme):
        calls.append(1)
        if len(calls) == 5:
            raise OSError("disk full")
        return real(w, scheme)

    real = compressed_tensors_export.ct_tensors
    monkeypatch.setattr(compressed_tensors_export, "ct_tensors", failing)
    with pytest.raises(OSError, match="disk full"):
        qk.save_compressed_tensors(_quantized("int8_weight_only"), tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temporaries left either


_HF_LOAD = textwrap.dedent("""
    import sys, torch, transformers
    ids = torch.tensor(eval(sys.argv[1]))
    for directory in sys.argv[2:]:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
        with torch.no_grad():
            torch.save(model(ids).logits, directory + "/logits.pt")
    assert "torchqkit" not in sys.modules
""")

# transformers + compressed-tensors decompress the weights and run F.linear (float32): the same products in
# another summation order, so ~1e-6; with int8 activations their per-token quantizer rounds some activations
# differently from torchqkit's, so ~1e-3.
TRANSFORMERS_ATOL = {"int4_g32_sym": 1e-5, "int2_channel": 1e-5, "int8_weight_only": 1e-5, "w8a8_fp8": 1e-5,
                     "w8a8_int": 5e-3}


def test_transformers_loads_the_exports_without_torchqkit(tmp_path):
    """One process loads every export (transformers' import is most of the time). Not int4_g32_asym: transformers
    5.24 with compressed-tensors 0.20.1 builds unpacked zero points for asymmetric pack-quantized layers and
    refuses the packed ones compressed-tensors' own compressor writes (a size mismatch), whoever wrote the file."""
    pytest.importorskip("compressed_tensors")
    models = {key: _quantized(key) for key in TRANSFORMERS_ATOL}
    for key, model in models.items():
        qk.save_compressed_tensors(model, tmp_path / key)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    subprocess.run([sys.executable, "-c", _HF_LOAD, str(IDS.tolist()), *(str(tmp_path / k) for k in models)],
                   check=True, env=env, cwd=tmp_path, capture_output=True)
    for key, model in models.items():
        theirs = torch.load(tmp_path / key / "logits.pt")
        with torch.no_grad():
            ours = model(IDS).logits
        torch.testing.assert_close(theirs, ours, atol=TRANSFORMERS_ATOL[key], rtol=0, msg=key)
