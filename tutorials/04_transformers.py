"""transformers: quantize while loading, save_pretrained, and from_pretrained of the quantized checkpoint.

Run: python tutorials/04_transformers.py   (CPU; a small random-weight LLaMA; about 5 s on 2 cores)

`import torchqkit` registers quant_method "torchqkit" with transformers, so its own from_pretrained quantizes a
float checkpoint as it loads (quantization_config=qk.TorchqkitConfig(...)) and loads torchqkit checkpoints.
"""
import copy
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import torchqkit as qk

torch.manual_seed(0)
config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
float_model = LlamaForCausalLM(config).eval()
ids = torch.randint(0, 512, (1, 16))
configs = qk.ModuleConfigs({r"re:.*\.mlp\..*": qk.Int4WeightOnlyConfig(group_size=64),
                            "_default": qk.Int8WeightOnlyConfig()})

with tempfile.TemporaryDirectory() as tmp:
    float_dir, int4_dir = Path(tmp) / "float", Path(tmp) / "quantized"
    float_model.save_pretrained(float_dir)

    # 1. Quantize while loading: each float Linear weight is quantized as it is read, no float copy kept.
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=qk.TorchqkitConfig(configs))
    print(model.torchqkit_report)

    # The same model as quantize_ on the float model, logits bit for bit.
    reference = copy.deepcopy(float_model)
    qk.quantize_(reference, configs)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)

    # 2. save_pretrained writes torchqkit's checkpoint (config.json records the quantization); any script that
    #    imports torchqkit loads it back with transformers' own from_pretrained.
    model.save_pretrained(int4_dir)
    print("saved:", sorted(p.name for p in int4_dir.iterdir()))
    again = AutoModelForCausalLM.from_pretrained(int4_dir)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    print("reloaded:", type(again.model.layers[0].mlp.up_proj.weight).__name__)

    # 3. generate() works on the quantized model as on any transformers model.
    out = again.generate(ids, max_new_tokens=8, do_sample=False)
    print("generated token ids:", out[0, 16:].tolist())
