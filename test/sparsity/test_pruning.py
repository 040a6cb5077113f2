"""The pruning algorithms on their own: exact N:M masks (magnitude), Wanda's metric on a hand example, and SparseGPT's
compensation beating magnitude pruning on one layer's output error, with and without int4 codes."""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk
from torchqkit.algorithms.nm_masks import fill_pruned, magnitude_scores, nm_prune_mask, wanda_scores
from torchqkit.algorithms.observers import InputStats
from torchqkit.algorithms.sparsegpt import sparsegpt
from torchqkit.api.calibration_grid import ConfigGrid

from ..common import one_torch_thread  # noqa: F401  (autouse)


def test_magnitude_mask_is_exactly_2_of_4_with_ties_to_the_lower_column():
    w = torch.tensor([[0.1, -0.9, 0.5, 0.2, 3.0, 3.0, 3.0, -3.0],
                      [1.0, 2.0, -3.0, 4.0, 0.0, 0.0, 0.0, 0.0]])
    mask = nm_prune_mask(magnitude_scores(w), 2, 4)
    assert mask.tolist() == [[False, True, True, False, True, True, False, False],
                             [False, False, True, True, True, True, False, False]]


def test_a_partial_last_block_keeps_up_to_n_of_its_real_columns():
    w = torch.tensor([[5.0, 1.0, 2.0, 3.0, 0.5, -7.0]])  # K = 6: blocks [0..3], [4, 5] (+ 2 padding columns)
    assert nm_prune_mask(magnitude_scores(w), 2, 4).tolist() == [[True, False, False, True, True, True]]
    assert nm_prune_mask(magnitude_scores(w), 1, 4).tolist() == [[True, False, False, False, False, True]]


def test_an_already_sparse_weight_keeps_exactly_its_nonzeros():
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(16, 64, generator=g)
    keep = nm_prune_mask(torch.rand(16, 64, generator=g), 2, 4)
    keep[0, :4] = torch.tensor([False, False, True, False])  # a block with a single nonzero
    w = dense * keep
    mask = nm_prune_mask(magnitude_scores(w), 2, 4)
    assert torch.equal(w * mask, w) and (mask & (w == 0)).sum() == 1  # the extra kept entry is a zero


def test_wanda_scores_weights_by_the_input_norms():
    # |W| = [4, 3, 2, 1]; inputs x0 = (1, 0, 10, 0), x1 = (0, 1, 0, 10): ||X_col|| = (1, 1, 10, 10)
    w = torch.tensor([[4.0, -3.0, 2.0, -1.0]])
    stats = InputStats(4, 2)
    stats.add(torch.tensor([[1.0, 0.0, 10.0, 0.0], [0.0, 1.0, 0.0, 10.0]]))
    scores = wanda_scores(w, stats.sq_sum)
    assert scores.tolist() == [[4.0, 3.0, 20.0, 10.0]]
    assert nm_prune_mask(scores, 2, 4).tolist() == [[False, False, True, True]]  # magnitude would keep 0 and 1
    assert nm_prune_mask(magnitude_scores(w), 2, 4).tolist() == [[True, True, False, False]]


def test_fill_pruned_keeps_each_groups_range_to_its_kept_values():
    w = torch.tensor([[-9.0, 1.0, 2.0, 0.5, 3.0, 8.0, -1.0, 4.0]])
    mask = torch.tensor([[False, True, True, False, False, True, False, True]])
    assert fill_pruned(w * mask, mask, 4).tolist() == [[1.0, 1.0, 2.0, 1.0, 8.0, 8.0, 8.0, 4.0]]


def _layer(seed=0, rows=32, k=64, tokens=512):
    """A Linear's weight, inputs and their statistics. The inputs have correlated features and per-feature scales
    spread like an LLM's activations (log-normal): what Wanda's norms and SparseGPT's compensation exploit."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp(torch.randn(k, generator=g))
    x = torch.randn(tokens, k, generator=g) @ (torch.eye(k) + 0.5 * torch.randn(k, k, generator=g) / k ** 0.5) * scales
    w = torch.randn(rows, k, generator=g)
    stats = InputStats(k, tokens, hessian=True)
    stats.add(x)
    return w, x, stats


def _output_error(x, w, w_hat) -> float:
    return float((x @ w.t() - x @ w_hat.t()).norm() / (x @ w.t()).norm())


def test_sparsegpt_and_wanda_beat_magnitude_pruning_on_the_layer_output():
    w, x, stats = _layer()
    result = sparsegpt(w, stats.hessian.h, 2, 4, block=16)
    assert torch.equal(result.mask, result.weight != 0)  # random weights: no kept entry lands on 0.0 exactly
    assert (result.mask.reshape(32, 16, 4).sum(-1) == 2).all()
    magnitude = w * nm_prune_mask(magnitude_scores(w), 2, 4)
    wanda = w * nm_prune_mask(wanda_scores(w, stats.sq_sum), 2, 4)
    sgpt, wan, mag = (_output_error(x, w, v) for v in (result.weight, wanda, magnitude))
    # measured 0.094 (SparseGPT), 0.101 (Wanda), 0.507 (magnitude) on this layer
    assert sgpt < wan < 0.3 * mag, (sgpt, wan, mag)
    # the lazy block size changes the speed, not the result
    torch.testing.assert_close(sparsegpt(w, stats.hessian.h, 2, 4, block=128).weight, result.weight,
                               rtol=1e-4, atol=1e-4)


def test_sparsegpt_with_int4_beats_magnitude_and_round_to_nearest():
    w, x, stats = _layer(seed=1)
    base = qk.Int4WeightOnlyConfig(group_size=32, layout=qk.PlainLayout())
    result = sparsegpt(w, stats.hessian.h, 2, 4, ConfigGrid(base, w, "w"))
    deq = qk.dequantize_affine(result.codes.to(torch.uint8), qk.qdtypes.uint4, (1, 32), result.scale,
                               result.zero_point, zero_point_domain="float") * result.mask
    lin = torch.nn.Linear(64, 32, bias=False)
    lin.weight = torch.nn.Parameter(w, requires_grad=False)
    qk.quantize_(torch.nn.Sequential(lin), qk.SparsityConfig(base=base))  # magnitude + int4 round-to-nearest
    sgpt, mag = _output_error(x, w, deq), _output_error(x, w, lin.weight.dequantize())
    assert sgpt < 0.5 * mag, (sgpt, mag)  # measured 0.175 vs 0.389


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8)])
def test_sparsegpt_masks_are_exactly_n_of_m(n, m):
    w, _, stats = _layer(seed=2, k=72)  # K = 72: 4:8 ends with a full block, 2:4 too
    result = sparsegpt(w, stats.hessian.h, n, m)
    assert (result.mask.reshape(32, -1, m).sum(-1) == n).all()
    assert torch.equal(result.weight * ~result.mask, torch.zeros_like(result.weight))
