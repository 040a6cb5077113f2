"""Quantized models beyond one process: tensor-parallel inference, per-rank loading, FSDP2 QLoRA.

Run: torchrun --nproc_per_node 2 tutorials/05_distributed.py   (CPU, gloo, offline; about 7 s on 2 cores)
     python tutorials/05_distributed.py                           (starts the two processes itself)

1. ColwiseParallel / RowwiseParallel on a quantized LLaMA: each rank holds its shard of every weight's packed
   storage (codes, scales, zero points cut together at block / tile boundaries) and runs the same kernel on it.
2. load_quantized onto a tensor-parallel model built on the meta device: each rank reads only its shard.
3. FSDP2 QLoRA: fully_shard a model with frozen NF4 base weights and LoRA adapters; the base weights are
   all-gathered as packed bytes, never as floats.
"""

import gc
import os
import subprocess
import sys
import tempfile

if "RANK" not in os.environ:  # plain `python tutorials/05_distributed.py`: relaunch under torchrun
    import socket
    with socket.socket() as s:  # a free port, so two runs on one machine don't collide
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sys.exit(subprocess.call([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--master_port", str(port), __file__]))

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM

import torchqkit as qk

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))


def say(*args):
    if rank == 0:
        print(*args, flush=True)


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def linears(module, fqn):
    return isinstance(module, nn.Linear) and fqn != "lm_head"


# The usual LLaMA plan: attention heads and MLP columns split over the ranks, outputs summed after o / down.
plan = {}
for i in range(2):
    plan.update({f"model.layers.{i}.self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")})
    plan.update({f"model.layers.{i}.mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")})
    plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
    plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

# ---------------------------------------------------------------------------------------------------------------
# 1. Tensor-parallel inference
# ---------------------------------------------------------------------------------------------------------------
model = llama()
qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=64), filter_fn=linears)
with torch.no_grad():
    single = model(ids).logits  # what one process computes
parallelize_module(model, mesh, plan)
q_proj = model.model.layers[0].self_attn.q_proj.weight  # a DTensor; its local tensor is an AffineQuantizedTensor
say(f"1. q_proj on each rank: {tuple(q_proj.to_local().shape)} of {tuple(q_proj.shape)}: {q_proj.to_local()!r}")
with torch.no_grad():
    tp = model(ids).logits
say(f"   tensor parallel vs one process, max |diff| of the logits: {(tp - single).abs().max().item():.1e}")
assert (tp - single).abs().max() < 1e-5  # RowwiseParallel only changes the order of a float32 sum

# A cut that isn't on a block / tile boundary says what would work:
small = nn.Sequential(nn.Linear(256, 72))
qk.quantize_(small, qk.Int4WeightOnlyConfig(group_size=64))
try:
    parallelize_module(small, mesh, {"0": ColwiseParallel()})
except qk.ShardingError as e:
    say(f"   72 rows over 2 ranks: refused, as expected (qk.ShardingError names the legal cut): {e}")

# ---------------------------------------------------------------------------------------------------------------
# 2. Per-rank loading: a meta-device model, parallelized, then filled from a safetensors file
# ---------------------------------------------------------------------------------------------------------------
path = os.path.join(tempfile.gettempdir(), "torchqkit_tutorial_05.safetensors")
if rank == 0:
    quantized = llama()
    qk.quantize_(quantized, qk.Int4WeightOnlyConfig(group_size=64), filter_fn=linears)
    qk.save_quantized(quantized, path)
dist.barrier()
with init_empty_weights():  # parameters on the meta device (buffers such as rotary tables stay real)
    fresh = llama()
parallelize_module(fresh, mesh, plan, src_data_rank=None)  # nothing to send: the weights come from the file
qk.load_quantized(fresh, path)  # this rank's rows / columns of each sharded tensor, read on their own
with torch.no_grad():
    loaded = fresh(ids).logits
say(f"2. loaded per rank, max |diff| to one process: {(loaded - single).abs().max().item():.1e}")
assert (loaded - single).abs().max() < 1e-5
dist.barrier()
if rank == 0:
    os.remove(path)

# ---------------------------------------------------------------------------------------------------------------
# 3. FSDP2 QLoRA: frozen NF4 base weights + trainable LoRA adapters
# ---------------------------------------------------------------------------------------------------------------



model = llama()
qk.quantize_(model, qk.NF4WeightOnlyConfig(), filter_fn=linears)
torch.manual_seed(1)
qk.add_lora_(model, rank=8)  # freezes the float parameters; every Linear but lm_head gets B A (B = 0)
full_bytes = sum(p.packed_nbytes() for p in model.parameters() if isinstance(p, qk.AffineQuantizedTensor))
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
local_bytes = sum(p.to_local().packed_nbytes() for p in model.parameters()
                  if isinstance(p.to_local(), qk.AffineQuantizedTensor))
say(f"3. NF4 base weights: {full_bytes:,} bytes packed, {local_bytes:,} on each rank")
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
batch = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(2))[2 * rank: 2 * rank + 2]
for step in range(5):
    loss = model(batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    say(f"   step {step}: loss {mean.item() / world:.4f}")

# Shut down while the interpreter is whole: first drop the models and the optimizer (FSDP2 and DTensor objects hold
# tensors of the group's last collectives), then let every rank arrive before the group goes. A rank that left
# those to interpreter finalization, or tore gloo down while the other still read from it, aborted at exit under
# load ("terminate called without an active exception") after everything above had run.
del model, opt, fresh, q_proj, loss, mean
gc.collect()
dist.barrier()
dist.destroy_process_group()
