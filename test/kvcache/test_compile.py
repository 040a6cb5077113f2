"""A compiled LeanDecoder step (torch.compile fullgraph) with a static QuantizedKVCache: the same tokens as eager, and
the graph calls the cache's append op and its attention op in place of any float copy of the cache."""
from __future__ import annotations

import torch

import torchqkit as qk
from torchqkit.eval import LeanDecoder

from ..common import op_calls, small_hf_llama


def test_compiled_step_equals_eager_and_reads_the_codes():
    from torch._inductor.utils import run_and_get_code

    model = small_hf_llama().eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(0))
    cfg = qk.KVCacheConfig("int4", key_granularity="channel", group_size=8, residual_length=4)
    eager = LeanDecoder(model, 40, kv_cache=cfg).generate(ids, 10)
    decoder = LeanDecoder(model, 40, compile=True, kv_cache=cfg, inductor_options={"cpp_wrapper": False})
    got, code = run_and_get_code(decoder.generate, ids, 10)
    assert torch.equal(got, eager)
    assert decoder.replayed_steps == 8  # steps 2..9 call the compiled graph directly (Note [Step replay])
    text = "\n".join(code)
    assert op_calls(text, "sdpa_quantized_kv_cache") == 2  # 2 layers
    assert op_calls(text, "kv_cache_append") == 4  # keys and values of 2 layers
    assert torch.equal(decoder.generate(ids, 10), eager)  # a second call reuses the graph
