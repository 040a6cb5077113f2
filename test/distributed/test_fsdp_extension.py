"""The FSDP2 all-gather extension in one process: row shards -> fsdp_pre_all_gather -> concatenation along dim 0
(what the all-gather does) -> fsdp_post_all_gather rebuilds the whole weight, bit for bit, for every layout."""
import pytest
import torch

import torchqkit as qk

CONFIGS = {
    "int8": qk.Int8WeightOnlyConfig(),
    "int4_tiled": qk.Int4WeightOnlyConfig(group_size=64),
    "nf4": qk.NF4WeightOnlyConfig(),
    "nf4_double_quant": qk.NF4WeightOnlyConfig(double_quant=True),
    "packed_int3": qk.IntxWeightOnlyConfig(bits=3),
    "float8": qk.Float8WeightOnlyConfig(),
    "mxfp4": qk.MXFP4WeightOnlyConfig(),
    "nvfp4": qk.NVFP4WeightOnlyConfig(),  # a per-tensor global scale: shared, not gathered
    "fp6": qk.FP6WeightOnlyConfig(ebits=2, group_size=32),
    "nm_sparse_int4": qk.SparsityConfig(base=qk.Int4WeightOnlyConfig(group_size=64)),
}


def _gather(w, world):
    shards = torch.chunk(w, world, dim=0)
    sent = [s.fsdp_pre_all_gather(None, w.shape, w.stride(), None, None) for s in shards]
    outputs = tuple(torch.cat([tensors[i].reshape(-1) for tensors, _ in sent]).view(-1, *sent[0][0][i].shape[1:])
                    for i in range(len(sent[0][0])))
    return shards[0], outputs, sent[0][1], [t for tensors, _ in sent for t in tensors]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_row_shards_gather_back_to_the_weight(name):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128, bias=False)  # NF4 double quant: 64 rows x 4 blocks = one group of 256 per shard
    qk.quantize_(lin, CONFIGS[name])
    w = lin.weight
    shard, outputs, meta, sent = _gather(w, 2)
    whole, inner = shard.fsdp_post_all_gather(outputs, meta, torch.float32)
    assert torch.equal(whole.dequantize(), w.dequantize())
    # Packed storage travels (integer codes, or float8 codes as bytes), half of it from each rank.
    assert sum(t.numel() * t.element_size() for t in sent) <= w.packed_nbytes()
    assert sent[0].dtype in (torch.uint8, torch.int8, torch.int32)
    # Later steps: FSDP2 frees these, gathers into the same buffers again, and passes the first result as `out`.
    again = [o.clone() for o in outputs]
    for t in inner:
        t.zero_()
    for o, a in zip(outputs, again):
        o.copy_(a)
    assert shard.fsdp_post_all_gather(outputs, meta, torch.float32, out=whole) is None
    assert torch.equal(whole.dequantize(), w.dequantize())


def test_block_scales_across_rows_are_refused():
    lin = torch.nn.Linear(256, 256, bias=False)
    qk.quantize_(lin, qk.Float8WeightOnlyConfig(granularity=qk.PerBlock((128, 128))))
    shard = torch.chunk(lin.weight, 2, dim=0)[0]
    with pytest.raises(NotImplementedError, match="scales span several rows"):
        shard.fsdp_pre_all_gather(None, lin.weight.shape, lin.weight.stride(), None, None)


def test_shards_that_would_store_different_tensors_are_refused_on_every_rank():
    lin = torch.nn.Linear(192, 128, bias=False)  # 64 rows x 3 blocks = 192 absmax values: the cut is inside a group
    qk.quantize_(lin, qk.NF4WeightOnlyConfig(double_quant=True))
    with pytest.raises(qk.ShardingError, match="would store different inner tensors.*double_quant=False"):
        torch.chunk(lin.weight, 2, dim=0)
