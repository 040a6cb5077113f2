"""save_quantized / load_quantized: round trips for every layout, ties, shards, and one clear error per
kind of bad file (truncated, lying header, unknown layout, missing / extra tensor, newer format)."""
from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

import torchqkit as qk
from torchqkit.serialization import read_checkpoint_info

from .headers import edit_tensors, edit_torchqkit, read_header, write_header
from .models import meta_model, model_input, module_configs, quantized_model


@pytest.fixture(scope="module")
def model():
    return quantized_model()


@pytest.fixture
def saved(model, tmp_path):
    path = tmp_path / "model.safetensors"
    qk.save_quantized(model, path, config=module_configs())
    return path


def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name, ta in sa.items():
        tb = sb[name]
        assert type(ta) is type(tb), name
        if isinstance(ta, qk.AffineQuantizedTensor):
            assert ta.attributes() == tb.attributes(), name
            for inner, t in ta.inner_tensors().items():
                other = tb.inner_tensors()[inner]
                assert (t is None) == (other is None), (name, inner)
                if t is not None:
                    assert t.dtype == other.dtype and torch.equal(t.view(torch.uint8), other.view(torch.uint8))
                    assert other.data_ptr() % 64 == 0  # fresh allocations, see docs/platform.md "Serialization"
        else:
            assert ta.dtype == tb.dtype and torch.equal(ta, tb), name


def test_round_trip_into_meta_model_is_exact(model, saved):
    fresh = qk.load_quantized(meta_model(), saved)
    _assert_same_weights(model, fresh)
    x = model_input()
    assert torch.equal(fresh(x), model(x))
    assert fresh.head.weight is fresh.embed.weight  # the tie survives
    assert not fresh.blocks["int8_row"].weight.requires_grad and fresh.blocks["kept"].weight.requires_grad
    assert "PlainLayout()" in repr(fresh.blocks["int8_row"])


def test_loading_never_unpickles(model, saved, monkeypatch):
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("load_quantized must not unpickle")
    for obj, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(obj, name, refuse)
    _assert_same_weights(model, qk.load_quantized(meta_model(), saved))


def test_load_inside_a_meta_device_context(model, saved):
    with torch.device("meta"):
        fresh = qk.load_quantized(meta_model(), saved)  # allocations are explicit CPU ones
    _assert_same_weights(model, fresh)


def test_round_trip_into_float_model(model, saved):
    torch.manual_seed(5)
    from .models import AllLayouts
    fresh = qk.load_quantized(AllLayouts().eval(), saved)
    _assert_same_weights(model, fresh)


def test_file_is_plain_safetensors_with_documented_names(model, saved):
    tensors = safetensors.torch.load_file(saved)  # any safetensors reader can open it
    assert "blocks.int4_tiled.weight:qdata" in tensors and "blocks.int4_tiled.weight:scale_and_zero" in tensors
    assert "blocks.nf4_dq.weight:scale_codes" in tensors and "blocks.nf4_dq.weight:scale" not in tensors
    assert "embed.weight" in tensors and "head.weight" not in tensors  # tied: stored once
    assert torch.equal(tensors["blocks.int8_row.weight:qdata"], model.blocks["int8_row"].weight.qdata)
    meta = read_header(saved)[0]["__metadata__"]
    header = json.loads(meta["torchqkit"])
    assert meta["torchqkit_format"] == "1" and header["format_version"] == 1
    assert header["tied"] == {"head.weight": "embed.weight"}
    assert header["weights"]["blocks.int4_tiled.weight"] == {
        "layout": {"type": "tensor_core_tiled", "inner_k_tiles": 8}, "qdtype": "uint4", "block_size": [1, 32],
        "shape": [64, 64], "dtype": "float32", "zero_point_domain": "float", "transposed": False,
        "kernel_preference": "auto", "act_quant": None, "tensors": ["qdata", "scale_and_zero"]}
    assert header["weights"]["blocks.int8_dyn.weight"]["act_quant"] == {
        "qdtype": "int8", "granularity": {"type": "PerToken"}, "mapping": "symmetric", "static_scale": None}


def test_config_and_summary_are_recorded(model, tmp_path):
    summary = qk.save_quantized(model, tmp_path / "m.safetensors", config=module_configs())
    assert len(summary.quantized) == 7 and summary.tied == {"head.weight": "embed.weight"}
    assert "blocks.kept.weight" in summary.plain and "head.weight is tied to embed.weight" in str(summary)
    info = read_checkpoint_info(tmp_path / "m.safetensors")
    assert info["config"] == module_configs() and len(info["quantized"]) == 7


def test_compiled_model_saves_under_its_own_names(model, tmp_path):
    qk.save_quantized(torch.compile(model), tmp_path / "c.safetensors")
    fresh = qk.load_quantized(torch.compile(meta_model()), tmp_path / "c.safetensors")
    _assert_same_weights(model, fresh._orig_mod)


def test_sharded_save_and_load(model, tmp_path):
    limit = 6000
    summary = qk.save_quantized(model, tmp_path / "model.safetensors", max_shard_bytes=limit)
    *shards, index = summary.files
    assert len(shards) > 3 and index.name == "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    for shard in shards:
        names = list(safetensors.torch.load_file(shard))
        assert all(weight_map[n] == shard.name for n in names)
        weights = {n.split(":")[0] for n in names}
        assert len(weights) == 1 or shard.stat().st_size <= limit + 4096  # one oversized group, or within the limit
    assert weight_map["blocks.nf4_dq.weight:qdata"] == weight_map["blocks.nf4_dq.weight:scale_offset"]
    for path in (index, tmp_path, tmp_path / "model.safetensors"):  # the index, the folder, or the base name
        fresh = qk.load_quantized(meta_model(), path)
        _assert_same_weights(model, fresh)


# ------------------------------------------------------------------------------------------ bad files

def _load_error(path) -> str:
    fresh = meta_model()
    with pytest.raises(qk.CheckpointError) as info:
        qk.load_quantized(fresh, path)
    assert all(p.is_meta for p in fresh.parameters())  # validated before anything was assigned
    return str(info.value)


def test_truncated_file(saved):
    raw = saved.read_bytes()
    saved.write_bytes(raw[:-100])
    msg = _load_error(saved)
    assert "truncated file" in msg and "tensor 'norm.bias'" in msg  # the last tensor written
    saved.write_bytes(raw[:5])
    assert "truncated file" in _load_error(saved)
    saved.write_bytes(raw[:200])
    assert "header length" in _load_error(saved)


def test_header_lying_about_logical_shape(saved):
    edit_torchqkit(saved, lambda h: h["weights"]["blocks.intx3.weight"].update(shape=[64, 96]))
    msg = _load_error(saved)
    assert "'blocks.intx3.weight'" in msg and "qdata has shape [64, 24]" in msg and "needs [64, 36]" in msg


def test_header_lying_about_stored_shape(saved):
    def lie(h):
        e = h["blocks.mxfp4.weight:qdata"]
        e["shape"] = [e["shape"][1], e["shape"][0]]  # same byte count, other shape
    edit_tensors(saved, lie)
    msg = _load_error(saved)
    assert "'blocks.mxfp4.weight'" in msg and "doesn't match the data" in msg


def test_header_whose_byte_count_disagrees(saved):
    edit_tensors(saved, lambda h: h["blocks.int8_row.weight:qdata"].update(shape=[64, 65]))
    assert "'blocks.int8_row.weight:qdata'" in _load_error(saved)


def test_unknown_layout_and_knob(saved, tmp_path):
    raw = saved.read_bytes()
    edit_torchqkit(saved, lambda h: h["weights"]["blocks.int4_tiled.weight"]["layout"].update(type="marlin"))
    msg = _load_error(saved)
    assert "'blocks.int4_tiled.weight'" in msg and "unknown layout 'marlin'" in msg and "tensor_core_tiled" in msg
    saved.write_bytes(raw)
    edit_torchqkit(saved, lambda h: h["weights"]["blocks.nf4_dq.weight"]["layout"].update(groups=3))
    assert "layout 'nf4' has no knob 'groups'" in _load_error(saved)
    saved.write_bytes(raw)
    edit_torchqkit(saved, lambda h: h["weights"]["blocks.int4_tiled.weight"]["layout"].update(inner_k_tiles=4))
    assert "needs [8, 1, 32, 2]" in _load_error(saved)  # other knob: other packed shape


def test_missing_and_extra_tensors(saved, tmp_path):
    tensors = safetensors.torch.load_file(saved)
    meta = read_header(saved)[0]["__metadata__"]
    for drop, expect in (("blocks.fp8_dyn.weight:scale", "missing tensor blocks.fp8_dyn.weight:scale"),
                         ("norm.bias", "missing tensor 'norm.bias'")):
        path = tmp_path / f"drop{len(expect)}.safetensors"
        safetensors.torch.save_file({k: v for k, v in tensors.items() if k != drop}, path, metadata=meta)
        assert expect in _load_error(path)
    for extra, expect in (("blocks.fp8_dyn.weight:bonus", "extra tensor 'blocks.fp8_dyn.weight:bonus'"),
                          ("ghost.weight", "extra tensor 'ghost.weight'")):
        path = tmp_path / f"extra{len(expect)}.safetensors"
        safetensors.torch.save_file({**tensors, extra: torch.zeros(2)}, path, metadata=meta)
        assert expect in _load_error(path)


def test_model_mismatch(saved):
    fresh = meta_model()
    with torch.device("meta"):
        fresh.blocks["kept"] = torch.nn.Linear(64, 63, bias=False)
    with pytest.raises(qk.CheckpointError, match=r"'blocks.kept.weight' has shape \[64, 64\], the model's is \[63, 64\]"):
        qk.load_quantized(fresh, saved)


def test_versions_and_foreign_files(saved, tmp_path):
    raw = saved.read_bytes()
    edit_torchqkit(saved, lambda h: h.update(format_version=2))
    assert "torchqkit format 2" in _load_error(saved) and "upgrade torchqkit" in _load_error(saved)
    saved.write_bytes(raw)
    edit_tensors(saved, lambda h: h["__metadata__"].update(torchqkit_format="7"))
    assert "disagrees" in _load_error(saved)
    plain = tmp_path / "float.safetensors"
    safetensors.torch.save_file({"a": torch.zeros(2)}, plain)
    assert "not a torchqkit checkpoint" in _load_error(plain)
    assert "no such checkpoint" in _load_error(tmp_path / "nope.safetensors")
    saved.write_bytes(raw)
    edit_torchqkit(saved, lambda h: h["weights"]["blocks.int8_row.weight"].update(dtype="float64"))
    assert "dtype must be one of" in _load_error(saved)


def test_bad_inner_dtype(saved, tmp_path):
    tensors = safetensors.torch.load_file(saved)
    meta = read_header(saved)[0]["__metadata__"]
    tensors["blocks.int4_tiled.weight:qdata"] = tensors["blocks.int4_tiled.weight:qdata"].view(torch.float32)
    path = tmp_path / "dtype.safetensors"
    safetensors.torch.save_file(tensors, path, metadata=meta)
    assert "qdata has dtype torch.float32" in _load_error(path)


def test_index_cannot_point_outside_its_folder(model, tmp_path):
    qk.save_quantized(model, tmp_path / "model.safetensors", max_shard_bytes=6000)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["embed.weight"] = "../elsewhere.safetensors"
    index.write_text(json.dumps(data))
    assert "must be a .safetensors file name in the index's directory" in _load_error(index)


def test_save_refuses_meta_and_non_tensors(tmp_path):
    with pytest.raises(ValueError, match="tensor 'step' is on the meta device"):
        qk.save_quantized(meta_model(), tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match="'a' is a int"):
        qk.save_quantized({"a": 1}, tmp_path / "x.safetensors")


def test_transposed_weight_and_kernel_preference_round_trip(tmp_path):
    w = qk.quantize_weight(torch.randn(48, 64), qk.qdtypes.int4, qk.PerGroup(32), qk.PackedIntxLayout(),
                           kernel_preference=qk.KernelPreference.REFERENCE)
    holder = torch.nn.Module()
    holder.w = torch.nn.Parameter(w.t(), requires_grad=False)  # outer shape (64, 48)
    qk.save_quantized(holder, tmp_path / "t.safetensors")
    fresh = torch.nn.Module()
    fresh.w = torch.nn.Parameter(torch.empty(64, 48, device="meta"))
    qk.load_quantized(fresh, tmp_path / "t.safetensors")
    assert fresh.w.transposed and fresh.w.kernel_preference is qk.KernelPreference.REFERENCE
    assert fresh.w.attributes() == holder.w.attributes()
    assert torch.equal(fresh.w.dequantize(), holder.w.dequantize())
