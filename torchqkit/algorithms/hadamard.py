"""Hadamard matrices and transforms in pure PyTorch: the orthogonal rotations ``rotate_`` folds into weights.

A Hadamard matrix H of order n has entries +-1 and H H^T = n I, so H / sqrt(n) is orthogonal and spreads every
input feature over all outputs with equal weight: an outlier feature becomes n features of 1 / sqrt(n) its size,
which is what makes 4-bit activations keep their quality (QuaRot, SpinQuant).

Note [Hadamard orders]
~~~~~~~~~~~~~~~~~~~~~~
Orders built here: n = m * 2^k with m = 1 (Sylvester: H_2n = [[H, H], [H, -H]]), m = q + 1 for a prime q = 3 mod 4
(Paley's first construction) or m = 2 (q + 1) for a prime q = 1 mod 4 (Paley's second), as the Kronecker product
H_m (x) H_2^k. That covers SmolLM2's widths (576 = 36 * 16: q = 17; 1536 = 12 * 128: q = 11; 960 = 60 * 16;
2560 = 20 * 128) and every power of two. The smallest such m is taken, and it can be large: Llama-2-7B's 11008 gets
5504 * 2 (QuaRot uses a stored order-172 matrix there), so its online transform is mostly a 5504 x 5504 matmul.
Where no m fits (e.g. 2 * 3 * 7 = 42), ``hadamard_order`` says None and ``rotate_`` uses a random orthogonal matrix.

``hadamard_transform(x)`` computes x @ H_n / sqrt(n) along the last dim without building H_n: the fast
Walsh-Hadamard transform (log2(2^k) add / subtract passes) along the power-of-two factor, then one small matmul
with H_m along the other: O(n log n + n m) per row instead of O(n^2). Only torch ops, so torch.compile traces it.
"""
from __future__ import annotations

import math

import torch

__all__ = ["fwht", "hadamard_order", "hadamard_matrix", "hadamard_transform"]


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Normalized fast Walsh-Hadamard transform along the last dim (a power of two): ``x @ H / sqrt(n)`` with H
    Sylvester's matrix. Pass i pairs features j and j + 2^i inside blocks of 2^(i+1): (a, b) -> (a + b, a - b)."""
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"fwht: the last dim must be a power of two, got {n}")
    shape = x.shape
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(shape) / math.sqrt(n)).to(x.dtype)


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _paley_kind(m: int) -> str | None:
    """Which Paley construction gives order m: "I" (m - 1 prime = 3 mod 4), "II" (m / 2 - 1 prime = 1 mod 4)."""
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return "I"
    if m % 2 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return "II"
    return None


def hadamard_order(n: int) -> tuple[int, int] | None:
    """(m, 2^k) with n = m * 2^k and H_m buildable (Note [Hadamard orders]), the smallest such m; None if none."""
    if n < 1:
        return None
    p = n & -n  # the largest power of two dividing n
    odd = n // p
    m = odd
    while m <= n:
        if m == 1 or _paley_kind(m) is not None:
            return m, n // m
        m *= 2
    return None


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = Legendre symbol of (j - i) mod q: 0 on the diagonal, +1 for quadratic residues, -1 otherwise."""
    residues = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0] + [1 if a in residues else -1 for a in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q).reshape(1, q) - torch.arange(q).reshape(q, 1)) % q
    return chi[idx]


def _paley(m: int) -> torch.Tensor:
    kind = _paley_kind(m)
    q = m - 1 if kind == "I" else m // 2 - 1
    core = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    core[1:, 1:] = _jacobsthal(q)
    core[0, 1:] = 1
    if kind == "I":  # S = [[0, 1], [-1, Q]] is skew (Q is, for q = 3 mod 4) with S S^T = q I: H = I + S
        core[1:, 0] = -1
        return torch.eye(m, dtype=torch.float64) + core
    # q = 1 mod 4: C = [[0, 1], [1, Q]] is a symmetric conference matrix (C C^T = q I); H = C (x) A + I (x) B
    core[1:, 0] = 1
    a = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    return torch.kron(core, a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)


def hadamard_matrix(n: int) -> torch.Tensor:
    """The +-1 Hadamard matrix of order n (float64, H H^T = n I) that ``hadamard_transform`` applies: H_m (x) H_2^k.
    ValueError when n has no order built here (Note [Hadamard orders])."""
    order = hadamard_order(n)
    if order is None:
        raise ValueError(f"no Hadamard matrix of order {n} is built here: orders are m * 2^k with m = 1, q + 1 "
                         f"(q prime = 3 mod 4) or 2 (q + 1) (q prime = 1 mod 4)")
    m, p = order
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < p:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h if m == 1 else torch.kron(_paley(m), h)


def hadamard_transform(x: torch.Tensor, small: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ hadamard_matrix(n) / sqrt(n)`` along the last dim n, without building the n x n matrix.

    Args:
        x: (..., n) float tensor.
        small: H_m (m, m) in x's dtype and device, when n's order has m > 1 (``hadamard_order``); callers that
            apply the transform on every forward pass keep it (``rotate_``'s online rotations).
    """
    n = x.shape[-1]
    order = hadamard_order(n)
    if order is None:
        raise ValueError(f"hadamard_transform: no Hadamard matrix of order {n} (Note [Hadamard orders])")
    m, p = order
    if m == 1:
        return fwht(x)
    if small is None:
        small = _paley(m).to(x.dtype).to(x.device)
    y = fwht(x.reshape(*x.shape[:-1], m, p))
    # H_m (x) H_p: feature (a, b) -> (c, d) with weight H_m[a, c] H_p[b, d]; fwht did the H_p part
    return (small.transpose(0, 1) @ y / math.sqrt(m)).reshape(x.shape)
