"""torch.library.opcheck for every torchqkit_triton:: op (on CPU the interpreter registration: custom op + fake
impl; on a GPU the triton_op registration Inductor traces into) and for the torchqkit:: GPU ops whose only CPU
implementation is their reference."""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk
from torchqkit.kernels.triton import TRITON_OPS


def _weight(config, n, k, device):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False, device=device)
    qk.quantize_(lin, config)
    return lin.weight


def _samples(device="cpu"):
    x, bias = torch.randn(3, 64, device=device), torch.randn(37, device=device)
    i4 = _weight(qk.Int4WeightOnlyConfig(group_size=32, layout=qk.TensorCoreTiledLayout(inner_k_tiles=2)), 37, 64,
                 device)
    nf = _weight(qk.NF4WeightOnlyConfig(block_size=64, double_quant=True), 37, 64, device)
    mx = _weight(qk.MXFP4WeightOnlyConfig(), 37, 64, device)
    i8 = _weight(qk.Int8WeightOnlyConfig(), 37, 64, device)
    f8 = _weight(qk.Float8WeightOnlyConfig(), 37, 64, device)
    nv = _weight(qk.NVFP4WeightOnlyConfig(), 37, 64, device)
    f6 = _weight(qk.FP6WeightOnlyConfig(ebits=2, group_size=32), 37, 64, device)
    ix = _weight(qk.IntxWeightOnlyConfig(bits=3, granularity=qk.PerGroup(32), mapping="asymmetric"), 37, 64, device)
    tn = _weight(qk.presets.get("ternary-g32"), 37, 64, device)
    ns = _weight(qk.SparsityConfig(pattern=(2, 4), base=qk.Int4WeightOnlyConfig(group_size=32)), 37, 64, device)
    a = torch.randn(3, 64, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(37, 64, device=device).to(torch.float8_e5m2)
    sa, sb = torch.rand(3, 1, device=device), torch.rand(37, 1, device=device)
    return {
        "linear_int4wo_tiled": (x, i4.qdata, i4.scale_and_zero, 32, 37, bias),
        "linear_nf4wo": (x, nf.qdata, None, nf.scale_codes, nf.scale_block_scale, nf.scale_offset, 64, bias),
        "linear_mxwo": (x, mx.qdata, mx.scale, bias),
        "linear_fp8wo": (x, f8.qdata, f8.scale, bias),
        "linear_nvfp4wo": (x, nv.qdata, nv.scale, nv.global_scale, bias),
        "linear_fp6wo": (x, f6.qdata, f6.scale, 2, bias),
        "linear_int8wo_plain": (x, i8.qdata, i8.scale, bias),
        "linear_intxwo": (x, ix.qdata, ix.scale, ix.zero_point, 3, True, "int", bias),
        "linear_ternarywo": (x, tn.qdata, tn.scale, bias),
        "linear_nm_sparse_wo": (x, ns.kept, ns.positions, ns.scale, ns.zero_point, 2, 4, 4, False, "float", bias),
        "scaled_mm_fp8_rowwise": (a, b, sa, sb, bias, torch.float32),
        "sdpa_quantized_kv_cache": _kv_args(device),
    }


def _kv_args(device):
    """A decode step over 40 cached positions of an int8 cache with per-channel keys (the op's arguments)."""
    from torchqkit.kvcache import KVCacheConfig
    from test.kvcache.kv_testing import filled_store, op_args
    cfg = KVCacheConfig("int8", key_granularity="channel", group_size=16)
    torch.manual_seed(1)
    k, v = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    args = op_args(torch.randn(1, 4, 1, 64), filled_store(k, cfg, True), filled_store(v, cfg, False), None, cfg)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


# opcheck's test_schema compares inputs before / after with arithmetic that has no float8 CPU kernel
# ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn): float8 inputs skip that one check.
_NO_SCHEMA_CHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck(op, name, device="cpu"):
    float8_inputs = ("scaled_mm_fp8_rowwise", "linear_fp8wo", "linear_nvfp4wo")
    utils = _NO_SCHEMA_CHECK if name in float8_inputs else torch.library._OPCHECK_DEFAULT_UTILS
    torch.library.opcheck(op, _samples(device)[name], test_utils=utils)


@pytest.mark.parametrize("name", sorted(op.split("::")[1] for op in TRITON_OPS))
def test_triton_op(name, device):
    _opcheck(getattr(torch.ops.torchqkit_triton, name).default, name, device)


@pytest.mark.parametrize("name", ["linear_mxwo", "scaled_mm_fp8_rowwise"])
def test_reference_only_op(name):
    _opcheck(getattr(torch.ops.torchqkit, name).default, name)


def test_the_interpreter_registers_every_triton_kernel():
    assert sorted(TRITON_OPS) == ["torchqkit::linear_fp6wo", "torchqkit::linear_fp8wo", "torchqkit::linear_int4wo_tiled",
                                  "torchqkit::linear_int8wo_plain", "torchqkit::linear_intxwo",
                                  "torchqkit::linear_mxwo", "torchqkit::linear_nf4wo",
                                  "torchqkit::linear_nm_sparse_wo", "torchqkit::linear_nvfp4wo",
                                  "torchqkit::linear_ternarywo",
                                  "torchqkit::scaled_mm_fp8_rowwise", "torchqkit::sdpa_quantized_kv_cache"]
