"""Quantized SmolLM2-135M across 2 processes (gloo, CPU): tensor-parallel inference, per-rank loading and FSDP2
QLoRA, each against the same model in one process.

Run: python benchmarks/bench_distributed.py   (starts `torchrun --nproc_per_node 2` on itself)

Tensor parallelism shards the MLPs (gate/up ColwiseParallel, down RowwiseParallel) and keeps attention
replicated: SmolLM2 has 9 query / 3 KV heads, which 2 ranks can't split. Prints markdown tables.
"""
from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import tempfile
import time

if "RANK" not in os.environ:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sys.exit(subprocess.call([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--master_port", str(port), __file__, *sys.argv[1:]]))

import torch
import torch.distributed as dist
from torch import nn

import torchqkit as qk
from torchqkit.eval.models import eval_text, load_gguf, smollm2_gguf_path

CONFIGS = {
    "int8 weight-only": lambda: qk.Int8WeightOnlyConfig(),
    "int4 g32 (tiled)": lambda: qk.Int4WeightOnlyConfig(group_size=32),
    "nf4 b64": lambda: qk.NF4WeightOnlyConfig(),
}
TOKENS = 256


def linears(module, fqn):
    return isinstance(module, nn.Linear) and fqn != "lm_head"


def mlp_plan(model) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {}
    for i in range(len(model.model.layers)):
        plan[f"model.layers.{i}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.up_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    return plan


def quantized_bytes(model) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if isinstance(local, qk.AffineQuantizedTensor):
            total += local.packed_nbytes()
    return total


def timed_forward(model, ids, repeats=3) -> tuple[torch.Tensor, float]:
    with torch.no_grad():
        out = model(ids).logits
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            model(ids)
        dist.barrier()
    return out, (time.perf_counter() - start) / max(repeats, 1)


def bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def tensor_parallel(base, ids, rank, mesh) -> list[str]:
    from torch.distributed.tensor.parallel import parallelize_module
    rows = []
    for name, config in CONFIGS.items():
        model = copy.deepcopy(base)
        qk.quantize_(model, config(), filter_fn=linears)
        single, t_single = timed_forward(model, ids)
        full = quantized_bytes(model)
        file = os.path.join(tempfile.gettempdir(), f"bench_distributed_{os.getppid()}.safetensors")
        if rank == 0:
            qk.save_quantized(model, file)
        parallelize_module(model, mesh, mlp_plan(model))
        tp, t_tp = timed_forward(model, ids)
        dist.barrier()
        fresh = _meta_smollm2(model.config)
        parallelize_module(fresh, mesh, mlp_plan(fresh), src_data_rank=None)
        before = bytes_read()
        qk.load_quantized(fresh, file)
        read = bytes_read() - before
        loaded, _ = timed_forward(fresh, ids, repeats=0)
        dist.barrier()
        if rank == 0:
            rows.append(f"| {name} | {full / 2**20:.1f} | {quantized_bytes(model) / 2**20:.1f} | "
                        f"{(tp - single).abs().max().item():.1e} | {(loaded - single).abs().max().item():.1e} | "
                        f"{os.path.getsize(file) / 2**20:.1f} | {read / 2**20:.1f} | "
                        f"{t_single * 1e3:.0f} | {t_tp * 1e3:.0f} |")
            os.remove(file)
        del model, fresh
    return rows


def _meta_smollm2(config):
    """SmolLM2's architecture with its parameters on the meta device (buffers such as rotary tables real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()



def qlora_smollm2(base, config):
    model = copy.deepcopy(base)
    qk.quantize_(model, config(), filter_fn=linears)
    torch.manual_seed(1)
    qk.add_lora_(model, rank=8)  # freezes the float parameters, wraps every Linear but lm_head
    return model.train()


def train(model, batches, mean=lambda loss: loss.item()):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses, start = [], time.perf_counter()
    for ids in batches:
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean(loss.detach()))
    return losses, (time.perf_counter() - start) / len(batches)


def fsdp_qlora(base, tokens, rank, world, steps=5) -> list[str]:
    from torch.distributed.fsdp import fully_shard
    batches = tokens[: steps * 4 * 64].reshape(steps, 4, 64)
    gathered = []
    pre = qk.AffineQuantizedTensor.fsdp_pre_all_gather

    def recording(self, mesh, outer_size, outer_stride, module, mp_policy):
        out = pre(self, mesh, outer_size, outer_stride, module, mp_policy)
        gathered.append((sum(t.numel() * t.element_size() for t in out[0]), self.numel() * 4))
        return out

    qk.AffineQuantizedTensor.fsdp_pre_all_gather = recording
    rows = []
    for name in ("nf4 b64", "int4 g32 (tiled)"):
        single, t_single = train(qlora_smollm2(base, CONFIGS[name]), batches)
        model = qlora_smollm2(base, CONFIGS[name])
        full = quantized_bytes(model)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        gathered.clear()
        per = 4 // world

        def mean(loss):
            dist.all_reduce(loss)
            return loss.item() / world

        sharded, t_fsdp = train(model, batches[:, rank * per:(rank + 1) * per], mean)
        sent = sum(g[0] for g in gathered) / steps * world  # every rank's shard, per step
        as_float = sum(g[1] for g in gathered) / steps
        if rank == 0:
            diff = max(abs(a - b) / a for a, b in zip(single, sharded))
            rows.append(f"| {name} | {full / 2**20:.1f} | {quantized_bytes(model) / 2**20:.1f} | "
                        f"{' / '.join(f'{x:.4f}' for x in single)} | {' / '.join(f'{x:.4f}' for x in sharded)} | "
                        f"{diff:.1e} | {sent / 2**20:.1f} | {as_float / 2**20:.1f} | {t_single:.2f} | {t_fsdp:.2f} |")
    qk.AffineQuantizedTensor.fsdp_pre_all_gather = pre
    return rows


def main():
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)  # two processes on two cores; the one-process numbers use one thread too
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    base, tokenizer = load_gguf(smollm2_gguf_path())
    tokens = tokenizer(eval_text()[:20000], return_tensors="pt").input_ids[0]
    ids = tokens[:TOKENS].unsqueeze(0)
    tp_rows = tensor_parallel(base, ids, rank, mesh)
    fsdp_rows = fsdp_qlora(base, tokens, rank, world)
    if rank == 0:
        print(f"\n### Tensor parallel (MLPs sharded over {world} ranks), SmolLM2-135M, {TOKENS}-token prompt\n")
        print("| config | quantized MiB, 1 process | per rank | max abs logit diff, TP vs 1 process | "
              "loaded per rank: diff | file MiB | read per rank MiB | forward ms, 1 process | forward ms, TP |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        print("\n".join(tp_rows))
        print(f"\n### FSDP2 QLoRA (LoRA r=8 on every Linear, AdamW lr 1e-3), 5 steps of 4 x 64 tokens, {world} ranks\n")
        print("| base | quantized MiB, 1 process | per rank | losses, 1 process | losses, FSDP2 | max rel diff | "
              "all-gathered MiB / step | same weights as float32 MiB | s / step, 1 process | s / step, FSDP2 |")
        print("|---|---:|---:|---|---|---:|---:|---:|---:|---:|")
        print("\n".join(fsdp_rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
