"""One instance of every public weight config (and its main variants: hqq, per-group activations, float zero points,
16-bit scales), for the reliability sweeps over configs."""
from __future__ import annotations

import pytest

import torchqkit as qk

CONFIGS = {
    "int8wo": qk.Int8WeightOnlyConfig(),
    "int8wo-g32": qk.Int8WeightOnlyConfig(group_size=32),
    "int4wo": qk.Int4WeightOnlyConfig(group_size=32),
    "int4wo-plain": qk.Int4WeightOnlyConfig(group_size=32, layout=qk.PlainLayout()),
    "int4wo-hqq": qk.Int4WeightOnlyConfig(group_size=32, algorithm="hqq"),
    "int4wo-bf16-scales": qk.Int4WeightOnlyConfig(group_size=32, scale_dtype="bfloat16"),
    "intx4": qk.IntxWeightOnlyConfig(bits=4),
    "intx3-asym": qk.IntxWeightOnlyConfig(bits=3, mapping="asymmetric"),
    "intx8": qk.IntxWeightOnlyConfig(bits=8),
    "intx4-hqq": qk.IntxWeightOnlyConfig(bits=4, algorithm="hqq"),
    "nf4": qk.NF4WeightOnlyConfig(),
    "nf4-double-quant": qk.NF4WeightOnlyConfig(double_quant=True),
    "fp8wo": qk.Float8WeightOnlyConfig(),
    "fp8-dynamic": qk.Float8DynamicActivationFloat8WeightConfig(),
    "fp8-static": qk.Float8StaticActivationFloat8WeightConfig(act_scale=0.01),
    "mxfp8": qk.MXFP8WeightOnlyConfig(),
    "mxfp4": qk.MXFP4WeightOnlyConfig(),
    "nvfp4": qk.NVFP4WeightOnlyConfig(),
    "nvfp4-dyn-nvfp4": qk.NVFP4DynamicActivationNVFP4WeightConfig(),
    "fp6-e3m2": qk.FP6WeightOnlyConfig(),
    "fp6-e2m3-g32": qk.FP6WeightOnlyConfig(ebits=2, group_size=32),
    "int8da-int8": qk.Int8DynamicActivationInt8WeightConfig(),
    "int8da-int8-sym": qk.Int8DynamicActivationInt8WeightConfig(act_mapping="symmetric"),
    "int8da-int4": qk.Int8DynamicActivationIntxWeightConfig(),
    "int8da-int4-per-group": qk.Int8DynamicActivationIntxWeightConfig(act_granularity=qk.PerGroup(32),
                                                                      act_mapping="symmetric"),
    "int8da-int4-float-zero": qk.Int8DynamicActivationIntxWeightConfig(weight_mapping="asymmetric",
                                                                       weight_zero_point_domain="float"),
    "int8da-int8-g32": qk.Int8DynamicActivationIntxWeightConfig(weight_bits=8),
    "int8-static": qk.Int8StaticActivationInt8WeightConfig(act_scale=0.01),
}

ACTIVATION_CONFIGS = [n for n, c in CONFIGS.items() if n.startswith(("int8da", "fp8-", "int8-static", "nvfp4-dyn"))]


def config_params(names=None):
    return [pytest.param(CONFIGS[n], id=n) for n in (names or CONFIGS)]
