"""float8 training of a small LLaMA (transformers' LlamaForCausalLM: hidden 64, 2 layers, 4 / 2 heads, SwiGLU 160,
tied 128-token embeddings; every Linear in float8) from transformers' seeded init, 40 AdamW steps on torchqkit's own
text as bytes, with each recipe: dynamic scales with e5m2 and with e4m3 gradients, delayed with e4m3 gradients, and
static scales from a two-batch calibration pass with e5m2 and e4m3 gradients. Each run's loss must stay within a few
percent of the float32 run's on the same batches (emulated float8 matmuls on CPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from test.common import small_hf_llama

pytest.importorskip("transformers")

STEPS, BATCH, SEQ = 40, 8, 32
RECIPES = {
    "dynamic-e5m2": ("dynamic", "float8_e5m2"),
    "dynamic-e4m3": ("dynamic", "float8_e4m3fn"),
    "delayed-e4m3": ("delayed", "float8_e4m3fn"),
    "static-e5m2": ("static", "float8_e5m2"),
    "static-e4m3": ("static", "float8_e4m3fn"),
}


def _text() -> torch.Tensor:
    from torchqkit.eval.models import eval_text
    return torch.tensor([b % 128 for b in " ".join(eval_text().split()).encode("utf-8")], dtype=torch.long)


def _batches(text, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(text.numel() - SEQ - 1, (BATCH,), generator=gen)
        chunk = torch.stack([text[s:s + SEQ + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


def _loss(model, x, y):
    return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())


def _train(text, recipe=None, grad_dtype="float8_e5m2"):
    model = small_hf_llama(seed=0, init_std=None)  # transformers' own init: training from scratch
    if recipe is not None:
        report = qk.enable_float8_training_(model, recipe, grad_dtype=grad_dtype)
        assert len(report.quantized) == 15 and not report.skipped  # 7 Linears per layer and the tied lm_head
        if recipe == "static":  # scales from two batches the training run doesn't see
            with qk.float8_training_calibration(model):
                for x, y in _batches(text, 2, seed=99):
                    _loss(model, x, y).backward()
            model.zero_grad()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for x, y in _batches(text, STEPS, seed=1):
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.fixture(scope="module")
def text():
    return _text()


@pytest.fixture(scope="module")
def float32_losses(text):
    return _train(text)[0]


def _end(losses):
    # The median of the last 10 steps: less noise than one batch, and one loss spike doesn't decide (static scales
    # saturate as training grows the activations, and e5m2 gradients then spike a step or two here and there,
    # where float rounding puts them: the same run spikes at steps 36-37 with AVX-512 kernels, 35 with AVX2 ones).
    last = sorted(losses[-10:])
    return (last[4] + last[5]) / 2


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_recipe_trains_like_float32(text, float32_losses, name):
    # Measured (median of the last 10 losses vs float32's 3.064; first loss 4.808 in every run), with torch's AVX-512
    # kernels / its AVX2 ones: dynamic-e5m2 +0.23% / +0.28%, dynamic-e4m3 -0.02% / -0.02%, delayed-e4m3 -0.11% /
    # -0.15%, static-e5m2 +0.23% / +0.28%, static-e4m3 +0.03% / +0.05%. Budget: 3%.
    assert _end(float32_losses) < 0.7 * float32_losses[0]  # it learns
    losses, model = _train(text, *RECIPES[name])
    assert abs(losses[0] - float32_losses[0]) <= 1e-3 * float32_losses[0]  # the same model and batch
    assert abs(_end(losses) - _end(float32_losses)) <= 0.03 * _end(float32_losses)
    if RECIPES[name][0] == "static":
        # Scales calibrated at the init: as training grows the activations, inputs saturate and the report says
        # so (measured: 162 / 163 saturating casts of inputs over 15 layers x 40 steps, peaks 92x / 54x the range).
        report = qk.float8_training_overflows(model)
        assert len(report) == 15
        assert sum(t["input"]["casts"] for t in report.values()) > 0
        assert max(t["input"]["peak"] for t in report.values()) > 1
