"""compressed-tensors export (save_compressed_tensors) and import (from_pretrained), cross-checked with the
compressed_tensors package's own packer, compressor and decompressor, and with transformers loading the export in
a process that never imports torchqkit."""
from __future__ import annotations

import copy

import json
import math
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
    "mxfp4": (lambda: qk.MXFP4WeightOnlyConfig(), "mxfp4-pack-quantized"),
    "nvfp4": (lambda: qk.NVFP4WeightOnlyConfig(), "nvfp4-pack-quantized"),
}


def _quantized(key, dtype=torch.float32):
    model = tiny_llama().to(dtype)
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
        # compressed-tensors decompresses MXFP4 / NVFP4 in bfloat16, everything else in the scale's dtype
        assert theirs.dtype == (torch.bfloat16 if key in ("mxfp4", "nvfp4") else torch.float32)
        assert torch.equal(theirs, model.get_submodule(name).weight.dequantize(theirs.dtype)), name


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


def test_mxfp4_export_reimports_the_same_bytes(tmp_path):
    model = _quantized("mxfp4")
    qk.save_compressed_tensors(model, tmp_path)
    loaded = qk.from_pretrained(tmp_path)
    for name in quantized_linears(model):
        a, b = model.get_submodule(name).weight, loaded.get_submodule(name).weight
        assert isinstance(b.qlayout, qk.MXLayout) and b.dtype == torch.bfloat16  # compressed-tensors' dtype for it
        assert torch.equal(a.qdata, b.qdata) and torch.equal(a.scale, b.scale), name
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, loaded(IDS).logits)
    t = load_file(tmp_path / "model.safetensors")
    t["model.layers.1.mlp.up_proj.weight_scale"][2, 1] = 255  # E8M0's NaN
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(qk.CheckpointError, match=r"model\.safetensors: tensor model\.layers\.1\.mlp\.up_proj\."
                                                  r"weight_scale: holds E8M0 byte 255 \(NaN\)"):
        qk.from_pretrained(tmp_path)


def test_nvfp4_export_reimports_the_same_bytes(tmp_path):
    model = _quantized("nvfp4")
    export = qk.save_compressed_tensors(model, tmp_path)
    what = "nvfp4-pack-quantized float4 tensor_group 16 (float8 e4m3 scales, float32 global scale), exact"
    assert ("model.layers.0.mlp.up_proj.weight_global_scale", what) in export.tensors
    t = load_file(tmp_path / "model.safetensors")
    assert t["model.layers.0.mlp.up_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert t["model.layers.0.mlp.up_proj.weight_global_scale"].shape == (1,)
    loaded = qk.from_pretrained(tmp_path)
    for name in quantized_linears(model):
        a, b = model.get_submodule(name).weight, loaded.get_submodule(name).weight
        assert isinstance(b.qlayout, qk.NVFP4Layout) and b.dtype == torch.bfloat16  # compressed-tensors' dtype for it
        assert torch.equal(a.qdata, b.qdata) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
        assert torch.equal(a.global_scale, b.global_scale), name
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, loaded(IDS).logits)
    t["model.layers.1.mlp.up_proj.weight_global_scale"][0] = 0.0
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(qk.CheckpointError, match=r"model\.safetensors: tensor model\.layers\.1\.mlp\.up_proj\."
                                                  r"weight_global_scale: is 0; a global scale must be finite and > 0"):
        qk.from_pretrained(tmp_path)


def test_nvfp4_activations_are_refused_by_the_export(tmp_path):
    model = tiny_llama()
    qk.quantize_(model, qk.NVFP4DynamicActivationNVFP4WeightConfig())
    with pytest.raises(ValueError, match="NVFP4 activations with a global scale chosen per call"):
        qk.save_compressed_tensors(model, tmp_path)


def test_compressed_tensors_nvfp4_compressor_output_imports_bit_exactly(tmp_path):
    """compressed-tensors' own NVFP4 qparams (global scale 448 * 6 / amax: not a power of two) and compressor: the
    imported NVFP4Layout holds their bytes and dequantizes to their decompressed weights."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    model = tiny_llama()
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    compressor = BaseCompressor.load_from_registry("nvfp4-pack-quantized")
    tensors = {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[0] not in quantized_linears(model)}
    ref = {}
    for name, m in quantized_linears(model).items():
        w = m.weight.detach()
        g = generate_gparam(w.amin().reshape(1), w.amax().reshape(1))
        blocks = w.reshape(w.shape[0], -1, 16)
        scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=g)
        out = compressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": g}, scheme)
        ref[name] = compressor.decompress(dict(out), scheme)["weight"]
        tensors.update({f"{name}.{k}": v.contiguous() for k, v in out.items()})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="nvfp4-pack-quantized", ignore=["lm_head"],
                            quantization_status="compressed").to_dict()
    config = model.config.to_dict()
    config.update(architectures=["LlamaForCausalLM"], quantization_config=json.loads(json.dumps(qc, default=str)))
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = qk.from_pretrained(tmp_path)
    for name, expected in ref.items():
        w = loaded.get_submodule(name).weight
        g = float(w.global_scale)
        assert isinstance(w.qlayout, qk.NVFP4Layout) and g != 2.0 ** round(math.log2(g))  # not the oracle's kind
        assert torch.equal(w.dequantize(torch.bfloat16), expected), name


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


@pytest.mark.parametrize("dtype", ["float8_e4m3fnuz", "float8_e5m2fnuz"])
@pytest.mark.parametrize("acts", [False, True], ids=["weight-only", "fnuz-activations"])
def test_fnuz_float8_refused_with_the_way_out(tmp_path, dtype, acts):
    model = tiny_llama()
    qk.quantize_(model, qk.Float8DynamicActivationFloat8WeightConfig(activation_dtype=dtype, weight_dtype=dtype)
                 if acts else qk.Float8WeightOnlyConfig(weight_dtype=dtype))
    with pytest.raises(ValueError) as e:
        qk.save_compressed_tensors(model, tmp_path)
    text = str(e.value)
    assert "have no exact compressed-tensors form, nothing was written" in text
    what, field = ("activations", "activation_dtype") if acts else ("codes", "weight_dtype")
    assert (f"{dtype} {what}: compressed-tensors' float8 is OCP float8_e4m3fn and has no AMD fnuz form; quantize "
            f"with {field}='float8_e4m3fn' to export") in text
    assert list(tmp_path.iterdir()) == []


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
                     "w8a8_int": 5e-3, "mxfp4": 8e-3}
# transformers decompresses MXFP4 to bfloat16 weights: the model must be bfloat16 too; logits below 1 in
# bfloat16 differ by up to two ulps (3.9e-3 each).
MODEL_DTYPE = {"mxfp4": torch.bfloat16}


def test_transformers_loads_the_exports_without_torchqkit(tmp_path):
    """One process loads every export (transformers' import is most of the time). Not int4_g32_asym: transformers
    5.24 with compressed-tensors 0.20.1 builds unpacked zero points for asymmetric pack-quantized layers and
    refuses the packed ones compressed-tensors' own compressor writes (a size mismatch), whoever wrote the file."""
    pytest.importorskip("compressed_tensors")
    models = {key: _quantized(key, MODEL_DTYPE.get(key, torch.float32)) for key in TRANSFORMERS_ATOL}
    for key, model in models.items():
        qk.save_compressed_tensors(model, tmp_path / key)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # transformers with compressed-tensors alone, as vLLM's users have it: torchqkit's interpreter-start hook off
    env.update(HF_HUB_OFFLINE="1", TORCHQKIT_NO_STARTUP_HOOK="1")
    subprocess.run([sys.executable, "-c", _HF_LOAD, str(IDS.tolist()), *(str(tmp_path / k) for k in models)],
                   check=True, env=env, cwd=tmp_path, capture_output=True)
    for key, model in models.items():
        theirs = torch.load(tmp_path / key / "logits.pt")
        with torch.no_grad():
            ours = _on_reference_path(model)(IDS).logits
        torch.testing.assert_close(theirs, ours, atol=TRANSFORMERS_ATOL[key], rtol=0, msg=key)


def _on_reference_path(model):
    """A copy of ``model`` whose quantized weights take the reference path (dequantize, fake-quantize activations,
    F.linear): what transformers computes with compressed-tensors. The kernel routes sum in their own order, and with
    quantized activations a last-bit difference can move an activation code of the next layer (float8: 2.6e-3 on
    these logits of ~0.5), so the checkpoint's meaning is compared on the path that sums as transformers does."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        for name, p in list(module._parameters.items()):
            if isinstance(p, qk.AffineQuantizedTensor):
                module._parameters[name] = torch.nn.Parameter(
                    p.with_changes(kernel_preference=qk.KernelPreference.REFERENCE), requires_grad=False)
    return twin


def _ct_checkpoint(directory: Path, **weights):
    """A pack-quantized checkpoint of tiny_llama() made by compressed_tensors' own qparams and compressor (lm_head
    ignored); returns (directory, float model, compressed_tensors' decompressed weight by module)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    model = tiny_llama()
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    compressor = BaseCompressor.load_from_registry("pack-quantized")
    group = weights.get("group_size")
    tensors = {k: v for k, v in model.state_dict().items()
               if k.rsplit(".", 1)[0] not in quantized_linears(model)}
    ref = {}
    for name, m in quantized_linears(model).items():
        w = m.weight.detach()
        blocks = w.reshape(w.shape[0], -1, group) if group else w.unsqueeze(1)
        scale, zp = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights)
        out = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
        ref[name] = compressor.decompress(out, scheme)["weight"]
        tensors.update({f"{name}.{k}": v.contiguous() for k, v in out.items()})
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=["lm_head"],
                            quantization_status="compressed").to_dict()
    config = model.config.to_dict()
    config.update(architectures=["LlamaForCausalLM"], quantization_config=json.loads(json.dumps(qc, default=str)))
    (directory / "config.json").write_text(json.dumps(config))
    return directory, model, ref


@pytest.mark.parametrize("weights", [
    dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
    dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
    dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
], ids=["w4a16_g32", "w4a16_asym_g32", "w8a16_channel"])
def test_compressed_tensors_compressor_output_imports_bit_exactly(tmp_path, weights):
    d, model, ref = _ct_checkpoint(tmp_path, **weights)
    loaded = qk.from_pretrained(d)
    for name, expected in ref.items():
        w = loaded.get_submodule(name).weight
        assert isinstance(w, qk.AffineQuantizedTensor)
        assert torch.equal(w.dequantize(), expected), name
    reference = tiny_llama()
    reference.load_state_dict(model.state_dict())
    for name, expected in ref.items():
        reference.get_submodule(name).weight.data = expected
    with torch.no_grad():  # float32 F.linear on the same weights vs torchqkit's kernels: summation order only
        torch.testing.assert_close(loaded(IDS).logits, reference(IDS).logits, atol=1e-5, rtol=0)
    assert not isinstance(loaded.lm_head.weight, qk.AffineQuantizedTensor)


def _config(d):
    return json.loads((d / "config.json").read_text())


@pytest.mark.parametrize("case, message", [
    ("weight_shape", r"model\.safetensors: tensor model\.layers\.0\.mlp\.up_proj\.weight_shape: records \[128, 32\], "
                     r"but the Linear is \[128, 64\]"),
    ("bits", r"model\.safetensors: tensor model\.layers\.0\.self_attn\.q_proj\.weight_packed is torch\.int32 "
             r"\(64, 8\); expected \(64, 4\)"),
    ("inf_scale", r"model\.safetensors: Linear model\.layers\.1\.self_attn\.v_proj \(weight_packed, weight_scale, "
                  r"weight_shape, weight_zero_point\): scale has 1 NaN/Inf value\(s\); the checkpoint is corrupt"),
    ("format", r"config\.json: quantization_config: config_groups\.group_0: format 'marlin-24' is not one "
               r"torchqkit imports"),
    ("missing", r"tensor model\.layers\.1\.mlp\.down_proj\.weight_scale is missing"),
    ("transform", r"config\.json: quantization_config: transform_config describes transforms \(rotations\), which "
                  r"torchqkit does not import"),
])
def test_hostile_compressed_tensors_refused(tmp_path, case, message):
    d, _, _ = _ct_checkpoint(tmp_path, num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)
    t = load_file(d / "model.safetensors")
    config = _config(d)
    if case == "weight_shape":
        t["model.layers.0.mlp.up_proj.weight_shape"] = torch.tensor([128, 32])
    elif case == "bits":  # the config says 2-bit codes; the words hold 4-bit ones
        config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 2
    elif case == "inf_scale":
        t["model.layers.1.self_attn.v_proj.weight_scale"][3, 1] = float("inf")
    elif case == "format":
        config["quantization_config"]["format"] = "marlin-24"
    elif case == "missing":
        t.pop("model.layers.1.mlp.down_proj.weight_scale")
    elif case == "transform":  # a rotated model: its weights alone don't give its outputs
        config["quantization_config"]["transform_config"] = {"config_groups": {"u": {"type": "hadamard"}}}
    save_file(t, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(qk.CheckpointError, match=message):
        qk.from_pretrained(d)


def test_compressed_tensors_actorder_group_weight_g_idx(tmp_path):
    """compressed-tensors before 0.20 wrote GPTQ's act-order as actorder "group" plus ``weight_g_idx`` (the group
    of each input, weights in their own order): w[n, k] = (q[n, k] - z[n, g_idx[k]]) s[n, g_idx[k]]."""
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    from .hub_fixtures import rtn_groups
    model = tiny_llama()
    gen = torch.Generator().manual_seed(3)
    tensors = {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[0] not in quantized_linears(model)}
    ref = {}
    for name, m in quantized_linears(model).items():
        n, k = m.weight.shape
        g_idx = (torch.arange(k) // 32)[torch.randperm(k, generator=gen)]
        codes, scales, zeros = rtn_groups(m.weight.detach(), g_idx, k // 32)
        signed, zp = (codes.to(torch.int16) - 8).to(torch.int8), (zeros.t() - 8).to(torch.int8)
        tensors.update({f"{name}.weight_packed": ct.pack_to_int32(signed, 4),
                        f"{name}.weight_zero_point": ct.pack_to_int32(zp, 4, packed_dim=0).contiguous(),
                        f"{name}.weight_scale": scales.t().contiguous(), f"{name}.weight_shape": torch.tensor([n, k]),
                        f"{name}.weight_g_idx": g_idx.to(torch.int32)})
        ref[name] = (scales.t()[:, g_idx] * (codes.to(torch.int16) - zeros.t()[:, g_idx]).to(torch.float16))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32,
               "actorder": "group", "dynamic": False}
    config = model.config.to_dict()
    config.update(architectures=["LlamaForCausalLM"], quantization_config={
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}, "ignore": ["lm_head"]})
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = qk.from_pretrained(tmp_path)
    for name, expected in ref.items():
        m = loaded.get_submodule(name)
        assert torch.equal(m.weight.dequantize()[:, torch.argsort(m.input_permutation)], expected), name
    t = load_file(tmp_path / "model.safetensors")
    t["model.layers.0.self_attn.o_proj.weight_g_idx"][7] = -1
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(qk.CheckpointError, match=r"model\.safetensors: tensor model\.layers\.0\.self_attn\.o_proj\."
                                                  r"weight_g_idx: group indices must be in \[0, 2\)"):
        qk.from_pretrained(tmp_path)
