"""A quantized expert stack (E, N, K): views, dequantize, and the ops MoE code calls, against the float reference
(dequantize, then the float op). Kernel vs reference on the same codes: the same 2-d kernels as a Linear, so the
tolerance is theirs: 2e-5 absolute on outputs of magnitude ~10 (float32 accumulation in another order)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.api.expert_weights import quantize_experts
from torchqkit.tensor.expert_selection import ExpertSelection
from torchqkit.tensor.experts import stack_experts

E, N, K = 4, 40, 96  # N not a multiple of the int4 tile (8 rows: 40 is), K = 3 groups of 32
ATOL = 2e-5

CONFIGS = {
    "int4": qk.Int4WeightOnlyConfig(group_size=32),
    "int8": qk.Int8WeightOnlyConfig(),
    "nf4": qk.NF4WeightOnlyConfig(),
    "int3": qk.IntxWeightOnlyConfig(bits=3),
    "float8": qk.Float8WeightOnlyConfig(),
}


@pytest.fixture(scope="module")
def weight():
    torch.manual_seed(0)
    return torch.randn(E, N, K)


def _inner(w):
    return [t for t in w.inner_tensors().values() if t is not None]


@pytest.mark.parametrize("name", CONFIGS)
def test_select_is_a_view_and_dequantizes_like_the_expert(weight, name):
    config = CONFIGS[name]
    stack = quantize_experts(config, weight, "experts")
    assert stack.shape == (E, N, K) and stack.block_size[0] == 1
    for e in (0, E - 1):
        view = stack[e]
        assert isinstance(view, qk.AffineQuantizedTensor) and view.shape == (N, K)
        for t, s in zip(_inner(view), _inner(stack)):
            assert t.data_ptr() == s[e].data_ptr() and t.is_contiguous()  # no copy; what the 2-d kernels read
        alone = qk.api.configs.base.handler_for(config)(config, weight[e], "w")
        assert torch.equal(view.dequantize(), alone.dequantize())
        assert torch.equal(stack.dequantize()[e], alone.dequantize())
    assert stack.packed_nbytes() == E * stack[0].packed_nbytes()


@pytest.mark.parametrize("name", CONFIGS)
def test_a_range_of_experts_is_a_stack_of_views(weight, name):
    """w[a:b]: whole experts (what an expert-parallel rank keeps), views of the stack's packed tensors."""
    stack = quantize_experts(CONFIGS[name], weight, "experts")
    part = stack[1:3]
    assert isinstance(part, qk.AffineQuantizedTensor) and part.shape == (2, N, K) and part.is_experts
    for t, s in zip(_inner(part), _inner(stack)):
        assert t.data_ptr() == s[1].data_ptr() and t.is_contiguous()
    assert torch.equal(part.dequantize(), stack.dequantize()[1:3])
    assert stack[3:].shape == (1, N, K) and stack[:0].shape == (0, N, K)
    with pytest.raises(IndexError, match=r"only a range of whole experts \(dim 0, step 1\)"):
        stack[0:4:2]
    with pytest.raises(IndexError, match=r"slice\(dim=1, step=1\) of a quantized expert stack"):
        stack[:, :8]


@pytest.mark.parametrize("name", CONFIGS)
def test_linear_on_an_expert_runs_its_layout_kernel(weight, name):
    stack = quantize_experts(CONFIGS[name], weight, "experts")
    x = torch.randn(3, K)
    torch.testing.assert_close(F.linear(x, stack[2]), F.linear(x, stack.dequantize()[2]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", CONFIGS)
def test_grouped_mm_skips_empty_groups(weight, name):
    stack = quantize_experts(CONFIGS[name], weight, "experts")
    w = stack.dequantize()
    x = torch.randn(7, K)
    offs = torch.tensor([2, 2, 7, 7], dtype=torch.int32)  # experts 1 and 3 get no tokens
    out = torch._grouped_mm(x, stack.transpose(-2, -1), offs=offs)
    ref = torch.cat([x[:2] @ w[0].T, x[2:7] @ w[2].T])
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(F.grouped_mm(x, stack.transpose(-2, -1), offs=offs), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", CONFIGS)
def test_grouped_mm_reads_only_routed_experts(weight, name):
    """Every floating tensor of experts 0-2 set to NaN: a path that read them (the grouped C++ op or the per-expert
    loop, whichever serves the format) would put NaN in the output of the one token routed to expert 3."""
    stack = quantize_experts(CONFIGS[name], weight, "experts")
    ref = F.linear(x := torch.randn(1, K), stack.dequantize()[3])
    poisoned = [t for t in _inner(stack) if t.is_floating_point() and t.dim() >= 1 and t.shape[0] == E]
    assert poisoned, name
    for t in poisoned:
        t[:3] = float("nan")
    out = torch._grouped_mm(x, stack.transpose(-2, -1), offs=torch.tensor([0, 0, 0, 1]))
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["int4", "nf4"])
def test_index_by_expert_ids_and_bmm(weight, name):
    stack = quantize_experts(CONFIGS[name], weight, "experts")
    w = stack.dequantize()
    ids = torch.tensor([3, 1, 3])
    chosen = stack[ids]  # no packed byte copied: the stack and the ids
    assert isinstance(chosen, ExpertSelection) and chosen.stack is stack and torch.equal(chosen.ids, ids)
    assert chosen.shape == (3, N, K) and torch.equal(chosen.dequantize(), w[ids])
    x = torch.randn(3, K)
    out = torch.bmm(chosen, x.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, torch.bmm(w[ids], x.unsqueeze(-1)).squeeze(-1), atol=ATOL, rtol=0)
    out_t = torch.bmm(x.unsqueeze(1), chosen.transpose(-2, -1)).squeeze(1)  # experts stored (E, K, N)
    torch.testing.assert_close(out_t, out, atol=ATOL, rtol=0)
    one = stack[torch.tensor(2)]
    assert one.shape == (N, K) and torch.equal(one.dequantize(), w[2])


def test_batched_mm_reads_each_routed_expert_once(weight, monkeypatch):
    """The per-expert loop (what a format without a grouped op, or KernelPreference.REFERENCE, runs): one 2-d linear
    per routed expert, with all its rows."""
    stack = quantize_experts(CONFIGS["nf4"], weight, "experts").with_changes(kernel_preference="reference")
    seen = []
    real = qk.AffineQuantizedTensor.linear
    monkeypatch.setattr(qk.AffineQuantizedTensor, "linear",
                        lambda self, x, bias=None: seen.append((self.qdata.data_ptr(), x.shape[0])) or real(self, x, bias))
    torch.bmm(stack[torch.tensor([2, 0, 2, 2])], torch.randn(4, K, 1))
    assert seen == [(stack.qdata[0].data_ptr(), 1), (stack.qdata[2].data_ptr(), 3)]


def test_grouped_linear_opcheck(weight):
    stack = quantize_experts(CONFIGS["int8"], weight, "experts")
    from torchqkit.tensor.grouped_linear import _grouped_linear_op, expert_spec
    tensors = [getattr(stack, n) for n in stack.qlayout.tensor_names]
    args = (torch.randn(5, K), torch.tensor([1, 1, 4, 5]), tensors, expert_spec(stack))
    torch.library.opcheck(_grouped_linear_op, args)


def test_ops_a_stack_refuses(weight):
    stack = quantize_experts(CONFIGS["int8"], weight, "experts")
    with pytest.raises(RuntimeError, match="stack of 4 experts"):
        F.linear(torch.randn(2, K), stack)
    with pytest.raises(IndexError, match="only dim 0"):
        stack.select(1, 0)
    with pytest.raises(IndexError, match="index 4 is out of bounds"):
        stack[4]
    with pytest.raises(NotImplementedError, match="untransposed stack"):
        torch._grouped_mm(torch.randn(2, N), stack, offs=torch.tensor([0, 0, 0, 2]))
    with pytest.raises(RuntimeError, match="1-d integer tensor of 4 group ends"):
        torch._grouped_mm(torch.randn(2, K), stack.transpose(-2, -1), offs=torch.tensor([2]))
    with pytest.raises(qk.UnsupportedOpError, match="stack of experts"):
        torch.sin(stack)


def test_stack_refuses_mixed_formats(weight):
    a = qk.quantize_weight(weight[0], qk.qdtypes.int8, qk.PerRow(), qk.PlainLayout())
    b = qk.quantize_weight(weight[1], qk.qdtypes.int8, qk.PerGroup(32), qk.PlainLayout())
    with pytest.raises(ValueError, match=r"experts: expert 1 can't share one quantized stack .*block_size"):
        stack_experts([a, b], "experts")


def test_stack_survives_save_and_load(weight, tmp_path):
    stack = quantize_experts(CONFIGS["int4"], weight, "experts")
    torch.save({"w": stack}, tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt", weights_only=True)["w"]
    assert back.shape == (E, N, K) and torch.equal(back.dequantize(), stack.dequantize())
