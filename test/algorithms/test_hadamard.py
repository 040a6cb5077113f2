"""Hadamard matrices and transforms (torchqkit/algorithms/hadamard.py) and the orthogonal matrices rotate_ uses."""
import math

import pytest
import torch

from torchqkit.algorithms.hadamard import fwht, hadamard_matrix, hadamard_order, hadamard_transform
from torchqkit.algorithms.rotation import orthogonal_matrix


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h


@pytest.mark.parametrize("n", [1, 2, 8, 64, 512])
def test_fwht_is_the_product_with_sylvesters_matrix(n):
    x = torch.randn(3, 5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    torch.testing.assert_close(fwht(x), x @ _sylvester(n) / math.sqrt(n), rtol=0, atol=1e-12)
    y = fwht(x.float())
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), x @ _sylvester(n) / math.sqrt(n), rtol=0, atol=1e-5)


def test_fwht_is_its_own_inverse_and_keeps_lengths():
    x = torch.randn(4, 256, dtype=torch.float64)
    torch.testing.assert_close(fwht(fwht(x)), x, rtol=0, atol=1e-12)
    torch.testing.assert_close(fwht(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)


# n -> (m, 2^k): SmolLM2-135M (576, 1536), SmolLM2-360M (960, 2560), Paley I (12, 44), Paley II (36, 108), and
# Llama-2-7B's MLP width (11008 = 5504 * 2: 5503 is a prime = 3 mod 4)
ORDERS = {1: (1, 1), 64: (1, 64), 12: (12, 1), 44: (44, 1), 36: (36, 1), 108: (108, 1), 576: (36, 16),
          1536: (12, 128), 960: (60, 16), 2560: (20, 128), 11008: (5504, 2)}


def test_hadamard_orders():
    assert {n: hadamard_order(n) for n in ORDERS} == ORDERS
    assert [n for n in (6, 10, 42, 172, 0) if hadamard_order(n) is None] == [6, 10, 42, 172, 0]


@pytest.mark.parametrize("n", [12, 20, 36, 44, 108, 576, 960, 1536])
def test_hadamard_matrices_are_hadamard(n):
    h = hadamard_matrix(n)
    assert h.shape == (n, n) and set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


@pytest.mark.parametrize("n", [12, 36, 576, 1536, 2560])
def test_hadamard_transform_is_the_product_with_the_matrix(n):
    x = torch.randn(2, 3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(hadamard_transform(x), x @ hadamard_matrix(n) / math.sqrt(n), rtol=0, atol=1e-12)


def test_hadamard_transform_compiles_to_the_same_values():
    torch._dynamo.reset()
    x = torch.randn(4, 576)
    compiled = torch.compile(hadamard_transform, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), hadamard_transform(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind,n,what", [("hadamard", 64, "randomized hadamard"), ("hadamard", 576, "randomized "
                                         "hadamard"), ("hadamard", 42, "random orthogonal"),
                                        ("random", 64, "random orthogonal")])
def test_orthogonal_matrices(kind, n, what):
    q, got = orthogonal_matrix(n, kind, torch.Generator().manual_seed(0))
    assert got == what
    torch.testing.assert_close(q @ q.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    again, _ = orthogonal_matrix(n, kind, torch.Generator().manual_seed(0))
    assert torch.equal(q, again)  # the seed decides it
    if what == "randomized hadamard":  # +-1 / sqrt(n) everywhere: every feature spread evenly
        assert torch.allclose(q.abs(), torch.full_like(q, 1 / math.sqrt(n)))


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="power of two, got 12"):
        fwht(torch.zeros(2, 12))
    with pytest.raises(ValueError, match="order 42"):
        hadamard_matrix(42)
    with pytest.raises(ValueError, match="order 42"):
        hadamard_transform(torch.zeros(1, 42))
