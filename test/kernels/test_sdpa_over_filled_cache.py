"""torchqkit::sdpa_over_filled_cache: the C++ CPU kernel (csrc/cpu/decode_attention*.cpp) against its reference
(sdpa over the filled positions) and against sdpa over the whole cache, under every ISA level this CPU runs;
opcheck, torch.compile, the float64 path, bad input, status."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchqkit import kernels
from torchqkit.kernels.reference import sdpa_over_filled_cache_ref

from cpu_kernel_testing import cpu_levels, gen, needs_kernel, running_level
from cpu_kernel_testing import isa_param as isa_param_for

OP = torch.ops.torchqkit.sdpa_over_filled_cache
LEVELS = cpu_levels("torchqkit::sdpa_over_filled_cache")
needs_ext = needs_kernel(LEVELS)
isa_param = isa_param_for(LEVELS)
# Kernel vs reference, both fp32: the same products summed in another order (D terms per score, n per output) and
# the kernel's exp (Cephes' polynomial, ~1 ulp) instead of libm's: a few ulps of the output, budget 2e-6 absolute
# for outputs of magnitude ~1 (values are N(0, 1), weights sum to 1).
ATOL = 2e-6


def _inputs(hq, hkv, lq, s, d, seed=0, dv=None):
    g = gen(seed)
    # query as transformers builds it: (B, Lq, Hq, D) memory transposed to (B, Hq, Lq, D).
    q = torch.randn(1, lq, hq, d, generator=g).transpose(1, 2)
    k = torch.randn(1, hkv, s, d, generator=g)
    v = torch.randn(1, hkv, s, dv or d, generator=g)
    return q, k, v


def _prefix_mask(lq, s, filled, kind):
    """Causal rows for Lq queries at positions filled - lq .. filled - 1 of an S-position cache: (1, 1, Lq, S)."""
    rows = torch.arange(filled - lq, filled).unsqueeze(1)
    visible = (torch.arange(s).unsqueeze(0) <= rows).reshape(1, 1, lq, s)
    if kind == "bool":
        return visible
    return torch.zeros(1, 1, lq, s).masked_fill(~visible, torch.finfo(torch.float32).min)


CASES = [  # (hq, hkv, lq, s, filled, d, mask kind)
    pytest.param(9, 3, 1, 2048, 48, 64, "bool", id="smollm2-decode-bool"),
    pytest.param(9, 3, 1, 256, 48, 64, "float", id="smollm2-decode-float"),
    pytest.param(4, 4, 3, 37, 20, 64, "bool", id="mha-lq3-odd-s"),
    pytest.param(6, 2, 3, 41, 41, 13, "float", id="gqa-lq3-odd-d-full"),
    pytest.param(2, 1, 1, 100, 1, 80, "bool", id="one-position-d80"),
    pytest.param(8, 2, 5, 33, 17, 7, "bool", id="gqa-lq5-d7"),
]


@needs_ext
@isa_param
@pytest.mark.parametrize("hq,hkv,lq,s,filled,d,kind", CASES)
def test_kernel_equals_reference_and_whole_cache_sdpa(isa, monkeypatch, hq, hkv, lq, s, filled, d, kind):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    q, k, v = _inputs(hq, hkv, lq, s, d)
    mask = _prefix_mask(lq, s, filled, kind)
    got = OP(q, k, v, mask, 0.125, hkv != hq)
    torch.testing.assert_close(got, sdpa_over_filled_cache_ref(q, k, v, mask, 0.125, hkv != hq), rtol=0, atol=ATOL)
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=hkv != hq)
    torch.testing.assert_close(got, whole, rtol=0, atol=ATOL)
    assert got.stride() == q.stride()  # as the fake (empty_like(query)) promises compiled code


@needs_ext
@isa_param
def test_masks_per_head_with_holes_and_rows_that_see_nothing(isa, monkeypatch):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    q, k, v = _inputs(6, 2, 3, 50, 16)
    visible = torch.rand(2, 6, 3, 50, generator=gen(3)) < 0.5   # batch 2: the mask's own batch and heads
    visible[..., 31:] = False
    visible[0, 1, 2] = False                                   # one row sees nothing: sdpa gives 0
    q, k, v = q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1).clone(), v.expand(2, -1, -1, -1).clone()
    additive = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    for mask in (visible, additive):
        got = OP(q, k, v, mask, 0.25, True)
        torch.testing.assert_close(got, sdpa_over_filled_cache_ref(q, k, v, mask, 0.25, True), rtol=0, atol=ATOL)
        assert got[0, 1, 2].abs().max() == 0


@needs_ext
@isa_param
def test_strided_cache_and_masks_broadcast_along_any_dim(isa, monkeypatch):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    g = gen(5)
    q = torch.randn(1, 6, 2, 24, generator=g)
    k = torch.randn(1, 70, 2, 24, generator=g).transpose(1, 2)          # (B, S, H, D) memory, as a dynamic cache
    v = torch.randn(1, 2, 70, 48, generator=g)[..., ::2]                # head dim not contiguous: copied first
    per_key = torch.zeros(1, 70, dtype=torch.bool)                    # 2-d: broadcast over batch and heads
    per_key[:, :23] = True
    for mask in (per_key, torch.ones(1, 1, 1, 1, dtype=torch.bool), torch.where(per_key, 0.5, -1.0)):  # additive, all visible
        got = OP(q, k, v, mask, 0.2, True)
        torch.testing.assert_close(got, sdpa_over_filled_cache_ref(q, k, v, mask, 0.2, True), rtol=0, atol=ATOL)


@needs_ext
@isa_param
def test_bf16_and_fp16(isa, monkeypatch):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    q, k, v = _inputs(9, 3, 1, 300, 64)
    mask = _prefix_mask(1, 300, 70, "float")
    want = sdpa_over_filled_cache_ref(q, k, v, mask, 0.125, True)
    for dtype in (torch.bfloat16, torch.float16):
        got = OP(q.to(dtype), k.to(dtype), v.to(dtype), mask.to(dtype), 0.125, True)
        assert got.dtype == dtype and got.stride() == q.stride()
        # inputs rounded to bf16 (2^-9 relative) through a softmax-weighted mean of values ~N(0, 1), the output
        # rounded once more: ~1e-2 absolute for bf16, 8x less for fp16.
        torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2 if dtype == torch.bfloat16 else 3e-3)


@needs_ext
def test_float64_runs_atens_sdpa_over_the_filled_positions_and_says_so(capfd):
    q, k, v = _inputs(9, 3, 1, 300, 64)
    mask = _prefix_mask(1, 300, 70, "float")
    got = OP(q.double(), k.double(), v.double(), mask.double(), 0.125, True)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double(), scale=0.125,
                                          enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # A C++ warning (once per process) on stderr: the dispatcher calls the kernel outside Python's warning handler.
    assert "Double inputs run ATen's scaled_dot_product_attention over the filled positions" in capfd.readouterr().err


@needs_ext
def test_reads_only_the_filled_positions():
    """Garbage (NaN) past the last visible position changes nothing: those rows are never read."""
    q, k, v = _inputs(9, 3, 1, 512, 64)
    mask = _prefix_mask(1, 512, 40, "bool")
    want = OP(q, k, v, mask, 0.125, True)
    k[:, :, 40:], v[:, :, 40:] = float("nan"), float("nan")
    assert torch.equal(OP(q, k, v, mask, 0.125, True), want)


@needs_ext
def test_bad_input_is_a_clear_error():
    q, k, v = _inputs(9, 3, 1, 16, 8)
    mask = _prefix_mask(1, 16, 5, "bool")
    with pytest.raises(RuntimeError, match="9 query heads and 3 key / value heads need enable_gqa=True"):
        OP(q, k, v, mask, 1.0, False)
    with pytest.raises(RuntimeError, match=r"attn_mask of shape \[1, 1, 1, 15\] does not broadcast"):
        OP(q, k, v, mask[..., :15], 1.0, True)
    with pytest.raises(RuntimeError, match="query, key and value must have one floating dtype"):
        OP(q, k.half(), v, mask, 1.0, True)
    with pytest.raises(RuntimeError, match="8 query heads are not a multiple of 3"):
        OP(q[:, :8], k, v, mask, 1.0, True)


@needs_ext
def test_opcheck_and_compile():
    q, k, v = _inputs(6, 2, 1, 64, 32)
    mask = _prefix_mask(1, 64, 20, "bool")
    torch.library.opcheck(OP, (q, k, v, mask, 0.125, True))

    def attend(q, k, v, mask):
        return OP(q * 2, k, v, mask, 0.125, True).transpose(1, 2).reshape(1, 1, -1) + 1

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, mask), attend(q, k, v, mask), rtol=0, atol=0)


def test_status_names_what_serves_the_op():
    backend, why = kernels.cpu_backend("torchqkit::sdpa_over_filled_cache")
    if LEVELS:
        assert backend == f"cpp {running_level(LEVELS)}"
        assert "last visible position" in why
    else:
        assert backend == "reference"
    assert kernels.choose_backend("torchqkit::sdpa_over_filled_cache", "cuda")[0] in ("cuda", "reference")
