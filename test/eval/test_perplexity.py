"""torchqkit.eval.perplexity against independent computations on a tiny random Llama: one full-context
cross-entropy, and one forward pass per scored token for the windowed schemes."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchqkit.eval import perplexity

from .models import tiny_llama

pytest.importorskip("transformers")

VOCAB = 96


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (41,), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _per_token_reference(model, ids, window: int, stride: int) -> float:
    """Each position p >= 1 is scored once, by the first window (begin = 0, stride, ...) that reaches past
    it, with that window's tokens before p as context; not at all if it is that window's first token."""
    nlls = []
    for p in range(1, ids.numel()):
        begin = max(0, math.ceil((p - window + 1) / stride) * stride)
        if begin == p:
            continue
        logits = model(ids[begin:p + 1].unsqueeze(0)).logits[0, -2]
        nlls.append(F.cross_entropy(logits, ids[p]).item())
    return math.exp(sum(nlls) / len(nlls))


@torch.no_grad()
def test_full_window_is_exp_cross_entropy(model, ids):
    expected = math.exp(F.cross_entropy(model(ids.unsqueeze(0)).logits[0, :-1], ids[1:]).item())
    assert perplexity(model, ids, window=ids.numel(), progress=False) == pytest.approx(expected, rel=1e-5)
    # A longer window than the sequence is the same single window; (1, T) is accepted too.
    assert perplexity(model, ids.unsqueeze(0), window=100, progress=False) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("window, stride", [(8, 8), (8, 3), (8, 1), (16, 5), (7, None)])
def test_windows_match_per_token_reference(model, ids, window, stride):
    got = perplexity(model, ids, window, stride=stride, progress=False)
    assert got == pytest.approx(_per_token_reference(model, ids, window, stride or window), rel=1e-5)


def test_plain_module_returning_logits_and_tuple(ids):
    torch.manual_seed(0)
    bigram = nn.Sequential(nn.Embedding(VOCAB, VOCAB))       # logits depend on the previous token only
    with torch.no_grad():
        expected = math.exp(F.cross_entropy(bigram(ids[:-1]), ids[1:]).item())

    class TupleOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = bigram

        def forward(self, x):
            return (self.inner(x), "extra")

    # With a bigram model, windows lose no context, but each window's first token is not scored.
    n_windows = math.ceil(ids.numel() / 10)
    unscored = set(range(10, ids.numel(), 10))
    keep = torch.tensor([p not in unscored for p in range(1, ids.numel())])
    with torch.no_grad():
        windowed = math.exp(F.cross_entropy(bigram(ids[:-1])[keep], ids[1:][keep]).item())
    assert len(unscored) == n_windows - 1
    assert perplexity(bigram, ids, window=ids.numel(), progress=False) == pytest.approx(expected, rel=1e-6)
    assert perplexity(TupleOut(), ids, window=10, progress=False) == pytest.approx(windowed, rel=1e-6)


def test_restores_training_mode(model, ids):
    model.train()
    try:
        perplexity(model, ids, window=16, progress=False)
        assert model.training
        assert all(m.training for m in model.modules())
    finally:
        model.eval()


def test_progress_line_on_stderr(model, ids, capsys):
    value = perplexity(model, ids, window=16, progress=True)
    err = capsys.readouterr().err
    assert err.startswith("\rperplexity [") and err.endswith("\n") and err.count("\n") == 1
    assert f"{ids.numel() - 1}/{ids.numel() - 1} tokens (100%)" in err
    assert f"ppl {value:.3f}" in err
    perplexity(model, ids, window=16, progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([], dtype=torch.long), "has 0 token"),
    (torch.tensor([5]), "has 1 token"),
    (torch.tensor([1.0, 2.0, 3.0]), "integer token ids"),
    (torch.tensor([True, False]), "integer token ids"),
    (torch.tensor([1, 2, VOCAB]), f"token id {VOCAB}, but the model's vocabulary has {VOCAB}"),
    (torch.tensor([1, -3, 2]), "negative token id"),
    (torch.zeros(2, 5, dtype=torch.long), "must be 1-d"),
    ([1, 2, 3], "must be a torch.Tensor"),
])
def test_rejects_bad_input_ids(model, bad, message):
    with pytest.raises(ValueError, match=message):
        perplexity(model, bad, progress=False)


@pytest.mark.parametrize("window, stride, message", [
    (1, None, "window must be an int >= 2"),
    (0, None, "window must be an int >= 2"),
    (8, 0, "stride must be an int in 1..window"),
    (8, 9, "stride must be an int in 1..window"),
])
def test_rejects_bad_window_or_stride(model, ids, window, stride, message):
    with pytest.raises(ValueError, match=message):
        perplexity(model, ids, window, stride=stride, progress=False)


def test_vocab_size_from_embedding_when_there_is_no_config():
    model = nn.Sequential(nn.Embedding(10, 10))
    model.get_input_embeddings = lambda: model[0]
    with pytest.raises(ValueError, match="vocabulary has 10 entries"):
        perplexity(model, torch.tensor([1, 2, 10]), progress=False)


def test_rejects_non_causal_output_shape():
    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 10)

        def forward(self, x):
            return self.embed(x).mean(dim=1)        # (batch, vocab): one prediction per sequence

    with pytest.raises(ValueError, match="is this a causal language model"):
        perplexity(Pooled(), torch.tensor([1, 2, 3]), progress=False)
