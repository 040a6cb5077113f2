"""torchqkit_triton::sdpa_quantized_kv_cache (kernels/triton/quantized_kv_attention.py) against the op's reference
(decode the rows, sdpa) on caches filled through the append op: every format and granularity, GQA, residual tails,
bool / additive / causal masks, a row that sees nothing, bf16 queries. Under TRITON_INTERPRET=1 on CPU and natively on
a GPU (the ``device`` fixture's "cuda" case, ``pytest -m gpu``).

Tolerance: the kernel decodes each code as the reference does (one multiply-add, which a GPU may fuse) and sums the
same float32 products in another order (D per score, n per output, IEEE ``tl.dot``); outputs are of size ~1 (values
N(0, 1), weights summing to 1): 1e-5 absolute, as the C++ kernel's test.
"""
from __future__ import annotations

import pytest
import torch

from torchqkit.kernels.reference import sdpa_quantized_kv_cache_ref
from torchqkit.kernels.triton import INTERPRET
from torchqkit.kvcache import KVCacheConfig
from test.devices import DEVICES
from test.kvcache.kv_testing import ATTENTION_CASES, attention_mask, filled_store, op_args

ATOL = 1e-5

CASES = ATTENTION_CASES + [
    pytest.param(KVCacheConfig("int8", residual_length=64), 9, 3, 1, 20, 64, (None,), None, id="int8-all-in-the-tail"),
]
OP = torch.ops.torchqkit_triton.sdpa_quantized_kv_cache


def _inputs(cfg, hq, hkv, lq, n, d, chunks, mask_kind, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, lq, hq, d, generator=g).transpose(1, 2)  # transformers' memory order
    k = torch.randn(1, hkv, n, d, generator=g) + torch.linspace(-2, 2, d)
    v = torch.randn(1, hkv, n, d, generator=g)
    ks = filled_store(k, cfg, cfg.key_per_channel, chunks, capacity=n + 5)
    vs = filled_store(v, cfg, False, chunks, capacity=n + 5)
    args = op_args(q, ks, vs, attention_mask(mask_kind, lq, n, n + 5), cfg)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _skip(device):
    if device == "cpu" and not INTERPRET:
        pytest.skip("Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg,hq,hkv,lq,n,d,chunks,mask", CASES)
def test_kernel_equals_reference(device, cfg, hq, hkv, lq, n, d, chunks, mask):
    _skip(device)
    args = _inputs(cfg, hq, hkv, lq, n, d, chunks, mask, device)
    got = OP(*args)
    want = sdpa_quantized_kv_cache_ref(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    assert got.shape == (1, hq, lq, d) and got.device.type == device
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("device", DEVICES)
def test_a_head_that_sees_nothing_gives_zeros_and_bf16_queries_return_bf16(device):
    _skip(device)
    cfg = KVCacheConfig("int4", key_granularity="channel", group_size=32)
    args = list(_inputs(cfg, 6, 2, 1, 90, 64, (89, 1), None, device))
    visible = torch.ones(1, 6, 1, 95, dtype=torch.bool, device=device)
    visible[:, 4] = False
    args[11] = visible
    got = OP(*args)
    want = sdpa_quantized_kv_cache_ref(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    assert torch.equal(got[:, 4].cpu(), torch.zeros(1, 1, 64))
    keep = [h for h in range(6) if h != 4]
    torch.testing.assert_close(got[:, keep].cpu(), want[:, keep], rtol=0, atol=ATOL)
    args[0] = args[0].bfloat16()
    half = OP(*args)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half[:, keep].float().cpu(), want[:, keep], rtol=0, atol=1e-2)  # bf16 output rounding


def test_bad_input_names_the_problem():
    if not INTERPRET:
        pytest.skip("Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    args = list(_inputs(KVCacheConfig("int8"), 4, 2, 1, 20, 64, (None,), None, "cpu"))
    args[14] = "int3"
    with pytest.raises(ValueError, match="format 'int3' is not one of"):
        OP(*args)
    args = list(_inputs(KVCacheConfig("int8"), 4, 2, 1, 20, 64, (None,), None, "cpu"))
    args[13] = False
    with pytest.raises(ValueError, match="4 query heads and 2 kv heads need .*enable_gqa=True"):
        OP(*args)
