"""PEFT LoRA on torchqkit weights of every layout: adapters train, save and reload; merge_and_unload() folds them
into the quantized weight (Note [Merging into a quantized weight]): the same layout and format, the weight equal
to quantizing dequantize() + B A again, the logits close to the unmerged model's."""
from __future__ import annotations

import os

import pytest
import torch

import torchqkit as qk
from test.common import small_hf_llama
from torchqkit.api.configs import recipe_for

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read by huggingface_hub at import: before transformers
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

IDS = torch.arange(32).reshape(2, 16) * 5 % 128
TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]
# One config per layout (and the dynamic-activation variant of the plain one).
CONFIGS = {"plain_int8": qk.Int8WeightOnlyConfig(), "tensor_core_tiled": qk.Int4WeightOnlyConfig(group_size=32),
           "packed_intx": qk.IntxWeightOnlyConfig(), "nf4": qk.NF4WeightOnlyConfig(block_size=32),
           "float8": qk.Float8WeightOnlyConfig(), "mx": qk.MXFP4WeightOnlyConfig(),
           "nvfp4": qk.NVFP4WeightOnlyConfig(), "fp6": qk.FP6WeightOnlyConfig(),
           "plain_int8_dynamic": qk.Int8DynamicActivationInt8WeightConfig()}


def _float_model():
    return small_hf_llama()


def _quantized(config):
    model = _float_model()
    qk.quantize_(model, config, strict=True)
    return model


def _train(model, steps=3):
    """A few AdamW steps of next-token loss; returns the losses."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lora_trains_saves_reloads_and_merges(name, tmp_path):
    config = CONFIGS[name]
    base = _quantized(config)
    layer = base.model.layers[0].mlp.down_proj
    frozen = {n: t.clone() for n, t in layer.weight.inner_tensors().items() if t is not None}
    layout = type(layer.weight.qlayout)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    losses = _train(model)
    assert losses[-1] < losses[0], losses
    for n, t in model.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight.inner_tensors().items():
        if t is not None:
            assert torch.equal(t, frozen[n]), f"training changed the frozen base weight's {n}"
    model.eval()
    with torch.no_grad():
        unmerged = model(IDS).logits
    model.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(_quantized(config), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, unmerged)

    lora_layer = model.base_model.model.model.layers[0].mlp.down_proj
    expected = recipe_for(config).quantize(lora_layer.base_layer.weight.dequantize()
                                           + lora_layer.get_delta_weight("default"))
    merged = model.merge_and_unload()
    weight = merged.model.layers[0].mlp.down_proj.weight
    assert isinstance(weight, qk.AffineQuantizedTensor) and type(weight.qlayout) is layout
    assert weight.qdtype == expected.qdtype and weight.block_size == expected.block_size
    # Quantized again the way the config's recipe quantizes a float weight (round-to-nearest): the same values.
    assert torch.equal(weight.dequantize(), expected.dequantize())
    with torch.no_grad():
        merged_logits = merged(IDS).logits
        float_logits = _float_model()(IDS).logits
    # Requantizing the merged weights adds rounding error of the format's own size, so the merged model stays as
    # close to the unmerged one as the quantized base is to the float model (the errors are alike: one rounding
    # of every merged weight to the same grid).
    quantization_error = (unmerged - float_logits).abs().max()
    assert (merged_logits - unmerged).abs().max() <= quantization_error
    merged.save_pretrained(tmp_path / "merged")  # a torchqkit checkpoint of the merged weights
    with torch.no_grad():
        assert torch.equal(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(IDS).logits,
                           merged_logits)


def test_merge_refusals_leave_the_weight_unchanged():
    layer = torch.nn.Linear(64, 32)
    qk.quantize_(layer, qk.Int4WeightOnlyConfig(group_size=32))
    before = layer.weight.dequantize()
    with pytest.raises(ValueError, match=r"add_ into a quantized weight \(TensorCoreTiledLayout, uint4\): the sum "
                                         r"has NaN or Inf"):
        layer.weight.data += torch.full((32, 64), float("nan"))
    with pytest.raises(ValueError, match=r"an update of shape \(32, 63\) doesn't fit the weight's shape \(32, 64\)"):
        layer.weight.data += torch.ones(32, 63)
    assert torch.equal(layer.weight.dequantize(), before)


def test_unmerge_subtracts():
    """peft's unmerge runs weight.data -= delta: the weight goes back to the base, up to one more rounding."""
    layer = torch.nn.Linear(64, 32)
    qk.quantize_(layer, qk.Int8WeightOnlyConfig())
    before = layer.weight.dequantize()
    delta = torch.randn(32, 64) * 0.01
    layer.weight.data += delta
    layer.weight.data -= delta
    step = layer.weight.inner_tensors()["scale"].abs().max()  # int8 per-row: one code step is the row's scale
    assert (layer.weight.dequantize() - before).abs().max() <= 2 * step
