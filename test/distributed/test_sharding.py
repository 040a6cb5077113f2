"""Cutting a quantized weight the way torch.distributed does (torch.chunk -> aten.split), in one process:
shards are views at block / tile boundaries and dequantize to the matching slice; other cuts raise an error
naming the layout, the dim and the legal multiples."""
import pytest
import torch

import torchqkit as qk
from torchqkit import ShardingError


def _quantized(config, n, k):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False)
    qk.quantize_(lin, config)
    return lin.weight


CONFIGS = {
    "int8": qk.Int8WeightOnlyConfig(),
    "int4_tiled": qk.Int4WeightOnlyConfig(group_size=64),
    "nf4": qk.NF4WeightOnlyConfig(),
    "packed_int3": qk.IntxWeightOnlyConfig(bits=3),
    "float8": qk.Float8WeightOnlyConfig(),
    "mxfp4": qk.MXFP4WeightOnlyConfig(),
    "nvfp4": qk.NVFP4WeightOnlyConfig(),
    "fp6": qk.FP6WeightOnlyConfig(),
    "nm_sparse_int4": qk.SparsityConfig(base=qk.Int4WeightOnlyConfig(group_size=64)),
    "nm_sparse_float": qk.SparsityConfig(),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dim", [0, 1])
def test_chunk_gives_views_that_dequantize_to_the_slices(name, dim):
    w = _quantized(CONFIGS[name], 64, 256)
    full = w.dequantize()
    pieces = torch.chunk(w, 2, dim=dim)
    assert len(pieces) == 2
    for i, piece in enumerate(pieces):
        assert isinstance(piece, qk.AffineQuantizedTensor)
        assert torch.equal(piece.dequantize(), full.narrow(dim, i * full.shape[dim] // 2, full.shape[dim] // 2))
        # The codes are views of the original's storage: nothing is dequantized or copied to cut.
        first = w.qlayout.tensor_names[0]  # qdata, or an N:M layout's kept values
        assert getattr(piece, first).untyped_storage().data_ptr() == getattr(w, first).untyped_storage().data_ptr()


def test_shard_multiple_is_the_layouts_cut_rule():
    int4 = _quantized(qk.Int4WeightOnlyConfig(group_size=64), 64, 256)
    assert qk.shard_multiple(int4, 0) == 8      # whole n-tiles of 8 rows
    assert qk.shard_multiple(int4, 1) == 128    # whole k-chunks (16 x inner_k_tiles 8), holding whole groups of 64
    assert qk.shard_multiple(int4.t(), 0) == 128  # a transposed view: its dim 0 is K
    nf4 = _quantized(qk.NF4WeightOnlyConfig(block_size=64), 64, 256)
    assert (qk.shard_multiple(nf4, 0), qk.shard_multiple(nf4, 1)) == (1, 64)


def test_cut_inside_a_tile_names_layout_dim_and_multiples():
    w = _quantized(qk.Int4WeightOnlyConfig(group_size=64), 72, 256)
    with pytest.raises(ShardingError) as info:
        torch.chunk(w, 2, dim=0)  # 36 rows per shard: an n-tile holds 8
    msg = str(info.value)
    assert "TensorCoreTiledLayout" in msg and "along dim 0 (out_features (N))" in msg
    assert "multiples of 8" in msg and "cut at 36" in msg


def test_cut_inside_a_block_along_k():
    w = _quantized(qk.NF4WeightOnlyConfig(block_size=64), 32, 192)
    with pytest.raises(ShardingError, match=r"NF4Layout.*dim 1 \(in_features \(K\)\).*multiples of 64"):
        torch.chunk(w, 2, dim=1)  # 96 = 1.5 blocks


def test_empty_like_is_a_dense_buffer_of_the_same_format():
    w = _quantized(qk.Int4WeightOnlyConfig(group_size=64), 64, 256)
    piece = torch.chunk(w, 2, dim=1)[1]
    buf = torch.empty_like(piece)
    assert isinstance(buf, qk.AffineQuantizedTensor) and buf.shape == piece.shape
    for name, t in piece.inner_tensors().items():
        b = getattr(buf, name)
        assert b.shape == t.shape and b.dtype == t.dtype and b.is_contiguous()


def test_only_the_identity_view():
    w = _quantized(qk.Int8WeightOnlyConfig(), 64, 256)
    alias = w.view_as(w)
    assert isinstance(alias, qk.AffineQuantizedTensor) and alias.qdata.data_ptr() == w.qdata.data_ptr()
    with pytest.raises(NotImplementedError, match="only a view of the same shape"):
        w.view(256, 64)


def test_dynamic_activation_weight_warns_when_cut_along_k():
    w = _quantized(qk.Int8DynamicActivationInt8WeightConfig(), 64, 256)
    torch.chunk(w, 2, dim=0)  # along N: each token's scale still sees all of K, no warning needed
    with pytest.warns(UserWarning, match="activation scales over its own part of K"):
        torch.chunk(w, 2, dim=1)
