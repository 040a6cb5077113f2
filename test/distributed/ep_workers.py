"""Workers for test_expert_parallel.py (importable by spawned processes)."""
from __future__ import annotations

import torch

import torchqkit as qk

from ..moe.models import IMPLEMENTATIONS, expert_stacks, tiny_moe

# One config per kind of layout a stack can have (tiled int4, plain int8, NF4, float8, MX, activation-quantized).
EP_CONFIGS = {
    "int4_tiled": lambda: qk.Int4WeightOnlyConfig(group_size=32),
    "int8": lambda: qk.Int8WeightOnlyConfig(),
    "nf4": lambda: qk.NF4WeightOnlyConfig(),
    "float8": lambda: qk.Float8WeightOnlyConfig(),
    "mxfp4": lambda: qk.MXFP4WeightOnlyConfig(),
    "int8_dynamic": lambda: qk.Int8DynamicActivationInt8WeightConfig(),
}
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
HIDDEN = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(2))


def _outputs(model, impls) -> dict:
    """Per experts implementation: the first MoE block's output on HIDDEN and the logits on IDS."""
    out = {}
    for impl in impls:
        model.set_experts_implementation(impl)
        with torch.no_grad():
            block = model.model.layers[0].mlp(HIDDEN)  # gpt-oss's MLP also returns its router scores
            out[impl] = (block[0] if isinstance(block, tuple) else block, model(IDS).logits)
    return out


def _compare(single: dict, parallel: dict) -> dict:
    return {impl: {"block": (parallel[impl][0] - single[impl][0]).abs().max().item(),
                   "logits": (parallel[impl][1] - single[impl][1]).abs().max().item(),
                   "block_scale": single[impl][0].abs().max().item()} for impl in single}


def expert_parallel_model(rank: int, world: int, name: str, config: str | None, src_data_rank,
                          impls=IMPLEMENTATIONS) -> dict:
    """A tiny MoE model quantized with ``config`` (None: float), its outputs in one process and with its experts
    sharded over the ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    mesh = init_device_mesh("cpu", (world,))
    model = tiny_moe(name)
    if config is not None:
        qk.quantize_(model, EP_CONFIGS[config](), strict=True)
    stacks = expert_stacks(model)
    full = {n: (tuple(s.shape), s.packed_nbytes()) for n, s in stacks.items()}
    experts_fqn = "model.layers.0.mlp.experts"
    whole = model.get_submodule(experts_fqn).gate_up_proj.detach()
    single = _outputs(model, impls)
    names = qk.parallelize_experts_(model, mesh, src_data_rank=src_data_rank)
    experts = model.get_submodule(experts_fqn)
    gate_up = experts.gate_up_proj
    local = gate_up.to_local()
    result = {"names": names, "param_type": type(gate_up.data).__name__, "is_dtensor": isinstance(gate_up, DTensor),
              "placements": [str(p) for p in gate_up.placements], "global_shape": tuple(gate_up.shape),
              "local_type": type(local).__name__, "local_shape": tuple(local.shape), "num_experts": experts.num_experts,
              "full": full, "diffs": _compare(single, _outputs(model, impls))}
    if isinstance(local, qk.AffineQuantizedTensor):
        per_rank = local.shape[0]
        mine = whole[rank * per_rank:(rank + 1) * per_rank]  # w[ids] of the whole stack: a copy of those experts
        result["local_bytes"] = local.packed_nbytes()
        result["local_equals_whole"] = torch.equal(local.dequantize(), mine.dequantize())
        # The shard's own expert ops: select one expert, and the selection transformers' batched path makes.
        x = torch.randn(3, local.shape[-1], generator=torch.Generator().manual_seed(rank))
        linear = torch.nn.functional.linear
        result["select_diff"] = (linear(x, local[1]) - linear(x, whole[rank * per_rank + 1])).abs().max().item()
        # DTensor.from_local: the shards each rank holds make the same global stack.
        rebuilt = DTensor.from_local(local, mesh, [torch.distributed.tensor.Shard(0)], run_check=False)
        result["from_local_shape"] = tuple(rebuilt.shape)
        result["from_local_same"] = rebuilt.to_local() is local or torch.equal(rebuilt.to_local().dequantize(),
                                                                              local.dequantize())
    return result


def refusals(rank: int, world: int) -> dict:
    """Bad input: experts that don't split over the ranks, Shard(1) of a stack, and a second parallelize."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    model = tiny_moe("qwen3_moe", num_experts=5)
    qk.quantize_(model, qk.Int8WeightOnlyConfig(), strict=True)
    before = dict(model.named_parameters())
    try:
        qk.parallelize_experts_(model, mesh)
        out["uneven"] = None
    except qk.ShardingError as e:
        out["uneven"] = str(e)
    out["uneven_unchanged"] = all(p is before[n] for n, p in model.named_parameters()) and \
        model.model.layers[0].mlp.experts.num_experts == 5 and "forward" not in vars(model.model.layers[0].mlp.experts)
    stack = model.model.layers[0].mlp.experts.down_proj.detach()
    try:  # direct DTensor use: 5 experts chunk as 3 + 2
        distribute_tensor(stack, mesh, [Shard(0)])
        out["uneven_direct"] = None
    except qk.ShardingError as e:
        out["uneven_direct"] = str(e)
    model = tiny_moe("qwen3_moe")
    qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=32), strict=True)
    stack = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    for dim in (1, 2):
        try:
            distribute_tensor(stack, mesh, [Shard(dim)])
            out[f"shard{dim}"] = None
        except qk.ShardingError as e:
            out[f"shard{dim}"] = str(e)
    qk.parallelize_experts_(model, mesh)
    try:
        qk.parallelize_experts_(model, mesh)
        out["twice"] = None
    except ValueError as e:
        out["twice"] = str(e)
    model.set_experts_implementation("eager")
    try:
        model(IDS)  # gradients enabled, float Parameters requiring grad around the experts: refused, not wrong
        out["grad"] = None
    except NotImplementedError as e:
        out["grad"] = str(e)
    return out


def expert_parallel_suite(rank: int, world: int) -> dict:
    """Everything test_expert_parallel.py checks, in one pair of processes (starting them costs seconds)."""
    out = {"qwen3_moe": {c: expert_parallel_model(rank, world, "qwen3_moe", c, 0) for c in EP_CONFIGS}}
    out["float"] = expert_parallel_model(rank, world, "qwen3_moe", None, 0)
    out["local_split"] = expert_parallel_model(rank, world, "qwen3_moe", "int4_tiled", None)
    out["mixtral"] = expert_parallel_model(rank, world, "mixtral", "int8", 0)
    out["olmoe"] = expert_parallel_model(rank, world, "olmoe", "nf4", 0)
    # gpt-oss: experts stored transposed, with (E, N) biases (sharded with them). transformers' own eager gpt-oss
    # experts take no expert-parallel sentinel (one_hot over num_experts classes), float or quantized.
    out["gpt_oss"] = expert_parallel_model(rank, world, "gpt_oss", "int8", 0, impls=("grouped_mm", "batched_mm"))
    out["refusals"] = refusals(rank, world)
    return out
