"""Workers for test_tensor_parallel.py (importable by spawned processes)."""
from __future__ import annotations

import warnings

import torch

import torchqkit as qk

from ..common import sqnr
from .models import llama_tp_plan, tiny_llama

# Every layout, as its config makes it (int8-dynamic: plain int8 codes with a per-token activation spec).
TP_CONFIGS = {
    "int8": lambda: qk.Int8WeightOnlyConfig(),
    "int4_tiled": lambda: qk.Int4WeightOnlyConfig(group_size=64),
    "nf4": lambda: qk.NF4WeightOnlyConfig(),
    "nf4_double_quant": lambda: qk.NF4WeightOnlyConfig(double_quant=True),
    "packed_int3": lambda: qk.IntxWeightOnlyConfig(bits=3),
    "float8": lambda: qk.Float8WeightOnlyConfig(),
    "mxfp4": lambda: qk.MXFP4WeightOnlyConfig(),
    "mxfp8": lambda: qk.MXFP8WeightOnlyConfig(),
    "nvfp4": lambda: qk.NVFP4WeightOnlyConfig(),
    "fp6": lambda: qk.FP6WeightOnlyConfig(ebits=2, group_size=32),
    "nm_sparse_int4": lambda: qk.SparsityConfig(base=qk.Int4WeightOnlyConfig(group_size=64)),
    "nm_sparse_float": lambda: qk.SparsityConfig(),
    "int8_dynamic": lambda: qk.Int8DynamicActivationInt8WeightConfig(),
}


def tensor_parallel_llama(rank: int, world: int, names, src_data_rank) -> dict:
    """Logits of the tiny LLaMA quantized with each config: float, one process, tensor parallel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (world,))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    results = {}
    for name in names:
        model = tiny_llama()
        with torch.no_grad():
            float_logits = model(ids).logits
        qk.quantize_(model, TP_CONFIGS[name](),
                     filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn != "lm_head")
        q_proj = model.model.layers[0].self_attn.q_proj.weight
        full_bytes = q_proj.packed_nbytes()
        with torch.no_grad():
            single = model(ids).logits
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            parallelize_module(model, mesh, llama_tp_plan(), src_data_rank=src_data_rank)
        local = model.model.layers[0].self_attn.q_proj.weight.to_local()
        with torch.no_grad():
            tp = model(ids).logits
        results[name] = {"max_diff": (tp - single).abs().max().item(), "sqnr_single": sqnr(float_logits, single),
                         "sqnr_tp": sqnr(float_logits, tp), "local_type": type(local).__name__,
                         "local_shape": tuple(local.shape), "local_bytes": local.packed_nbytes(),
                         "full_bytes": full_bytes, "warnings": [str(w.message) for w in caught]}
    return results


def illegal_cut(rank: int, world: int) -> dict:
    """ColwiseParallel on an int4 tiled weight of 72 rows: 36 per rank cuts an 8-row tile."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 72))
    qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=64))
    before = model[0].weight
    try:
        parallelize_module(model, mesh, {"0": ColwiseParallel()})
        return {"error": None}
    except qk.ShardingError as e:
        return {"error": str(e), "unchanged": model[0].weight is before}


def tensor_parallel_suite(rank: int, world: int) -> dict:
    """Everything test_tensor_parallel.py checks, in one pair of processes (starting them costs seconds)."""
    return {"scatter": tensor_parallel_llama(rank, world, list(TP_CONFIGS), 0),
            "local": tensor_parallel_llama(rank, world, ["int4_tiled", "nf4_double_quant"], None),
            "illegal": illegal_cut(rank, world)}
