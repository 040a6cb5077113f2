"""Workers for test_sharded_loading.py: load a quantized checkpoint into a tensor-parallel meta-device LLaMA."""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

import torchqkit as qk

from .models import llama_tp_plan, tiny_llama
from .tp_workers import TP_CONFIGS


def bytes_read_by_this_process() -> int:
    """Bytes this process has read through read() system calls so far (Linux /proc/self/io "rchar")."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def load_tensor_parallel(rank: int, world: int, directory: str, names) -> dict:
    from accelerate import init_empty_weights
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (world,))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    results = {}
    for name in names:
        path = os.path.join(directory, f"{name}.safetensors")
        model = tiny_llama()
        qk.quantize_(model, TP_CONFIGS[name](), filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear)
                     and fqn != "lm_head")
        with torch.no_grad():
            single = model(ids).logits
        quantized_bytes = sum(p.packed_nbytes() for p in model.parameters() if isinstance(p, qk.AffineQuantizedTensor))
        if rank == 0:
            qk.save_quantized(model, path)
        dist.barrier()
        with init_empty_weights():  # parameters on the meta device, buffers (rotary tables) real
            meta_model = tiny_llama()
        parallelize_module(meta_model, mesh, llama_tp_plan(), src_data_rank=None)
        before = bytes_read_by_this_process()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            qk.load_quantized(meta_model, path)
        read = bytes_read_by_this_process() - before
        with torch.no_grad():
            tp = meta_model(ids).logits
        q = meta_model.model.layers[0].self_attn.q_proj.weight
        results[name] = {"max_diff": (tp - single).abs().max().item(), "bytes_read": read,
                         "file_bytes": os.path.getsize(path), "quantized_bytes": quantized_bytes,
                         "q_local": type(q.to_local()).__name__, "q_requires_grad": q.requires_grad,
                         "warnings": [str(w.message) for w in caught if "load_quantized" in str(w.message)]}
        dist.barrier()
    return results

