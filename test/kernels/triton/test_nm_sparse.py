"""torchqkit_triton::linear_nm_sparse_wo (kernels/triton/nm_sparse_weight_only.py): both kernels, the gather GEMV
and the dense-tile GEMM, on NMSparseLayout's real bytes against the op's own decoder (nm_sparse_weight, what its
reference multiplies by), under TRITON_INTERPRET=1 on CPU and natively on a GPU (the ``device`` fixture).

Expected values and tolerances. The kernels decode each kept weight as the oracle does (the same float32 operations,
one ulp apart at most on a GPU, where a float zero point's multiply-add may become one FMA), so what differs is:
- the GEMV multiplies float32 weights by float32-widened activations: only the summation order and the final cast
  to the activation dtype differ from the float32 reference;
- the GEMM hands ``tl.dot`` the weights in the activation dtype: the expected value uses the decoded weight rounded
  to that dtype too, and then only the summation order (fp16 / bf16 products are exact in float32) and the cast
  differ.
So out = expected within one rounding of the output (2^-10 relative for fp16, 2^-7 for bf16, 1e-6 for float32)
plus 2e-5 absolute for the order of at most 128 float32 terms of size < 3 (outputs are of size ~1).
bfloat16 runs the GEMV only under the interpreter: its bf16 ``tl.dot`` is wrong (triton-lang/triton#11584).

Every format runs under the interpreter; on a GPU (``pytest -m gpu``), where each format, dtype and autotune config is
a compile, the format-matrix tests take the two presets' formats (2:4 int8 per row, 2:4 int4 g32 float zero point)
and one of the one-hot formats, to fit .ci/gpu_check.sh's budget.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.core import qdtypes as Q
from torchqkit.core.primitives import MappingType
from torchqkit.kernels.ops.linear_intxwo import intx_fields, pack_intx_fields
from torchqkit.kernels.ops.linear_nm_sparse_wo import nm_sparse_weight, position_bits
from torchqkit.kernels.triton import INTERPRET, nm_sparse_weight_only as nm
from torchqkit.tensor.activation import KernelPreference
from test.common import OpLog
from test.devices import gpu_param

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]
RTOL = {torch.float32: 1e-6, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
ATOL = 2e-5


def _sparse(base, pattern=(2, 4)):
    return qk.SparsityConfig(pattern=pattern, base=base)


def _pruned(n, k, config, dtype=torch.float32):
    torch.manual_seed(n * 1000 + k)
    lin = torch.nn.Linear(k, n, bias=False).to(dtype)
    qk.quantize_(lin, config)
    return lin.weight


WEIGHTS = {  # N 37 (one column tile, a partial one) or 70 (two); K 64 unless the case is about K
    "2of4_int8_row_N70": lambda: _pruned(70, 64, _sparse(qk.Int8WeightOnlyConfig())),
    # uint4 codes, a float zero point (no code means 0: the mask), bfloat16 scales and zero points
    "2of4_int4_g32_float_zp": lambda: _pruned(37, 64, _sparse(qk.Int4WeightOnlyConfig(group_size=32)), torch.bfloat16),
    "4of8_int8_row": lambda: _pruned(37, 64, _sparse(qk.Int8WeightOnlyConfig(), (4, 8))),
    "1of4_int4_int_zp_g32": lambda: _pruned(37, 64, _sparse(qk.IntxWeightOnlyConfig(
        bits=4, granularity=qk.PerGroup(32), mapping=MappingType.ASYMMETRIC), (1, 4))),
    # K = 100: int4 g32 pads it to 128 inside the layout; int8 per row stores 100 (E = 50, tails of both kernels' steps)
    "2of4_int4_g32_K100": lambda: _pruned(37, 100, _sparse(qk.Int4WeightOnlyConfig(group_size=32))),
    "2of4_int8_row_K100": lambda: _pruned(37, 100, _sparse(qk.Int8WeightOnlyConfig())),
    "2of4_int3_g32": lambda: _pruned(37, 64, _sparse(qk.IntxWeightOnlyConfig(bits=3))),  # fields crossing bytes
    # uint8 codes with an integer zero point, one scale for the tensor: the scale's row block is all 37 rows
    "2of4_uint8_tensor": lambda: qk.quantize_weight(torch.randn(37, 64, generator=torch.Generator().manual_seed(3)),
                                                    Q.uint8, qk.PerTensor(), qk.NMSparseLayout(2, 4)),
    "3of16_int5_g32": lambda: _pruned(37, 64, _sparse(qk.IntxWeightOnlyConfig(bits=5, granularity=qk.PerGroup(32)),
                                                      (3, 16))),  # 4-bit positions, n not a power of two
}
LAUNCHES = {"gemv": "launch_gemv", "gemm": "launch_gemm"}
GPU_WEIGHTS = ("2of4_int8_row_N70", "2of4_int4_g32_float_zp")
ONE_HOT = ("4of8_int8_row", "1of4_int4_int_zp_g32", "2of4_int3_g32", "2of4_uint8_tensor", "3of16_int5_g32")


def _cases(names, gpu_names):
    """(device, weight name) params: every name on CPU, ``gpu_names`` on the GPU (see the module docstring)."""
    return ([pytest.param("cpu", name, id=f"cpu-{name}") for name in names] +
            [gpu_param("cuda", name, id=f"cuda-{name}") for name in gpu_names])


@pytest.fixture(scope="module")
def weights():
    return {name: make() for name, make in WEIGHTS.items()}


def _skip(device, dtype=torch.float32, kernel="gemv"):
    if device == "cpu" and not INTERPRET:
        pytest.skip("Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    if device == "cpu" and dtype == torch.bfloat16 and kernel == "gemm":
        pytest.skip("the interpreter computes bf16 tl.dot wrongly (triton-lang/triton#11584): the GEMM's bf16 runs "
                    "on the GPU")


def _args(w, device):
    """The op's weight arguments (kept .. zero_point_domain) and the stored K."""
    layout = w.qlayout
    args = (w.kept, w.positions, w.scale, w.zero_point, layout.n, layout.m, w.qdtype.bits, w.qdtype.signed,
            qk.ZeroPointDomain(w.zero_point_domain).value)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args), layout.stored_k(w.weight_format)


def _decoded(args, k):
    """The op reference's float32 (N, K) weight."""
    return nm_sparse_weight(*args, k=k)


def _assert_matches(out, x, weight, bias, what):
    expected = F.linear(x.float(), weight, None if bias is None else bias.float())
    assert out.dtype == x.dtype and out.shape == expected.shape, (what, out.dtype, out.shape)
    torch.testing.assert_close(out.float(), expected, rtol=RTOL[x.dtype], atol=ATOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device, name", _cases(WEIGHTS, GPU_WEIGHTS))
@pytest.mark.parametrize("kernel", list(LAUNCHES))
def test_kernel_matches_the_op_reference_every_token_count(weights, kernel, device, name, dtype):
    """1..9 tokens through each kernel (the op sends 1..GEMV_MAX_M to the GEMV, more to the GEMM)."""
    _skip(device, dtype, kernel)
    args, k = _args(weights[name], device)
    weight = _decoded(args, k)
    if kernel == "gemm":
        weight = weight.to(dtype).float()  # tl.dot's operands: see the module docstring
    launch = getattr(nm, LAUNCHES[kernel])
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(args[0].shape[0], generator=gen).to(dtype).to(device)
    for m in range(1, 10):
        x = torch.randn(m, k, generator=gen).to(dtype).to(device)
        _assert_matches(launch(x, *args, bias), x, weight, bias, f"{kernel} {name} M={m}")


@pytest.mark.parametrize("device, name", _cases(ONE_HOT, ONE_HOT[1:2]))
@pytest.mark.parametrize("kernel", list(LAUNCHES))
def test_one_hot_activations_read_back_every_weight_exactly(weights, kernel, device, name):
    """x = I (K tokens), no bias: output column k is the weight each kernel decoded at column k, pruned ones included,
    and it must be the reference's weight bit for bit (these formats' dequantization is one multiply: nothing to
    fuse)."""
    _skip(device)
    args, k = _args(weights[name], device)
    out = getattr(nm, LAUNCHES[kernel])(torch.eye(k, device=device), *args)
    torch.testing.assert_close(out.t(), _decoded(args, k), rtol=0, atol=0)


def _reverse_blocks(w):
    """kept and positions of ``w`` (2:4, 8-bit codes) with the two entries of every block swapped."""
    layout = w.qlayout
    e = w.kept.shape[1]
    kept = w.kept.reshape(-1, e // 2, 2).flip(-1).reshape(-1, e)
    pos = intx_fields(w.positions, position_bits(layout.m), e).reshape(-1, e // 2, 2).flip(-1).reshape(-1, e)
    return kept, pack_intx_fields(pos.to(torch.uint8), position_bits(layout.m))


@pytest.mark.parametrize("kernel", list(LAUNCHES))
def test_entries_in_any_order_inside_their_block(weights, kernel, device):
    """The kernels find an entry by its position field, never by its rank in the block."""
    _skip(device)
    w = weights["2of4_int8_row_N70"]
    args, k = _args(w, device)
    kept, positions = (t.to(device) for t in _reverse_blocks(w))
    swapped = (kept, positions, *args[2:])
    assert not torch.equal(kept, args[0]) and torch.equal(_decoded(swapped, k), _decoded(args, k))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4)).to(device)
    launch = getattr(nm, LAUNCHES[kernel])
    torch.testing.assert_close(launch(x, *swapped), launch(x, *args), rtol=RTOL[torch.float32], atol=ATOL)


@pytest.mark.parametrize("m", [nm.GEMV_MAX_M, nm.GEMV_MAX_M + 1])
def test_op_picks_the_gemv_for_decode_and_the_gemm_otherwise(weights, m, monkeypatch, device):
    _skip(device)
    calls = []
    for name in LAUNCHES.values():
        fn = getattr(nm, name)
        monkeypatch.setattr(nm, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    args, k = _args(weights["2of4_int4_g32_K100"], device)
    x = torch.randn(m, 1, k, generator=torch.Generator().manual_seed(m)).to(device)  # leading dims are flattened
    out = torch.ops.torchqkit_triton.linear_nm_sparse_wo(x, *args)
    assert calls == (["launch_gemv"] if m <= nm.GEMV_MAX_M else ["launch_gemm"])
    assert out.shape == (m, 1, 37)
    _assert_matches(out.reshape(m, 37), x.reshape(m, k), _decoded(args, k), None, f"M={m}")


def test_layout_pads_k_and_compiles_on_the_triton_kernel(device):
    """KernelPreference.TRITON on a padded weight (K = 90, stored as 96: whole groups of 32): the layout pads x, the
    Triton kernel runs eagerly and under torch.compile(fullgraph=True) (test_layout_paths.py covers int8 too)."""
    _skip(device)
    torch.manual_seed(0)
    lin = torch.nn.Linear(90, 37).to(device)
    qk.quantize_(lin, _sparse(qk.Int4WeightOnlyConfig(group_size=32, kernel_preference=KernelPreference.TRITON)))
    x = torch.randn(2, 3, 90, device=device)
    with OpLog(qualified=True) as log, torch.no_grad():
        out = lin(x)
    assert "torchqkit_triton.linear_nm_sparse_wo" in log.ops and "torchqkit.linear_nm_sparse_wo" not in log.ops
    _assert_matches(out, x, lin.weight.dequantize(torch.float32), lin.bias, "layout")
    with torch.no_grad():
        compiled = torch.compile(lin, fullgraph=True)(x)
    torch.testing.assert_close(compiled, out, rtol=0, atol=0)


def test_status_names_triton_for_cuda_tensors():
    """On CUDA tensors AUTO reaches the Triton kernel through the op's CUDA key (csrc/cuda has no N:M kernel), and
    status() says so; on CPU the C++ kernel or the reference serves, never the interpreter."""
    rows = {r["linear"]: r for r in qk.kernels.status() if r["layout"] == "(backend)"}
    cuda = rows["torchqkit::linear_nm_sparse_wo on cuda"]
    assert cuda["path"] == "triton" and "usable: triton, reference" in cuda["why"], cuda
    assert rows["torchqkit::linear_nm_sparse_wo on cpu"]["path"] in ("cpu", "reference")


def test_launcher_errors_name_the_tensor_and_the_fix(weights):
    args, k = _args(weights["2of4_int8_row_N70"], "cpu")
    with pytest.raises(ValueError, match=r"kept must be torch.uint8 \(N, 32\).*signed = False"):
        nm.linear_nm_sparse_wo(torch.randn(2, k), args[0], *args[1:7], False, "none")
    with pytest.raises(ValueError, match=r"K a multiple of m \(pad x to the stored in_features\)"):
        nm.linear_nm_sparse_wo(torch.randn(2, k - 2), *args)
    with pytest.raises(ValueError, match=r"positions must be uint8 \(70, 8\)"):
        nm.linear_nm_sparse_wo(torch.randn(2, k), args[0], args[1][:, :4], *args[2:])
    with pytest.raises(ValueError, match="zero_point_domain must be 'none' without a zero_point"):
        nm.linear_nm_sparse_wo(torch.randn(2, k), *args[:8], "int")
