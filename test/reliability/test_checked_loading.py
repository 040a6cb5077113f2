"""A checkpoint whose quantized weights can't be right is refused when loading, naming the file, the tensor and
the problem: NaN / Inf scales and zero points (padding included), integer zero points outside the codes' range,
NaN float8 codes, a non-finite or non-positive static activation scale; through load_quantized and torch.load
alike. Zero and negative weight scales are valid encodings (GGUF imports have them) and load."""
from __future__ import annotations

import io
import json

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

import torchqkit as qk

from ..serialization.models import meta_model, model_input, quantized_model

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    qk.save_quantized(quantized_model(), path)
    return path


def _corrupt(src, dst, name: str, edit):
    """Copy the safetensors file ``src`` to ``dst`` with ``edit`` applied in place to tensor ``name``."""
    with safetensors.safe_open(src, "pt") as f:
        metadata = f.metadata()
    tensors = safetensors.torch.load_file(src)
    edit(tensors[name])
    safetensors.torch.save_file(tensors, dst, metadata=metadata)
    return dst


def _set(index, value):
    def edit(t):
        t[index] = value
    return edit


def _bits(index, byte: int):  # write a raw byte pattern (float8 NaN codes)
    def edit(t):
        t.view(torch.uint8)[index] = byte
    return edit


CASES = [  # (weight, inner tensor, edit, expected problem)
    ("int8_row", "scale", _set((3, 0), NAN), "scale has 1 NaN/Inf"),
    ("int8_dyn", "scale", _set((1, 0), INF), "NaN/Inf"),
    ("int4_tiled", "scale_and_zero", _set((1, 3, 0), NAN), "scale_and_zero has 1 NaN/Inf"),
    ("int4_tiled", "scale_and_zero", _set((0, 7, 1), -INF), "scale_and_zero has 1 NaN/Inf"),  # a zero point
    ("int4_tiled", "scale_and_zero", _set((3, 0, 0), NAN), "scale_and_zero has 1 NaN/Inf"),  # K padding
    ("nf4_dq", "scale_offset", _set(0, NAN), "NaN/Inf"),
    ("nf4_dq", "scale_block_scale", _set(0, INF), "NaN/Inf"),
    ("intx3", "scale", _set((2, 1), NAN), "NaN/Inf"),
    ("intx3", "zero_point", _set((2, 1), 100), "zero_point outside the int3 code range"),
    ("fp8_dyn", "qdata", _bits((4, 9), 0x7F), "qdata has 1 NaN/Inf"),  # e4m3fn NaN
    ("mxfp4", "scale", _set((6, 1), 0xFF), "scale has 1 NaN/Inf"),  # E8M0 NaN
]


@pytest.mark.parametrize("weight,inner,edit,problem", CASES,
                         ids=[f"{w}-{i}-{p.split()[-1]}-{n}" for n, (w, i, _, p) in enumerate(CASES)])
def test_bad_scales_zero_points_and_codes_are_refused(saved, tmp_path, weight, inner, edit, problem):
    name = f"blocks.{weight}.weight"
    bad = _corrupt(saved, tmp_path / "bad.safetensors", f"{name}:{inner}", edit)
    model = meta_model()
    with pytest.raises(qk.CheckpointError) as err:
        qk.load_quantized(model, bad)
    message = str(err.value)
    assert str(bad) in message and repr(name) in message and problem in message, message
    assert all(p.is_meta for p in model.parameters())  # refused before the model was touched
    qk.serialization.read_checkpoint_info(saved)  # the intact file still reads


def test_intact_checkpoint_loads(saved):
    model = qk.load_quantized(meta_model(), saved)
    with torch.no_grad():
        assert torch.isfinite(model(model_input())).all()


@pytest.mark.parametrize("weight,inner,index", [("int8_row", "scale", (5, 0)), ("int4_tiled", "scale_and_zero", (1, 9, 0)),
                                                ("fp8_dyn", "scale", (4, 0))])
def test_zero_and_negative_weight_scales_load(saved, tmp_path, weight, inner, index):
    for value in (0.0, -2.0):  # a zero block / a flipped sign: what GGUF's Q4_0 stores
        ok = _corrupt(saved, tmp_path / "ok.safetensors", f"blocks.{weight}.weight:{inner}", _set(index, value))
        model = qk.load_quantized(meta_model(), ok)
        w = model.blocks[weight].weight
        with torch.no_grad():
            assert torch.isfinite(model(model_input())).all() and torch.isfinite(w.dequantize()).all()


def test_infinite_static_scale_in_a_header_is_refused(tmp_path):
    model = nn.Sequential(nn.Linear(64, 32))
    qk.quantize_(model, qk.Float8StaticActivationFloat8WeightConfig(act_scale=0.5), strict=True)
    path = tmp_path / "static.safetensors"
    qk.save_quantized(model, path)
    for value in ("Infinity", "-Infinity", "NaN", "1e999"):
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        inner = json.loads(header["__metadata__"]["torchqkit"])
        inner["weights"]["0.weight"]["act_quant"]["static_scale"] = 0.5
        text = json.dumps(inner).replace("0.5", value)
        header["__metadata__"]["torchqkit"] = text
        blob = json.dumps(header).encode()
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n:])
        with pytest.raises(qk.CheckpointError, match=r"bad\.safetensors") as err:
            qk.load_quantized(nn.Sequential(nn.Linear(64, 32)), bad)
        assert "Infinity" in str(err.value) or "NaN" in str(err.value) or "static_scale" in str(err.value)


def _torch_load_error(w) -> str:
    buf = io.BytesIO()
    torch.save({"0.weight": w}, buf)
    buf.seek(0)
    with pytest.raises(Exception) as err:  # torch.load may wrap it (weights_only unpickler)
        torch.load(buf, weights_only=True)
    return str(err.value)


def test_torch_load_refuses_what_load_quantized_refuses():
    w = qk.quantize_weight(torch.randn(32, 64), qk.qdtypes.int8, qk.PerRow(), qk.PlainLayout())
    w.scale[7] = NAN
    assert "scale has 1 NaN/Inf value" in _torch_load_error(w)
    act = qk.ActivationQuantSpec(qk.qdtypes.float8_e4m3fn, qk.PerTensor(), static_scale=0.5)
    w = qk.quantize_weight(torch.randn(32, 64), qk.qdtypes.float8_e4m3fn, qk.PerTensor(), qk.Float8Layout(),
                           act_quant=act)
    object.__setattr__(w.act_quant, "static_scale", INF)  # what a doctored pickle holds: no __post_init__ runs
    assert "static_scale is inf" in _torch_load_error(w)


@pytest.mark.parametrize("value", [INF, -INF, NAN, 0.0, -1.0, True, "1.0"])
def test_static_scale_fields_refuse_non_finite_and_non_positive(value):
    with pytest.raises((TypeError, ValueError), match="act_scale"):
        qk.Float8StaticActivationFloat8WeightConfig(act_scale=value)
    with pytest.raises(ValueError, match="static_scale"):
        qk.ActivationQuantSpec(qk.qdtypes.float8_e4m3fn, qk.PerTensor(), static_scale=value)
