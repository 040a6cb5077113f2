"""A LLaMA-shaped decoder with random weights and a static KV cache (so compiled decode sees one shape): RMSNorm,
rotary embeddings, grouped-query attention, SwiGLU MLP, untied lm_head. Small on purpose: the quality group times its
decode per config, where only the shapes matter."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    dim: int = 1536
    layers: int = 16
    heads: int = 12
    kv_heads: int = 4
    ffn: int = 4096
    vocab: int = 32000
    max_seq: int = 256


QUICK = Shape(dim=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=1000, max_seq=64)


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.heads, self.kv_heads, self.hd = s.heads, s.kv_heads, s.dim // s.heads
        self.wq = nn.Linear(s.dim, s.dim, bias=False)
        self.wk = nn.Linear(s.dim, s.kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(s.dim, s.kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(s.dim, s.dim, bias=False)
        self.register_buffer("k_cache", torch.zeros(1, s.kv_heads, s.max_seq, self.hd), persistent=False)
        self.register_buffer("v_cache", torch.zeros(1, s.kv_heads, s.max_seq, self.hd), persistent=False)

    def forward(self, x, cos, sin, pos, mask):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        self.k_cache.index_copy_(2, pos, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(2, pos, v.to(self.v_cache.dtype))
        out = F.scaled_dot_product_attention(q, self.k_cache.to(q.dtype), self.v_cache.to(q.dtype), attn_mask=mask,
                                             enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(s.dim), nn.RMSNorm(s.dim)
        self.attn = Attention(s)
        self.w1, self.w3 = nn.Linear(s.dim, s.ffn, bias=False), nn.Linear(s.dim, s.ffn, bias=False)
        self.w2 = nn.Linear(s.ffn, s.dim, bias=False)

    def forward(self, x, cos, sin, pos, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, pos, mask)
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Decoder(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.shape = s
        self.embed = nn.Embedding(s.vocab, s.dim)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.dim)
        self.lm_head = nn.Linear(s.dim, s.vocab, bias=False)
        hd = s.dim // s.heads
        angles = torch.outer(torch.arange(s.max_seq).float(), 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.register_buffer("causal", torch.ones(s.max_seq, s.max_seq, dtype=torch.bool).tril(), persistent=False)

    def forward(self, tokens, pos):
        """tokens (1, T) at positions pos (T,) -> logits of the last token (1, vocab)."""
        x = self.embed(tokens)
        cos, sin = self.cos[pos].to(x.dtype), self.sin[pos].to(x.dtype)
        mask = self.causal[pos]  # (T, max_seq): attends to cached positions <= its own
        for blk in self.blocks:
            x = blk(x, cos, sin, pos, mask)
        return self.lm_head(self.norm(x[:, -1]))


def build(shape: Shape) -> Decoder:
    torch.manual_seed(0)
    with torch.no_grad():
        model = Decoder(shape)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    return model.eval()
