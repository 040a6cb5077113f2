"""Workers for test_fsdp_qlora.py: QLoRA on the tiny LLaMA, one process versus FSDP2 over the ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import torchqkit as qk

from .models import tiny_llama

BASE_CONFIGS = {
    "nf4": lambda: qk.NF4WeightOnlyConfig(),
    "int4_tiled": lambda: qk.Int4WeightOnlyConfig(group_size=64),
    "int8": lambda: qk.Int8WeightOnlyConfig(),
}
STEPS, BATCH, SEQ = 20, 4, 16



def qlora_llama(config_name: str):
    model = tiny_llama()
    qk.quantize_(model, BASE_CONFIGS[config_name](),
                 filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "lm_head")
    torch.manual_seed(1)  # the same adapters in every process
    qk.add_lora_(model, rank=8)  # freezes the float parameters, wraps every Linear but lm_head
    return model


def _batches():
    """Two fixed batches, alternating: something the adapters can learn in 20 steps (loss falls by > 1)."""
    g = torch.Generator().manual_seed(2)
    two = torch.randint(0, 128, (2, BATCH, SEQ), generator=g)
    return two[torch.arange(STEPS) % 2]


def _train(model, batches, reduce_loss=lambda loss: loss.item()) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for ids in batches:
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(reduce_loss(loss.detach()))
    return losses


def _mean_over_ranks(loss: torch.Tensor) -> float:
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def fsdp_qlora(rank: int, world: int, names) -> dict:
    from torch.distributed.fsdp import fully_shard
    gathered = []
    pre = qk.AffineQuantizedTensor.fsdp_pre_all_gather

    def recording_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        tensors, meta = pre(self, mesh, outer_size, outer_stride, module, mp_policy)
        gathered.append({"dtypes": [str(t.dtype) for t in tensors],
                         "bytes": sum(t.numel() * t.element_size() for t in tensors),
                         "local_packed": self.packed_nbytes(), "float_bytes": self.numel() * 4})
        return tensors, meta

    qk.AffineQuantizedTensor.fsdp_pre_all_gather = recording_pre_all_gather
    batches = _batches()
    per = BATCH // world
    results = {}
    try:
        for name in names:
            single_model = qlora_llama(name)
            full_packed = sum(p.packed_nbytes() for p in single_model.parameters()
                              if isinstance(p, qk.AffineQuantizedTensor))
            single = _train(single_model, batches)
            model = qlora_llama(name)
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            local_packed = sum(p.to_local().packed_nbytes() for p in model.parameters()
                               if isinstance(p.to_local(), qk.AffineQuantizedTensor))
            gathered.clear()
            sharded = _train(model, batches[:, rank * per:(rank + 1) * per], _mean_over_ranks)
            results[name] = {"single": single, "fsdp": sharded, "full_packed": full_packed,
                             "local_packed": local_packed, "gathers": list(gathered)}
    finally:
        qk.AffineQuantizedTensor.fsdp_pre_all_gather = pre
    return results


QAT_STEPS = 6


def _qat_llama():
    model = tiny_llama()
    qk.prepare_qat_(model, qk.QATConfig(qk.Int4WeightOnlyConfig(group_size=32)),
                    filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "lm_head")
    return model


def fsdp_qat(rank: int, world: int) -> dict:
    """Quantization-aware training: float weights sharded by FSDP2, gathered whole before each forward, where
    the fake quantizer sees the full weight (its groups never straddle a shard)."""
    from torch.distributed.fsdp import fully_shard
    batches = _batches()[:QAT_STEPS]
    per = BATCH // world
    single = _train(_qat_llama(), batches)
    model = _qat_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    sharded = _train(model, batches[:, rank * per:(rank + 1) * per], _mean_over_ranks)
    return {"single": single, "fsdp": sharded}
