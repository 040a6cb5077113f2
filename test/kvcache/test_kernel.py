"""torchqkit::sdpa_quantized_kv_cache: the C++ CPU kernel (csrc/cpu/quantized_kv_attention*.cpp) against its reference
(decode the rows, sdpa) at every ISA level this CPU runs, for every format and granularity; opcheck; bad input."""
from __future__ import annotations

import pytest
import torch

from torchqkit.kernels.reference import sdpa_quantized_kv_cache_ref
from torchqkit.kvcache import KVCacheConfig

from ..kernels.cpu_kernel_testing import cpu_levels, gen
from .kv_testing import ATTENTION_CASES, attention_mask, filled_store, op_args

OP = torch.ops.torchqkit.sdpa_quantized_kv_cache
LEVELS = cpu_levels("torchqkit::sdpa_quantized_kv_cache")
needs_ext = pytest.mark.skipif(not LEVELS, reason="no C++ CPU kernel for torchqkit::sdpa_quantized_kv_cache")
# Kernel vs reference on the same codes, both float32: the same decoded values up to one fused multiply-add (the
# kernel's scale-and-zero step may contract), the same products summed in another order (D per score, n per output):
# a few ulps of outputs of magnitude ~1 (values N(0, 1), weights summing to 1); budget 1e-5 absolute.
ATOL = 1e-5


def _inputs(cfg, hq, hkv, lq, n, d, chunks, mask_kind, seed=0):
    g = gen(seed)
    q = torch.randn(1, lq, hq, d, generator=g).transpose(1, 2)  # transformers' memory order
    k = torch.randn(1, hkv, n, d, generator=g) + torch.linspace(-2, 2, d)  # per-channel offsets, as real keys have
    v = torch.randn(1, hkv, n, d, generator=g)
    ks = filled_store(k, cfg, cfg.key_per_channel, chunks, capacity=n + 5)
    vs = filled_store(v, cfg, False, chunks, capacity=n + 5)
    return op_args(q, ks, vs, attention_mask(mask_kind, lq, n, n + 5), cfg)


@needs_ext
@pytest.mark.parametrize("isa", LEVELS or ["none"])
@pytest.mark.parametrize("cfg,hq,hkv,lq,n,d,chunks,mask", ATTENTION_CASES)
def test_kernel_equals_reference(isa, monkeypatch, cfg, hq, hkv, lq, n, d, chunks, mask):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", isa)
    args = _inputs(cfg, hq, hkv, lq, n, d, chunks, mask)
    got = OP(*args)
    want = sdpa_quantized_kv_cache_ref(*args)
    assert got.shape == (1, hq, lq, d)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@needs_ext
def test_bfloat16_query_runs_in_float32_and_returns_bfloat16():
    args = list(_inputs(KVCacheConfig("int8"), 9, 3, 1, 40, 64, (None,), None))
    args[0] = args[0].bfloat16()
    got = OP(*args)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, sdpa_quantized_kv_cache_ref(*args), rtol=0, atol=1e-2)  # bf16 output rounding


@pytest.mark.parametrize("cfg,hq,hkv,lq,n,d,chunks,mask", [ATTENTION_CASES[1], ATTENTION_CASES[2]])
def test_opcheck(cfg, hq, hkv, lq, n, d, chunks, mask):
    torch.library.opcheck(OP, _inputs(cfg, hq, hkv, lq, n, d, chunks, mask))


@needs_ext
def test_bad_input_names_the_tensor():
    args = list(_inputs(KVCacheConfig("int8"), 9, 3, 1, 40, 64, (None,), None))
    args[2] = args[2].float()  # k_scale must be float16
    with pytest.raises(RuntimeError, match="k_scale must be float16"):
        OP(*args)
    args = list(_inputs(KVCacheConfig("int8"), 9, 3, 1, 40, 64, (None,), None))
    args[10] = torch.tensor([41, 40])  # value counts disagree with the key counts
    with pytest.raises(RuntimeError, match="must hold one length"):
        OP(*args)
    args = list(_inputs(KVCacheConfig("int8"), 9, 3, 1, 40, 64, (None,), None))
    args[14] = "int3"
    with pytest.raises(RuntimeError, match="'int3' is not one of"):
        OP(*args)


def _window_mask(hq, n, width, window):
    """(1, hq, 1, width) bool mask of a decode step: each head sees only the last `window` positions (a sliding
    window: the first splits of the positions see nothing), head 0 sees nothing at all (its output is 0)."""
    visible = torch.zeros(1, hq, 1, width, dtype=torch.bool)
    visible[..., n - window:n] = True
    visible[:, 0] = False
    return visible


# Decode steps over long caches, cut into splits over positions when the kv heads are fewer than the threads times 4
# (Note [Quantized KV attention split over positions]): the combined splits equal the reference as one pass does.
SPLIT_CASES = [  # (config, hq, hkv, n, chunks, window): window None = causal, else _window_mask
    pytest.param(KVCacheConfig("int8", key_granularity="channel"), 9, 3, 2048, (2047, 1), None, id="int8-channel"),
    pytest.param(KVCacheConfig("int4", key_granularity="channel", group_size=32, residual_length=16), 9, 3, 1101,
                 (1100, 1), None, id="int4-channel-residual-odd-n"),
    pytest.param(KVCacheConfig("float8_e4m3fn", group_size=32), 4, 1, 777, (None,), 100, id="e4m3-window"),
    pytest.param(KVCacheConfig("int8"), 6, 2, 1300, (700, 600), 1000, id="int8-token-window"),
]


@needs_ext
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("cfg,hq,hkv,n,chunks,window", SPLIT_CASES)
def test_long_decode_split_over_positions_equals_reference(cfg, hq, hkv, n, chunks, window, threads):
    args = list(_inputs(cfg, hq, hkv, 1, n, 64, chunks, None))
    if window is not None:
        args[11] = _window_mask(hq, n, n + 5, window)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = OP(*args)
    finally:
        torch.set_num_threads(saved)
    want = sdpa_quantized_kv_cache_ref(*args)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    if window is not None:
        assert torch.equal(got[:, 0], torch.zeros_like(got[:, 0]))  # a head that sees nothing
