"""A quantized LLM across 2 processes (gloo, CPU): tensor-parallel inference, per-rank loading and FSDP2 QLoRA, each
against the same model in one process.

    python -m benchmarks distributed              # starts `torchrun --nproc_per_node 2` on itself; SmolLM2-135M
    python -m benchmarks distributed --quick      # the tiny random LLaMA, shorter prompt and fewer steps

Tensor parallelism shards the MLPs (gate/up ColwiseParallel, down RowwiseParallel) and keeps attention replicated
(SmolLM2 has 9 query / 3 KV heads, which 2 ranks can't split). Rank 0 writes the records.
"""
from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

import torchqkit as qk
from torchqkit.eval.models import eval_text

from .common import cli, llm
from .common.configs import build
from .common.machine import REPO

GROUP = "distributed"
DEFAULT_CONFIGS = ["int8-wo", "int4-wo-g32", "nf4-b64"]
FSDP_CONFIGS = ("nf4-b64", "int4-wo-g32")
MIB = 2**20


def launch(argv) -> int:
    """Runs this group under torchrun, 2 processes on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                            str(port), "-m", "benchmarks", GROUP, *argv], cwd=REPO, env=env)


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


def timed_forward(model, ids, repeats=3):
    import torch.distributed as dist
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


def meta_copy(config):
    """The model's architecture with its parameters on the meta device (buffers such as rotary tables real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def tensor_parallel(base, ids, rank, mesh, configs, rec, shape):
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import parallelize_module
    for name in configs:
        model = copy.deepcopy(base)
        qk.quantize_(model, build(name), filter_fn=linears)
        single, t_single = timed_forward(model, ids)
        full = quantized_bytes(model)
        file = os.path.join(tempfile.gettempdir(), f"benchmarks_distributed_{os.getppid()}.safetensors")
        if rank == 0:
            qk.save_quantized(model, file)
        parallelize_module(model, mesh, mlp_plan(model))
        tp, t_tp = timed_forward(model, ids)
        dist.barrier()
        fresh = meta_copy(model.config)
        parallelize_module(fresh, mesh, mlp_plan(fresh), src_data_rank=None)
        before = bytes_read()
        qk.load_quantized(fresh, file)
        read = bytes_read() - before
        loaded, _ = timed_forward(fresh, ids, repeats=0)
        dist.barrier()
        if rank == 0:
            case = "tensor parallel (MLPs sharded)"
            for metric, value, unit in (
                    ("quantized weights, 1 process", full / MIB, "MiB"),
                    ("quantized weights per rank", quantized_bytes(model) / MIB, "MiB"),
                    ("max abs logit diff, TP vs 1 process", (tp - single).abs().max().item(), ""),
                    ("max abs logit diff, loaded per rank vs 1 process", (loaded - single).abs().max().item(), ""),
                    ("file", os.path.getsize(file) / MIB, "MiB"),
                    ("read per rank", read / MIB, "MiB"),
                    ("forward, 1 process", t_single * 1e3, "ms"),
                    ("forward, TP", t_tp * 1e3, "ms")):
                rec.add(case, name, shape, metric, value, unit)
            os.remove(file)
        del model, fresh


def qlora(base, name):
    model = copy.deepcopy(base)
    qk.quantize_(model, build(name), filter_fn=linears)
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


def fsdp_qlora(base, tokens, rank, world, configs, rec, shape, steps, seq):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    batches = tokens[: steps * 4 * seq].reshape(steps, 4, seq)
    gathered = []
    pre = qk.AffineQuantizedTensor.fsdp_pre_all_gather

    def recording(self, mesh, outer_size, outer_stride, module, mp_policy):  # what each all-gather sends
        out = pre(self, mesh, outer_size, outer_stride, module, mp_policy)
        gathered.append((sum(t.numel() * t.element_size() for t in out[0]), self.numel() * 4))
        return out

    qk.AffineQuantizedTensor.fsdp_pre_all_gather = recording
    try:
        for name in configs:
            single, t_single = train(qlora(base, name), batches)
            model = qlora(base, name)
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
            if rank == 0:
                case = "FSDP2 QLoRA (LoRA r=8, AdamW lr 1e-3)"
                fsdp_shape = {**shape, "steps": steps, "batch": f"4 x {seq}"}
                for metric, value, unit in (
                        ("quantized weights, 1 process", full / MIB, "MiB"),
                        ("quantized weights per rank", quantized_bytes(model) / MIB, "MiB"),
                        ("max rel loss diff, FSDP2 vs 1 process", max(abs(a - b) / a for a, b in zip(single, sharded)),
                         ""),
                        ("all-gathered per step", sum(g[0] for g in gathered) / steps * world / MIB, "MiB"),
                        ("same weights as float32, per step", sum(g[1] for g in gathered) / steps / MIB, "MiB"),
                        ("step, 1 process", t_single, "s"),
                        ("step, FSDP2", t_fsdp, "s")):
                    rec.add(case, name, fsdp_shape, metric, value, unit, losses_1_process=single, losses_fsdp2=sharded)
    finally:
        qk.AffineQuantizedTensor.fsdp_pre_all_gather = pre


def main(argv=None) -> int:
    argv = sys.argv[2:] if argv is None else argv
    p = cli.parser(GROUP, __doc__)
    cli.add_configs(p, DEFAULT_CONFIGS)
    p.set_defaults(threads=1)  # two processes on two cores; the one-process figures use one thread too
    args, rec = cli.start(GROUP, p, argv)  # checks the names before starting any process
    cli.quick(args, argv, configs=["int4-wo-g32"])  # one TP and one FSDP2 row: the processes' start-up is most of it
    if "RANK" not in os.environ:
        return launch(argv)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        mesh = init_device_mesh("cpu", (world,))
        model_llm = llm.load(args.quick)
        tokens = model_llm.tokenize(eval_text()[:20000])
        n = 32 if args.quick else 256
        shape = {"model": model_llm.name, "ranks": world, "prompt_tokens": n}
        tensor_parallel(model_llm.model, tokens[:n].unsqueeze(0), rank, mesh, args.configs, rec, shape)
        fsdp = [c for c in FSDP_CONFIGS if c in args.configs]
        steps, seq = (2, 16) if args.quick else (5, 64)
        fsdp_qlora(model_llm.model, tokens, rank, world, fsdp, rec, shape, steps, seq)
        if rank == 0:
            rec.print_table()
        # both ranks done before either tears gloo down: a rank destroying the group while its peer was still in
        # it aborted now and then ("terminate called without an active exception", SIGABRT)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0
