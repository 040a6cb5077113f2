"""Orthogonal rotations of a LLaMA-family decoder's float weights (QuaRot-style), function-preserving in float.

Note [Residual rotation]
~~~~~~~~~~~~~~~~~~~~~~~~
With Linear weights W (out, in) and y = x W^T + b, and Q (hidden x hidden) orthogonal, the model computes the same
logits when its residual stream carries x Q instead of x:

- the RMSNorm weights g are folded first into the Linears that read the norm's output (W <- W diag(g), g <- 1):
  diag(g) doesn't commute with Q, while x / rms(x) does (rms(x Q) = rms(x), Q keeps lengths);
- the embedding writes x Q: E <- E Q; every Linear reading the residual (q / k / v, gate / up, lm_head) reads
  x Q Q^T: W <- W Q; every Linear writing it (o_proj, down_proj) writes y Q: W <- Q^T W, b <- b Q.

Q is a randomized Hadamard matrix, diag(random signs) H / sqrt(n) (hadamard.py), or a random orthogonal matrix.

Two more rotations make the other Linears' inputs outlier-free too:
- value / output, offline: each value head is rotated by H_d (head_dim): v_proj's rows of head h <- H_d^T rows,
  bias b_h <- b_h H_d; a head's attention output is a weighted sum of its value rows, so it is rotated by H_d
  as well, and o_proj's input columns of head h <- cols H_d undo it (grouped-query heads
  share a value head: the same H_d for every head in the group);
- down_proj's input, online: a forward pre-hook (``OnlineRotation``) applies x H (the intermediate size's
  normalized Hadamard, or a random orthogonal matrix when no order is built) on every call, and down_proj's weight
  <- W H. The activation function sits between up_proj and down_proj, so this one can't be folded offline.
  The hook is part of the module, not of its state_dict: see ``rotate_``'s docstring.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .hadamard import hadamard_matrix, hadamard_order, hadamard_transform

__all__ = ["DecoderParts", "OnlineRotation", "RotationError", "decoder_parts", "orthogonal_matrix",
           "rotate_decoder", "online_rotation_of"]


class RotationError(ValueError):
    """A model ``rotate_`` can't rotate: the model is unchanged, and the message names the module and why.

    Raised for an architecture other than a LLaMA-family causal LM (post-LayerNorm encoders such as BERT, fused
    q / k / v projections, Gemma's (1 + weight) norms), quantized, wrapped or meta weights (rotate the float model
    before ``quantize_``), parameters outside that layout, or a model rotated already. A ``ValueError``.

    Example:
        ```python
        import torchqkit as qk
        try:
            qk.rotate_(model)
        except qk.RotationError as e:
            print(e)   # e.g. "rotate_: BertModel is not a LLaMA-family causal LM (...)"
        ```
    """


@dataclass
class DecoderParts:
    """The modules of a LLaMA-family causal LM that a residual rotation touches, found by ``decoder_parts``."""
    embed: nn.Embedding
    layers: list            # the decoder layers (each with input_layernorm, self_attn, post_attention_layernorm, mlp)
    norm: nn.Module         # the final RMSNorm
    lm_head: nn.Linear
    hidden: int
    head_dim: int
    tied: bool              # lm_head.weight is the embedding's Parameter


class OnlineRotation:
    """A forward pre-hook rotating a Linear's input: x -> x R, R the normalized Hadamard matrix of the input width
    (applied by ``hadamard_transform``) or a given orthogonal ``matrix``. One object serves every layer of a model."""

    def __init__(self, features: int, matrix: torch.Tensor | None = None):
        self.features = features
        self.matrix = matrix  # (K, K) float32, or None: Hadamard
        order = hadamard_order(features) if matrix is None else None
        self._small = None if order is None or order[0] == 1 else hadamard_matrix(order[0]).float()

    @property
    def kind(self) -> str:
        return "hadamard" if self.matrix is None else "random orthogonal"

    def rotation(self, dtype: torch.dtype, device) -> torch.Tensor:
        """R as a dense (K, K) matrix, for folding into the weight."""
        if self.matrix is not None:
            return self.matrix.to(dtype=dtype, device=device)
        return (hadamard_matrix(self.features) / math.sqrt(self.features)).to(dtype=dtype, device=device)

    def __call__(self, module: nn.Module, args: tuple):
        x = args[0]
        if self.matrix is not None:
            y = x @ self.matrix.to(dtype=x.dtype, device=x.device)
        else:
            small = None if self._small is None else self._small.to(dtype=x.dtype, device=x.device)
            y = hadamard_transform(x, small)
        return (y, *args[1:])

    def __repr__(self) -> str:
        return f"OnlineRotation({self.features}, {self.kind})"


def online_rotation_of(module: nn.Module) -> OnlineRotation | None:
    """The OnlineRotation hook on ``module``, if ``rotate_`` put one there."""
    return next((h for h in module._forward_pre_hooks.values() if isinstance(h, OnlineRotation)), None)


def orthogonal_matrix(n: int, kind: str, generator: torch.Generator) -> tuple[torch.Tensor, str]:
    """(Q (n, n) float64 orthogonal, what it is): kind "hadamard": diag(random signs) H_n / sqrt(n) when an order-n
    Hadamard matrix is built here (Note [Hadamard orders]), else (and for kind "random") the Q factor of a Gaussian
    matrix with its signs fixed (uniformly random over orthogonal matrices)."""
    if kind == "hadamard" and hadamard_order(n) is not None:
        signs = torch.randint(0, 2, (n,), generator=generator).double() * 2 - 1
        return signs.reshape(n, 1) * hadamard_matrix(n) / math.sqrt(n), "randomized hadamard"
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).reshape(1, n), "random orthogonal"


# ------------------------------------------------------------------------------------------------ the model's shape

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_HEAD_NORMS = ("q_norm", "k_norm")  # Qwen3: per-head norms of q / k, after the projections (not on the residual)


def decoder_parts(model: nn.Module) -> DecoderParts:
    """The parts of a LLaMA-family causal LM (LlamaForCausalLM, Mistral, Qwen2 / Qwen3: ``model.embed_tokens``,
    ``model.layers[i].{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
    mlp.{gate,up,down}_proj}``, ``model.norm``, ``lm_head``), checked: RMSNorms, float nn.Linear weights, and no
    parameter anywhere else. RotationError naming what doesn't fit otherwise."""
    name = type(model).__name__
    base = getattr(model, "model", None)
    lm_head = getattr(model, "lm_head", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm")) or lm_head is None:
        raise RotationError(f"rotate_: {name} is not a LLaMA-family causal LM (model.embed_tokens, model.layers, "
                            f"model.norm, lm_head; e.g. LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM); "
                            f"other architectures (post-LayerNorm encoders such as BERT, fused qkv projections) "
                            f"aren't supported. The model is unchanged.")
    embed, layers = base.embed_tokens, list(base.layers)
    hidden = embed.weight.shape[1]
    known = {id(embed.weight)}
    _check_norm(base.norm, "model.norm", hidden, known)
    head_dim = None
    for i, layer in enumerate(layers):
        where = f"model.layers.{i}"
        for part, names in (("self_attn", _ATTN), ("mlp", _MLP)):
            for n in names:
                _check_linear(getattr(getattr(layer, part, None), n, None), f"{where}.{part}.{n}", known)
        for n in ("input_layernorm", "post_attention_layernorm"):
            _check_norm(getattr(layer, n, None), f"{where}.{n}", hidden, known)
        for n in _HEAD_NORMS:
            m = getattr(layer.self_attn, n, None)
            known.update(id(p) for p in ([] if m is None else m.parameters()))
        d = getattr(layer.self_attn, "head_dim", None)
        if not isinstance(d, int) or layer.self_attn.v_proj.out_features % d:
            raise RotationError(f"rotate_: {where}.self_attn has no head_dim dividing v_proj's outputs; the model is "
                                f"unchanged")
        head_dim = d
    _check_linear(lm_head, "lm_head", known)
    others = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) not in known]
    if others:
        raise RotationError(f"rotate_: {name} has parameters outside the LLaMA layout that a residual rotation "
                            f"would have to change too: {others[:4]}; the model is unchanged")
    return DecoderParts(embed, layers, base.norm, lm_head, hidden, head_dim, lm_head.weight is embed.weight)


def _check_weight(w, where: str) -> None:
    if isinstance(w, AffineQuantizedTensor) or type(w) not in (nn.Parameter, torch.Tensor) or \
            not w.is_floating_point() or w.is_meta:
        raise RotationError(f"rotate_: {where}.weight is {type(w).__name__} "
                            f"({getattr(w, 'dtype', '?')}, {getattr(w, 'device', '?')}): rotations rewrite float "
                            f"weights with values, so call rotate_ before quantize_ (or QAT / LoRA) on a loaded "
                            f"model; the model is unchanged")


def _check_linear(m, where: str, known: set) -> None:
    if type(m) is not nn.Linear:
        raise RotationError(f"rotate_: {where} is {type(m).__name__}, not an nn.Linear (a quantized, fused or "
                            f"wrapped layer, or another architecture); rotate the float model first. The model is "
                            f"unchanged")
    _check_weight(m.weight, where)
    known.update(id(p) for p in m.parameters())


def _check_norm(m, where: str, hidden: int, known: set) -> None:
    """An RMSNorm, y = x / sqrt(mean(x^2) + eps) * weight, checked on a probe (Gemma's (1 + weight) norms and
    LayerNorm's mean subtraction compute something else, which a rotation doesn't commute with)."""
    w = getattr(m, "weight", None)
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (hidden,) or not isinstance(eps, float) or \
            sum(1 for _ in m.parameters()) != 1:
        raise RotationError(f"rotate_: {where} ({type(m).__name__}) is not an RMSNorm with one weight of {hidden} "
                            f"and an eps; the model is unchanged")
    _check_weight(w, where)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    with torch.no_grad():
        got = m(x).float()
        want = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * w.float()
    if not torch.allclose(got, want, rtol=1e-2 if w.dtype != torch.float32 else 1e-5, atol=1e-5):
        raise RotationError(f"rotate_: {where} ({type(m).__name__}) doesn't compute x / rms(x) * weight (a Gemma-style "
                            f"(1 + weight) norm or a LayerNorm?); a rotation commutes only with that. The model is "
                            f"unchanged")
    known.add(id(w))


# ------------------------------------------------------------------------------------------------ the rewrite

def rotate_decoder(parts: DecoderParts, q: torch.Tensor, online: OnlineRotation | None,
                   rotate_ov: bool) -> dict[tuple[nn.Module, str], torch.Tensor]:
    """The new tensors (module, attribute) -> value of Note [Residual rotation], computed in float64; nothing in the
    model is changed here (the caller assigns them all, so a failure part-way leaves the model as it was)."""
    new: dict[tuple[nn.Module, str], torch.Tensor] = {}
    dev = parts.embed.weight.device
    q = q.to(dev)
    d = parts.head_dim
    h_head = (hadamard_matrix(d) / math.sqrt(d)).to(dev) if rotate_ov else None

    def reads(linear: nn.Linear, norm: nn.Module):  # W <- W diag(g) Q
        new[linear, "weight"] = (linear.weight.double() * norm.weight.double()) @ q

    def writes(linear: nn.Linear, w: torch.Tensor):  # W <- Q^T W, b <- b Q
        new[linear, "weight"] = q.T @ w
        if linear.bias is not None:
            new[linear, "bias"] = linear.bias.double() @ q

    new[parts.embed, "weight"] = parts.embed.weight.double() @ q
    for layer in parts.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
            reads(lin, layer.input_layernorm)
        w_o = attn.o_proj.weight.double()
        if h_head is not None:
            v = new[attn.v_proj, "weight"]
            new[attn.v_proj, "weight"] = _per_head(v.T, h_head).T  # rows of head h <- H_d^T rows
            if attn.v_proj.bias is not None:
                new[attn.v_proj, "bias"] = _per_head(attn.v_proj.bias.double().reshape(1, -1), h_head).reshape(-1)
            w_o = _per_head(w_o, h_head)                           # columns of head h <- cols H_d
        writes(attn.o_proj, w_o)
        for lin in (mlp.gate_proj, mlp.up_proj):
            reads(lin, layer.post_attention_layernorm)
        w_d = mlp.down_proj.weight.double()
        if online is not None:
            w_d = w_d @ online.rotation(torch.float64, dev)
        writes(mlp.down_proj, w_d)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            new[norm, "weight"] = torch.ones_like(norm.weight, dtype=torch.float64)
    reads(parts.lm_head, parts.norm)
    new[parts.norm, "weight"] = torch.ones_like(parts.norm.weight, dtype=torch.float64)
    return new


def _per_head(cols: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """(R, heads * d) -> each head's d columns times h."""
    r, n = cols.shape
    d = h.shape[0]
    return (cols.reshape(r, n // d, d) @ h).reshape(r, n)
