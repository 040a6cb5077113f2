"""Perplexity of a causal language model over a token sequence, scored window by window.

See Note [Perplexity windows] for which tokens each window scores.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..progress import ProgressLine

__all__ = ["perplexity", "check_token_ids", "model_vocab_size", "logits_of"]

# Note [Perplexity windows]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The sequence ids[0:T] is cut into windows ids[begin:end] with begin = 0, stride, 2*stride, ... and
# end = min(begin + window, T), stopping after the window that reaches T. The model sees each window
# alone (no cache carried over), so the context of a token is at most `window` tokens.
#   - stride == window (default): windows don't overlap. A window predicts its tokens 1.. from the
#     tokens before them inside the window; its first token has no context and is not scored. This
#     scores T - (number of windows) tokens.
#   - stride < window (sliding window): a window scores only the tokens that the previous window did
#     not reach (from max(previous end, begin + 1) to end); the overlap serves as context. Each token
#     from position 1 on is scored exactly once, with at least window - stride tokens of context
#     (except near the start). Smaller strides give lower (better-informed) perplexity at more cost.
# Perplexity = exp(sum of token negative log-likelihoods / number of scored tokens), summed in float64.


def perplexity(model: nn.Module, input_ids: torch.Tensor, window: int = 512, *, stride: int | None = None,
               progress: bool = True) -> float:
    """exp(mean negative log-likelihood per token) of a causal LM on `input_ids` (see Note [Perplexity windows]).

    model: an HF-style causal LM (`model(ids).logits`) or any module returning logits (batch, seq, vocab)
        for ids (batch, seq). It is run in eval mode under torch.no_grad(); its train/eval mode is
        restored afterwards.
    input_ids: token ids, a 1-d integer tensor of length >= 2, or shape (1, T).
    window: tokens per forward pass (the longest context a token gets). stride: how far each window
        moves; default `window` (non-overlapping windows).
    progress: a one-line progress bar on stderr (tokens scored / total, running perplexity).
    """
    ids = check_token_ids(input_ids, model_vocab_size(model))
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an int >= 2 (a window of one token predicts nothing), got {window!r}")
    stride = window if stride is None else stride
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= window:
        raise ValueError(f"stride must be an int in 1..window ({window}), got {stride!r}")
    total = ids.numel()
    device = _device_of(model)
    was_training = model.training
    model.eval()
    bar = ProgressLine("perplexity", total - 1, enabled=progress)
    nll_sum, scored, scored_to = 0.0, 0, 0
    try:
        with torch.no_grad():
            for begin in range(0, total, stride):
                end = min(begin + window, total)
                first = max(scored_to, begin + 1)     # first position this window scores
                if first < end:
                    logits = logits_of(model, ids[begin:end].unsqueeze(0).to(device))
                    _check_logits(logits, end - begin)
                    # Position p is predicted by the logits at p - 1 (window-relative: p - 1 - begin).
                    pred = logits[0, first - 1 - begin:end - 1 - begin].float()
                    target = ids[first:end].to(pred.device)
                    nll_sum += F.cross_entropy(pred, target, reduction="sum").double().item()
                    scored += end - first
                scored_to = end
                bar.update(end - 1, f"ppl {math.exp(nll_sum / scored):.3f}" if scored else "")
                if end == total:
                    break
    finally:
        bar.close()
        model.train(was_training)
    return math.exp(nll_sum / scored)


def check_token_ids(input_ids, vocab_size: int | None = None) -> torch.Tensor:
    """`input_ids` as a 1-d int64 CPU tensor, or a ValueError saying what is wrong with it."""
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype} "
                         f"(tokenize the text first, e.g. tokenizer(text, return_tensors='pt').input_ids)")
    if input_ids.dim() == 2 and input_ids.shape[0] == 1:
        input_ids = input_ids[0]
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be 1-d (T,) or (1, T), got shape {tuple(input_ids.shape)}")
    if input_ids.numel() < 2:
        raise ValueError(f"input_ids has {input_ids.numel()} token(s); perplexity needs at least 2 "
                         f"(the first token is only context)")
    ids = input_ids.detach().to("cpu", torch.int64)
    low, high = ids.min().item(), ids.max().item()
    if low < 0:
        raise ValueError(f"input_ids holds a negative token id ({low})")
    if vocab_size is not None and high >= vocab_size:
        raise ValueError(f"input_ids holds token id {high}, but the model's vocabulary has {vocab_size} "
                         f"entries (0..{vocab_size - 1}): was the text tokenized with another model's tokenizer?")
    return ids


def model_vocab_size(model: nn.Module) -> int | None:
    """The vocabulary size the model declares (config.vocab_size, else its input embedding's rows), or None."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embedding = get_embeddings() if callable(get_embeddings) else None
    return embedding.num_embeddings if isinstance(embedding, nn.Embedding) else None


def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The logits of `model(ids)`: its `.logits` (transformers), the tensor itself, or a tuple's first item."""
    out = model(ids)
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        logits = out[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model returned {type(out).__name__}; expected logits: a tensor, an object "
                        f"with .logits (transformers), or a tuple whose first item is the logits")
    return logits


def _check_logits(logits: torch.Tensor, length: int) -> None:
    if logits.dim() != 3 or logits.shape[:2] != (1, length):
        raise ValueError(f"expected logits of shape (1, {length}, vocab) for a window of {length} tokens, got "
                         f"{tuple(logits.shape)}: is this a causal language model (one prediction per position)?")


def _device_of(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")
