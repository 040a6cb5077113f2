"""A tiny LLaMA (transformers' LlamaForCausalLM, random weights) quantized with each config that has a GPU kernel,
run eagerly, under torch.compile and through generate(), on each ``device`` (test/devices.py): on CPU in float32
with the C++ CPU kernels, on a GPU in bfloat16 with the CUDA C++ / Triton kernels (``pytest -m gpu``).

The model's widths are multiples of 128 so every layout serves every Linear (nothing padded or skipped). The
quantized model's logits are compared with the same model quantized with ``KernelPreference.REFERENCE`` (every
Linear dequantizes its weight, fake-quantizes its activation where the config says, then runs a float F.linear: the
definition the kernels implement), as the error's norm relative to the logits' norm. Weight-only kernels differ
from it only in float rounding: 1e-4 in float32 (measured ~1e-6), 2e-2 in bfloat16. With dynamic float8 activations
a last-bit difference in one layer's output can move an activation across a float8 rounding boundary in the next
(one e4m3 step, 2^-3 relative, on that element): 2e-2 (7e-3 measured with the GPU's unit-scale product form run on
CPU; 0 with the CPU's own form; quantization itself costs 0.14), 3e-2 in bfloat16. torch.compile must give the eager logits (Inductor on a GPU; on CPU the aot_eager backend, which traces
the same graph without Inductor's C++ compile, ~15 s per config here; Inductor on CPU is tested in
test/reliability/test_compile_strided_inputs.py).
"""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk
from torchqkit.tensor.activation import KernelPreference

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "int4-g64": lambda pref: qk.Int4WeightOnlyConfig(group_size=64, kernel_preference=pref),
    "int8-wo": lambda pref: qk.Int8WeightOnlyConfig(kernel_preference=pref),
    "nf4": lambda pref: qk.NF4WeightOnlyConfig(kernel_preference=pref),
    "fp8-wo": lambda pref: qk.Float8WeightOnlyConfig(kernel_preference=pref),
    "mxfp4": lambda pref: qk.MXFP4WeightOnlyConfig(kernel_preference=pref),
    "nvfp4": lambda pref: qk.NVFP4WeightOnlyConfig(kernel_preference=pref),
    "fp6-e2m3": lambda pref: qk.FP6WeightOnlyConfig(ebits=2, kernel_preference=pref),
    "fp8-dyn-row": lambda pref: qk.Float8DynamicActivationFloat8WeightConfig(granularity=qk.PerRow(),
                                                                             kernel_preference=pref),
}
TOL = {(torch.float32, False): 1e-4, (torch.bfloat16, False): 2e-2,   # (activation dtype, dynamic activations)
       (torch.float32, True): 2e-2, (torch.bfloat16, True): 3e-2}


def _tiny_llama(device, dtype):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.1)  # larger than the default init: logits that depend on every weight
    return model.to(device=device, dtype=dtype)


def _close(got, want, tol):
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err <= tol, err


@pytest.mark.parametrize("name", CONFIGS)
def test_quantized_llama_runs_eager_compiled_and_generates(name, device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, reference = _tiny_llama(device, dtype), _tiny_llama(device, dtype)
    report = qk.quantize_(model, CONFIGS[name](KernelPreference.AUTO))
    tol = TOL[dtype, name.startswith("fp8-dyn")]
    qk.quantize_(reference, CONFIGS[name](KernelPreference.REFERENCE))
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert all(isinstance(model.get_submodule(n).weight, qk.AffineQuantizedTensor) for n in linears), report
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        eager = model(ids).logits
        _close(eager, reference(ids).logits, tol)
        # every case compiles the same transformers forward code objects: start from an empty dynamo cache, or the
        # cases together (and earlier tests in the process) pass its recompile limit, which fullgraph turns into an error
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
        _close(compiled(ids).logits, eager, tol)
        out = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 16) and torch.equal(out[:, :12], ids[:1])
