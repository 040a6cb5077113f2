"""parallelize_experts_: expert parallelism for transformers mixture-of-experts models, quantized or not.

Note [Expert parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~
Over a 1-d mesh of W ranks that all hold the same batch (as tensor parallelism has them), rank r keeps experts
[r E / W, (r + 1) E / W) of every experts module: each expert Parameter (the (E, N, K) stacks and any (E, ...)
bias) becomes a DTensor placed ``Shard(0)``, made by ``distribute_tensor`` (quantized stacks: Note
[Expert-parallel shards]), so a rank stores 1 / W of the experts' packed bytes. The router and everything
outside the experts module stay whole on every rank.

The experts module's forward ``(hidden_states, top_k_index, top_k_weights)`` is wrapped. The routing is global
(every rank computes the same router output from the same batch); the wrapper maps each chosen expert to its
local id on this rank, or, for another rank's expert, to the local expert count with weight 0, the sentinel
that transformers 5.x's experts implementations skip ("eager" skips that id, "grouped_mm" sorts it past the
last group, which the grouped quantized linear leaves at zero, "batched_mm" clamps it and multiplies by the
zero weight), sets the module's ``num_experts`` to the local count, and runs the original forward on the local
shards (the DTensors' local tensors, put in place for the call). Each rank's output is then the sum over its
own experts of weight x expert(x), and one all-reduce sums the ranks' outputs: the model's output, as one
process computes it up to float summation order (two partial sums added instead of one running sum).

Inference only: the all-reduce is not differentiable here, so a forward that would record gradients is
refused. The routing and the all-reduce cost nothing in tokens moved (no all-to-all); each rank runs its
experts on the batch's rows routed to them.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn

from ..api.expert_weights import expert_parameters
from .shard_ops import ShardingError

__all__ = ["parallelize_experts_"]

_STATE = "_torchqkit_expert_parallel"


def parallelize_experts_(model: nn.Module, mesh, *, src_data_rank: int | None = 0) -> list[str]:
    """Expert parallelism: each rank of ``mesh`` keeps 1 / world of every MoE layer's experts (quantized stacks as
    packed bytes) and computes their share of the layer's output; one all-reduce per layer sums the shares.

    Every experts module of a transformers 5.x mixture-of-experts model (the modules ``quantize_`` treats as
    experts: Qwen3-MoE, Mixtral, OLMoE, ...) gets its expert Parameters (``gate_up_proj`` (E, 2I, H),
    ``down_proj`` (E, H, I), and any (E, ...) bias) replaced by DTensors placed ``Shard(0)``, and its forward
    wrapped to run only this rank's experts (Note [Expert parallelism] in torchqkit/distributed/expert_parallel.py).
    Every rank must hold the same batch (as for tensor parallelism); the router and the rest of the model stay
    whole. Combine with ``parallelize_module`` (tensor parallel attention) on the same mesh as you like.
    Everything is checked before anything changes. Inference only.

    Args:
        model (nn.Module): the model, quantized with ``quantize_`` or not; the same on every rank.
        mesh (DeviceMesh): a 1-d device mesh (``init_device_mesh("cpu", (world,))``); rank r keeps experts
            [r E / world, (r + 1) E / world).
        src_data_rank (int | None): as in ``distribute_tensor``: the rank whose experts are scattered (default 0,
            packed bytes, one collective per inner tensor), or None: every rank already holds the whole model
            and keeps its own experts without communication.

    Returns:
        list[str]: the names of the experts modules now expert-parallel, in module order.

    Raises:
        ShardingError: an experts module's expert count is not a multiple of the mesh size (named, with the count).
        ValueError: the mesh is not 1-d, the model has no experts module, an experts module is already
            expert-parallel, has no ``num_experts`` equal to its Parameters' leading dim, or its forward doesn't
            take (hidden_states, top_k_index, top_k_weights). Nothing changes then.

    Example:
        ```python
        # torchrun --nproc_per_node 2 script.py
        import torchqkit as qk
        from torch.distributed.device_mesh import init_device_mesh
        qk.quantize_(model, qk.Int8WeightOnlyConfig())
        mesh = init_device_mesh("cpu", (2,))
        print(qk.parallelize_experts_(model, mesh))   # ['model.layers.0.mlp.experts', ...]
        with torch.no_grad():
            logits = model(ids).logits                # the same on every rank
        ```
    """
    if mesh.ndim != 1:
        raise ValueError(f"parallelize_experts_ takes a 1-d device mesh, got one of shape {tuple(mesh.shape)}; pass "
                         f"the expert-parallel sub-mesh (mesh['ep'])")
    world = mesh.size()
    modules = dict(model.named_modules())
    by_module: dict[str, list[str]] = {}
    for p in expert_parameters(modules):
        by_module.setdefault(p.module_fqn, []).append(p.attr)
    if not by_module:
        raise ValueError(f"parallelize_experts_: {type(model).__name__} has no experts module (a transformers 5.x "
                         f"*Experts module holding 3-d expert Parameters); nothing to shard")
    plans = {fqn: _plan(fqn, modules[fqn], world) for fqn in by_module}  # every check before any change
    from torch.distributed.tensor import Shard, distribute_tensor
    sharded = {fqn: {attr: distribute_tensor(p.detach(), mesh, [Shard(0)], src_data_rank=src_data_rank)
                     for attr, p in params.items()}
               for fqn, (params, _) in plans.items()}
    rank = mesh.get_local_rank()
    group = mesh.get_group()
    for fqn, (params, experts) in plans.items():
        module = modules[fqn]
        for attr, t in sharded[fqn].items():
            module._parameters[attr] = nn.Parameter(t, requires_grad=params[attr].requires_grad)
        local = experts // world
        _install(module, first=rank * local, local=local, group=group)
    return list(plans)


def _plan(fqn: str, module: nn.Module, world: int) -> tuple[dict[str, torch.Tensor], int]:
    """(Parameters to shard, expert count) of one experts module; ValueError / ShardingError for what can't be."""
    if hasattr(module, _STATE):
        raise ValueError(f"{fqn} is already expert-parallel (parallelize_experts_ ran on this model)")
    experts = getattr(module, "num_experts", None)
    stacks = {a: p for a, p in module._parameters.items() if p is not None and p.dim() == 3}
    if not isinstance(experts, int) or any(p.shape[0] != experts for p in stacks.values()):
        raise ValueError(f"{fqn} ({type(module).__name__}): its num_experts ({experts!r}) must be the leading dim of "
                         f"its expert Parameters {({a: tuple(p.shape) for a, p in stacks.items()})}; "
                         f"parallelize_experts_ sets it to the local count")
    from torch.distributed.tensor import DTensor
    if any(isinstance(p, DTensor) for p in module._parameters.values() if p is not None):
        raise ValueError(f"{fqn}: its Parameters are already DTensors (parallelize_module or fully_shard); expert "
                         f"parallelism shards the plain model")
    names = list(inspect.signature(module.forward).parameters)
    if len(names) < 3 or any(inspect.signature(module.forward).parameters[n].kind not in
                             (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
                             for n in names[:3]):
        raise ValueError(f"{fqn} ({type(module).__name__}): its forward takes {names}, not (hidden_states, "
                         f"top_k_index, top_k_weights) as transformers' experts modules do; parallelize_experts_ "
                         f"doesn't know how it routes")
    params = {a: p for a, p in module._parameters.items()
              if p is not None and p.dim() >= 1 and p.shape[0] == experts}
    if experts % world:
        raise ShardingError(
            f"{fqn}: {experts} experts don't split over {world} ranks (each rank must hold the same number of whole "
            f"experts: quantized stacks can't be padded); use a world size that divides {experts}")
    return params, experts


def _install(module: nn.Module, *, first: int, local: int, group) -> None:
    original = module.forward
    setattr(module, _STATE, (first, local, module.num_experts))
    module.num_experts = local
    if hasattr(module, "_is_expert_parallel"):  # transformers' flag: its grouped / batched paths mask sentinels
        module._is_expert_parallel = True

    def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        ids = top_k_index - first
        other = (ids < 0) | (ids >= local)
        ids = ids.masked_fill(other, local)  # the sentinel transformers' experts skip: Note [Expert parallelism]
        weights = top_k_weights.masked_fill(other, 0)
        with _local_parameters(module):
            out = original(hidden_states, ids, weights, *args, **kwargs)
        if torch.is_grad_enabled() and out.requires_grad:
            raise NotImplementedError(
                f"expert parallelism (parallelize_experts_) is for inference: the all-reduce of the experts' outputs "
                f"is not differentiable here. Run the model under torch.no_grad() / torch.inference_mode(), or "
                f"without expert parallelism for training ({type(module).__name__})")
        torch.distributed.all_reduce(out, group=group)  # each rank's experts' share of every token
        return out

    module.forward = forward


@contextlib.contextmanager
def _local_parameters(module: nn.Module):
    """The module's DTensor Parameters replaced by their local shards for one call (then put back)."""
    from torch.distributed.tensor import DTensor
    saved = dict(module._parameters)
    try:
        for name, p in saved.items():
            if isinstance(p, DTensor):
                module._parameters[name] = p.to_local()
        yield
    finally:
        module._parameters.update(saved)
