"""Example quantizations for every registered layout, used by the shared conformance suite.

Every layout in torchqkit.layouts.all_layouts() must have an entry here: test_every_layout_enrolled
fails otherwise, so a new layout can't escape the suite. A case is (id, shape, quantize_weight kwargs).

Every layout also has cases whose in_features no group divides (96 / 200 / 576 with groups of 64 / 128,
the widths of real models such as SmolLM2): the layout pads K inside, and every test must still see the
logical shape (Note [Partial blocks] in core/primitives.py).
"""
from __future__ import annotations

import torch

import torchqkit as qk
from torchqkit.core import qdtypes as Q

CASES: dict[str, list[tuple[str, tuple[int, int], dict]]] = {
    "tensor_core_tiled": [
        # (44, 96): out_features padded to 48 (8-row tiles), in_features to 128 (one 8 x k16 chunk)
        ("g32-ikt8-padded", (44, 96), dict(qdtype=Q.uint4, granularity=qk.PerGroup(32),
                                           mapping=qk.MappingType.ASYMMETRIC,
                                           zero_point_domain=qk.ZeroPointDomain.FLOAT)),
        ("g64-ikt2", (48, 256), dict(qdtype=Q.uint4, granularity=qk.PerGroup(64), mapping=qk.MappingType.ASYMMETRIC,
                                     zero_point_domain=qk.ZeroPointDomain.FLOAT,
                                     layout=qk.TensorCoreTiledLayout(inner_k_tiles=2))),
        ("g128-ikt4", (40, 384), dict(qdtype=Q.uint4, granularity=qk.PerGroup(128), mapping=qk.MappingType.ASYMMETRIC,
                                      zero_point_domain=qk.ZeroPointDomain.FLOAT,
                                      layout=qk.TensorCoreTiledLayout(inner_k_tiles=4))),
        ("g256-ikt8", (24, 512), dict(qdtype=Q.uint4, granularity=qk.PerGroup(256), mapping=qk.MappingType.ASYMMETRIC,
                                      zero_point_domain=qk.ZeroPointDomain.FLOAT)),
        ("g128-k576-partial-group", (24, 576), dict(qdtype=Q.uint4, granularity=qk.PerGroup(128),
                                                    mapping=qk.MappingType.ASYMMETRIC,
                                                    zero_point_domain=qk.ZeroPointDomain.FLOAT)),
        ("g64-k200-partial-group", (20, 200), dict(qdtype=Q.uint4, granularity=qk.PerGroup(64),
                                                   mapping=qk.MappingType.ASYMMETRIC,
                                                   zero_point_domain=qk.ZeroPointDomain.FLOAT,
                                                   layout=qk.TensorCoreTiledLayout(inner_k_tiles=2))),
        ("g128-k96-less-than-a-group", (16, 96), dict(qdtype=Q.uint4, granularity=qk.PerGroup(128),
                                                      mapping=qk.MappingType.ASYMMETRIC,
                                                      zero_point_domain=qk.ZeroPointDomain.FLOAT)),
    ],
    "packed_intx": [
        ("int3-g16-asym", (40, 64), dict(qdtype=Q.int3, granularity=qk.PerGroup(16),
                                         mapping=qk.MappingType.ASYMMETRIC)),
        ("int5-g32-sym", (48, 96), dict(qdtype=Q.int5, granularity=qk.PerGroup(32))),
        # 100 codes of 6 bits = 75 bytes a row; slices along K cut every 4 codes (3 bytes)
        ("uint6-row-asym", (24, 100), dict(qdtype=Q.uint6, granularity=qk.PerRow(),
                                           mapping=qk.MappingType.ASYMMETRIC)),
        ("int7-g32-sym", (24, 64), dict(qdtype=Q.int7, granularity=qk.PerGroup(32))),
        ("uint1-g32-asym", (16, 64), dict(qdtype=Q.uint1, granularity=qk.PerGroup(32),
                                          mapping=qk.MappingType.ASYMMETRIC)),
        # absmax + no-clipping symmetric int2: scale = block absmax, codes exactly {-1, 0, 1}
        ("int2-ternary-g32", (40, 96), dict(qdtype=Q.int2, granularity=qk.PerGroup(32),
                                            mapping=qk.MappingType.SYMMETRIC_NO_CLIPPING_ERR,
                                            layout=qk.PackedIntxLayout(ternary=True))),
        ("int4-g32-dynact", (48, 64), dict(qdtype=Q.int4, granularity=qk.PerGroup(32),
                                           act_quant=qk.ActivationQuantSpec(Q.int8, qk.PerToken()))),
        ("int3-g64-k200-partial-group", (24, 200), dict(qdtype=Q.int3, granularity=qk.PerGroup(64),
                                                        mapping=qk.MappingType.ASYMMETRIC)),
        ("int4-g128-k576-partial-group", (16, 576), dict(qdtype=Q.int4, granularity=qk.PerGroup(128))),
        ("int4-g64-k96-dynact-partial-group", (16, 96), dict(qdtype=Q.int4, granularity=qk.PerGroup(64),
                                                             act_quant=qk.ActivationQuantSpec(Q.int8, qk.PerToken()))),
    ],
    "plain": [
        ("int8-row", (48, 64), dict(qdtype=Q.int8, granularity=qk.PerRow())),
        ("uint4-g32-floatzp", (48, 96), dict(qdtype=Q.uint4, granularity=qk.PerGroup(32),
                                             mapping=qk.MappingType.ASYMMETRIC,
                                             zero_point_domain=qk.ZeroPointDomain.FLOAT)),
        ("int3-g16-asym", (40, 64), dict(qdtype=Q.int3, granularity=qk.PerGroup(16),
                                         mapping=qk.MappingType.ASYMMETRIC)),
        ("fp8e4m3-row", (48, 64), dict(qdtype=Q.float8_e4m3fn, granularity=qk.PerRow())),
        ("int8-row-dynact", (48, 64), dict(qdtype=Q.int8, granularity=qk.PerRow(),
                                           act_quant=qk.ActivationQuantSpec(Q.int8, qk.PerToken()))),
        ("int8-g64-k200-partial-group", (24, 200), dict(qdtype=Q.int8, granularity=qk.PerGroup(64))),
        ("uint4-g128-k96-floatzp-partial-group", (16, 96), dict(qdtype=Q.uint4, granularity=qk.PerGroup(128),
                                                                mapping=qk.MappingType.ASYMMETRIC,
                                                                zero_point_domain=qk.ZeroPointDomain.FLOAT)),
    ],
    "nf4": [
        ("b64", (48, 128), dict(qdtype=Q.nf4, granularity=qk.PerGroup(64))),
        ("b64-k-one-block", (40, 64), dict(qdtype=Q.nf4, granularity=qk.PerGroup(64))),
        ("b32", (24, 96), dict(qdtype=Q.nf4, granularity=qk.PerGroup(32), layout=qk.NF4Layout(block_size=32))),
        # 768 blocks of 64 -> three second-level groups of 256
        ("b64-double-quant", (48, 1024), dict(qdtype=Q.nf4, granularity=qk.PerGroup(64),
                                              layout=qk.NF4Layout(double_quant=True))),
        ("b64-k200-partial-block", (24, 200), dict(qdtype=Q.nf4, granularity=qk.PerGroup(64))),
        ("b64-k576-double-quant-partial-block", (40, 576), dict(qdtype=Q.nf4, granularity=qk.PerGroup(64),
                                                                layout=qk.NF4Layout(double_quant=True))),
    ],
    "float8": [
        ("e4m3-row", (48, 64), dict(qdtype=Q.float8_e4m3fn, granularity=qk.PerRow())),
        ("e5m2-tensor", (48, 64), dict(qdtype=Q.float8_e5m2, granularity=qk.PerTensor())),
        ("e4m3-block32x32", (64, 96), dict(qdtype=Q.float8_e4m3fn, granularity=qk.PerBlock((32, 32)))),
        ("e4m3-row-dynact", (48, 64), dict(qdtype=Q.float8_e4m3fn, granularity=qk.PerRow(),
                                           act_quant=qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerRow()))),
        ("e4m3-tensor-staticact", (48, 64), dict(qdtype=Q.float8_e4m3fn, granularity=qk.PerTensor(),
                                                 act_quant=qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerTensor(),
                                                                                  static_scale=0.01))),
        ("e4m3-block-dynact", (64, 96), dict(qdtype=Q.float8_e4m3fn, granularity=qk.PerBlock((16, 32)),
                                             act_quant=qk.ActivationQuantSpec(Q.float8_e4m3fn, qk.PerRow()))),
        # 100 x 200 in 32 x 64 blocks: a partial last block along both dims
        ("e4m3-block32x64-partial-both", (100, 200), dict(qdtype=Q.float8_e4m3fn, granularity=qk.PerBlock((32, 64)))),
        # AMD's fnuz formats (max 240 / 57344, 0x80 the only NaN): weight-only, and with fnuz activations
        ("e4m3fnuz-row", (48, 64), dict(qdtype=Q.float8_e4m3fnuz, granularity=qk.PerRow())),
        ("e5m2fnuz-block16x32", (64, 96), dict(qdtype=Q.float8_e5m2fnuz, granularity=qk.PerBlock((16, 32)))),
        ("e4m3fnuz-tensor-dynact", (48, 64), dict(qdtype=Q.float8_e4m3fnuz, granularity=qk.PerTensor(),
                                                  act_quant=qk.ActivationQuantSpec(Q.float8_e4m3fnuz, qk.PerTensor()))),
        ("e5m2fnuz-row-dynact", (48, 64), dict(qdtype=Q.float8_e5m2fnuz, granularity=qk.PerRow(),
                                               act_quant=qk.ActivationQuantSpec(Q.float8_e5m2fnuz, qk.PerRow()))),
    ],
    "mx": [
        ("mxfp8-e4m3", (48, 128), dict(qdtype=Q.float8_e4m3fn, granularity=qk.PerGroup(32),
                                       scale_rounding="power_of_two")),
        ("mxfp8-e5m2", (40, 64), dict(qdtype=Q.float8_e5m2, granularity=qk.PerGroup(32),
                                      scale_rounding="power_of_two")),
        ("mxfp4", (48, 128), dict(qdtype=Q.fp4_e2m1, granularity=qk.PerGroup(32), scale_rounding="power_of_two")),
        ("mxfp4-k-one-block", (40, 32), dict(qdtype=Q.fp4_e2m1, granularity=qk.PerGroup(32),
                                             scale_rounding="power_of_two")),
        ("mxfp4-k200-partial-block", (24, 200), dict(qdtype=Q.fp4_e2m1, granularity=qk.PerGroup(32),
                                                     scale_rounding="power_of_two")),
        ("mxfp8-k100-partial-block", (16, 100), dict(qdtype=Q.float8_e4m3fn, granularity=qk.PerGroup(32),
                                                    scale_rounding="power_of_two")),
    ],
    "nvfp4": [
        ("g16", (48, 128), dict(qdtype=Q.fp4_e2m1, granularity=qk.PerGroup(16), scale_dtype=torch.float32,
                                scale_rounding="float8_e4m3")),
        ("k-one-block", (40, 16), dict(qdtype=Q.fp4_e2m1, granularity=qk.PerGroup(16), scale_dtype=torch.float32,
                                       scale_rounding="float8_e4m3")),
        ("k200-partial-block", (24, 200), dict(qdtype=Q.fp4_e2m1, granularity=qk.PerGroup(16),
                                               scale_dtype=torch.float32, scale_rounding="float8_e4m3")),
        ("k96-nvfp4-dynact", (16, 96), dict(qdtype=Q.fp4_e2m1, granularity=qk.PerGroup(16), scale_dtype=torch.float32,
                                            scale_rounding="float8_e4m3",
                                            act_quant=qk.ActivationQuantSpec(Q.fp4_e2m1, qk.PerGroup(16)))),
    ],
    # Given dense weights, NMSparseLayout keeps the n largest dequantized magnitudes of each block of m
    "nm_sparse": [
        ("2of4-int8-row", (48, 64), dict(qdtype=Q.int8, granularity=qk.PerRow())),
        # int4's float zero point: pruned entries have no code of 0.0, the mask makes them exactly 0
        ("2of4-uint4-g32-floatzp", (48, 96), dict(qdtype=Q.uint4, granularity=qk.PerGroup(32),
                                                  mapping=qk.MappingType.ASYMMETRIC,
                                                  zero_point_domain=qk.ZeroPointDomain.FLOAT)),
        ("2of4-int3-g16-asym", (40, 64), dict(qdtype=Q.int3, granularity=qk.PerGroup(16),
                                              mapping=qk.MappingType.ASYMMETRIC)),
        ("2of4-fp8e4m3-row", (24, 64), dict(qdtype=Q.float8_e4m3fn, granularity=qk.PerRow())),
        ("2of4-float32-values", (24, 64), dict(qdtype=Q.float32, granularity=qk.PerRow())),
        ("4of8-int4-g64-k200-partial-group", (24, 200), dict(qdtype=Q.int4, granularity=qk.PerGroup(64),
                                                             layout=qk.NMSparseLayout(4, 8))),
        # K = 70: the last block of 4 holds two real columns; one scale per row along K
        ("2of4-int8-row-k70-partial-block", (16, 70), dict(qdtype=Q.int8, granularity=qk.PerRow())),
        ("1of4-int8-dynact", (16, 64), dict(qdtype=Q.int8, granularity=qk.PerRow(), layout=qk.NMSparseLayout(1, 4),
                                            act_quant=qk.ActivationQuantSpec(Q.int8, qk.PerToken()))),
    ],
    "fp6": [
        ("e3m2-row", (48, 128), dict(qdtype=Q.fp6_e3m2, granularity=qk.PerRow())),
        ("e2m3-g32", (40, 96), dict(qdtype=Q.fp6_e2m3, granularity=qk.PerGroup(32))),
        # 100 codes = 75 bytes a row; slices along K cut every 4 codes (3 bytes)
        ("e3m2-row-k100", (24, 100), dict(qdtype=Q.fp6_e3m2, granularity=qk.PerRow())),
        ("e2m3-g64-k200-partial-group", (24, 200), dict(qdtype=Q.fp6_e2m3, granularity=qk.PerGroup(64))),
    ],
}


def all_cases():
    """(layout_name, case_id, shape, kwargs) for every registered layout's examples."""
    from torchqkit.layouts import all_layouts
    out = []
    for layout_cls in all_layouts():
        for case_id, shape, kwargs in CASES.get(layout_cls.name, []):
            out.append((layout_cls, case_id, shape, kwargs))
    return out
