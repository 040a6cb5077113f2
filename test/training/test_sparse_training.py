"""prepare_sparse_ / convert_sparse_: N:M masks on a schedule, straight-through gradients with SR-STE's decay, a
small LLaMA trained sparse within a few percent of dense (and better than pruning the dense one), conversion to
NMSparseLayout with the same logits, bad input leaving the model unchanged."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchqkit as qk

transformers = pytest.importorskip("transformers")


def _llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


def _batches(count, seed):
    # 70% of the tokens follow t -> 3 t + 7 (mod 64), the rest are random: a loss floor well above 0
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randint(0, 64, (8, 33), generator=g)
        keep = torch.rand(8, 33, generator=g) < 0.7
        for t in range(1, 33):
            x[:, t] = torch.where(keep[:, t], (3 * x[:, t - 1] + 7) % 64, x[:, t])
        out.append(x)
    return out


DATA, HELD_OUT = _batches(40, 1), _batches(4, 2)


def _held_out_loss(model):
    model.eval()
    with torch.no_grad():
        return sum(float(model(input_ids=ids, labels=ids).loss) for ids in HELD_OUT) / len(HELD_OUT)


def _train(model, steps=80):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for i in range(steps):
        ids = DATA[i % len(DATA)]
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return _held_out_loss(model)


def _assert_nm(weight, n, m):
    blocks = (weight != 0).reshape(weight.shape[0], -1, m).sum(-1)
    assert int(blocks.max()) <= n


def test_sparse_training_reaches_dense_loss_and_beats_pruning_after_training():
    base = _llama()
    dense = copy.deepcopy(base)
    dense_loss = _train(dense)
    pruned = copy.deepcopy(dense)
    qk.quantize_(pruned, qk.SparsityConfig(pattern=(2, 4)))
    pruned_loss = _held_out_loss(pruned)
    sparse = copy.deepcopy(base)
    names = qk.prepare_sparse_(sparse, qk.SparsityConfig(pattern=(2, 4)), start_step=20, update_every=10, decay=2e-4)
    assert len(names) == 2 * 7 + 1  # every Linear, lm_head included (not tied here)
    sparse_loss = _train(sparse)
    # measured: dense 1.954, magnitude-pruned after training 2.082 (+6.5%), trained sparse 1.959 (+0.2%)
    assert sparse_loss <= 1.03 * dense_loss, (sparse_loss, dense_loss)
    assert sparse_loss < pruned_loss - 0.05, (sparse_loss, pruned_loss)
    for module in sparse.modules():
        if isinstance(module, qk.SparseTrainingLinear):
            _assert_nm(module.weight * module.sparse.mask, 2, 4)
    ids = HELD_OUT[0]
    with torch.no_grad():
        before = sparse(input_ids=ids).logits
    report = qk.convert_sparse_(sparse)
    assert len(report.quantized) == 15 and not report.skipped
    assert not any(isinstance(m, qk.SparseTrainingLinear) for m in sparse.modules())
    up = sparse.model.layers[0].mlp.up_proj
    assert type(up) is nn.Linear and isinstance(up.weight.qlayout, qk.NMSparseLayout)
    with torch.no_grad():
        assert torch.equal(sparse(input_ids=ids).logits, before)  # float values: the masked weights exactly


def test_masks_follow_the_schedule_and_gradients_pass_straight_through():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    qk.prepare_sparse_(model, qk.SparsityConfig(pattern=(2, 4)), start_step=2, update_every=3, decay=0.5)
    layer = model[0]
    x = torch.randn(5, 16)
    updates = []
    for step in range(8):
        model(x).sum().backward()
        updates.append(layer.sparse.updated_at)
    # dense for steps 0 and 1; masks computed at steps 2 and 5
    assert updates == [-1, -1, 2, 2, 2, 5, 5, 5]
    with torch.no_grad():
        model.eval()
        model(x)  # evaluation forwards don't count
    assert layer.sparse.schedule.step == 7
    assert torch.equal(layer.sparse.mask, qk.training.sparse_training.magnitude_nm_mask(layer.weight, 2, 4))
    _assert_nm(layer.weight * layer.sparse.mask, 2, 4)


@pytest.mark.parametrize("decay", [0.0, 0.5])
def test_straight_through_gradient_with_sr_ste_decay(decay):
    # W's gradient is the gradient with respect to the masked weight W * E at every entry (pruned ones included),
    # plus decay * W at the pruned entries
    torch.manual_seed(1)
    layer = nn.Linear(8, 3, bias=False)
    model = nn.Sequential(layer)
    qk.prepare_sparse_(model, qk.SparsityConfig(pattern=(2, 4)), start_step=0, update_every=100, decay=decay)
    x = torch.randn(4, 8)
    model(x).pow(2).sum().backward()
    mask = layer.sparse.mask
    masked = layer.weight.detach() * mask
    grad_of_product = (2 * (x @ masked.t())).t() @ x  # d/d(W E) of sum((x (W E)^T)^2)
    expected = grad_of_product + decay * (~mask) * layer.weight.detach()
    torch.testing.assert_close(layer.weight.grad, expected)
    assert (layer.weight.grad[~mask] != 0).all()  # pruned weights keep learning


def test_bad_input_leaves_the_model_unchanged():
    model = nn.Sequential(nn.Linear(16, 8))
    with pytest.raises(TypeError, match="prepare_sparse_ takes a SparsityConfig"):
        qk.prepare_sparse_(model, qk.Int8WeightOnlyConfig())
    with pytest.raises(ValueError, match="method='magnitude'"):
        qk.prepare_sparse_(model, qk.SparsityConfig(method="wanda"))
    with pytest.raises(ValueError, match="update_every must be an int >= 1"):
        qk.prepare_sparse_(model, qk.SparsityConfig(), update_every=0)
    with pytest.raises(ValueError, match="no Linear layer was selected"):
        qk.prepare_sparse_(model, qk.SparsityConfig(), filter_fn=lambda m, n: False)
    assert type(model[0]) is nn.Linear
    with pytest.raises(ValueError, match="no layer of this model was prepared"):
        qk.convert_sparse_(model)
    quantized = nn.Sequential(nn.Linear(16, 8))
    qk.quantize_(quantized, qk.Int8WeightOnlyConfig())
    with pytest.raises(ValueError, match=r"0.weight is quantized"):
        qk.prepare_sparse_(quantized, qk.SparsityConfig())
    qk.prepare_sparse_(model, qk.SparsityConfig())
    with pytest.raises(ValueError, match="0 is sparse-prepared already"):
        qk.prepare_sparse_(model, qk.SparsityConfig())
    tied = nn.ModuleDict({"embed": nn.Embedding(10, 16), "head": nn.Linear(16, 10, bias=False),
                          "mid": nn.Linear(16, 16)})
    tied.head.weight = tied.embed.weight
    assert qk.prepare_sparse_(copy.deepcopy(tied), qk.SparsityConfig()) == ["mid"]  # the tied head stays dense
    with pytest.raises(ValueError, match="head.weight is shared with an nn.Embedding"):
        qk.prepare_sparse_(tied, qk.SparsityConfig(), filter_fn=lambda m, n: True)
    assert type(tied.mid) is nn.Linear


def test_convert_with_an_int8_base_and_a_padded_in_features():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(70, 12))  # 70 = 17 blocks of 4 and 2 columns of padding
    qk.prepare_sparse_(model, qk.SparsityConfig(pattern=(2, 4), base=qk.Int8WeightOnlyConfig()), start_step=0)
    x = torch.randn(3, 70)
    model(x).sum().backward()
    masked = model[0].weight.detach() * model[0].sparse.mask
    report = qk.convert_sparse_(model)
    assert report["0"].status == "quantized"
    w = model[0].weight
    assert isinstance(w.qlayout, qk.NMSparseLayout)
    assert torch.equal(w.dequantize() != 0, masked != 0)
    torch.testing.assert_close(w.dequantize(), masked, rtol=0, atol=float(masked.abs().max()) / 127)


def test_sparse_and_quantization_aware_training_converts_bit_for_bit(monkeypatch):
    """prepare_sparse_ then prepare_qat_ with the same base: the forward uses the masked weight fake-quantized as
    NMSparseLayout will store it (pruned entries exactly 0), and convert_sparse_ stores weights that dequantize to
    the last training forward's weights bit for bit (logits equal up to the kernel's summation order)."""
    from types import SimpleNamespace

    from torchqkit.training import sparse_training

    base = qk.Int4WeightOnlyConfig(group_size=32)
    model = _llama(5)
    qk.prepare_sparse_(model, qk.SparsityConfig(pattern=(2, 4), base=base), start_step=3, update_every=5)
    report = qk.prepare_qat_(model, qk.QATConfig(base))
    prepared = {n: m for n, m in model.named_modules() if isinstance(m, qk.SparseTrainingLinear)}
    assert sorted(e.fqn for e in report.quantized) == sorted(prepared)
    loss = _train(model, steps=12)
    assert loss < 3.5  # trained: the held-out loss starts near ln(64) = 4.16
    used = []  # the weights the prepared layers' forwards hand to F.linear, in call order
    real_linear = torch.nn.functional.linear

    def capturing(x, weight, bias=None):
        used.append(weight.detach().clone())
        return real_linear(x, weight, bias)

    monkeypatch.setattr(sparse_training, "F", SimpleNamespace(linear=capturing, pad=torch.nn.functional.pad))
    layer_weights = {}
    for name, m in prepared.items():
        m.register_forward_hook(lambda mod, args, out, name=name: layer_weights.update({name: used[-1]}))
    ids = HELD_OUT[0]
    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    monkeypatch.undo()
    for name, w in layer_weights.items():
        _assert_nm(w, 2, 4)
    with pytest.raises(ValueError, match="train sparse and quantization-aware.*convert_sparse_"):
        qk.convert_qat_(model)
    qk.convert_sparse_(model)
    for name, w in layer_weights.items():
        stored = model.get_submodule(name).weight
        assert isinstance(stored.qlayout, qk.NMSparseLayout) and stored.qdtype.name == "uint4", name
        assert torch.equal(stored.dequantize(), w), name
    with torch.no_grad():
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-4)


def test_sparse_qat_gradient_reaches_pruned_entries_and_bad_combinations_are_refused():
    base = qk.Int8WeightOnlyConfig()
    lin = nn.Sequential(nn.Linear(8, 4, bias=False))
    with torch.no_grad():
        lin[0].weight.copy_(torch.arange(32, dtype=torch.float32).reshape(4, 8) - 15.5)
    qk.prepare_sparse_(lin, qk.SparsityConfig(pattern=(2, 4), base=base), start_step=0, update_every=100)
    with pytest.raises(ValueError, match=r"QATConfig\(.*\) differs from the base the sparse layers will be stored with"):
        qk.prepare_qat_(lin, qk.QATConfig(qk.Int4WeightOnlyConfig(group_size=32)))
    assert lin[0].sparse.quantizer is None  # unchanged
    qk.prepare_qat_(lin, qk.QATConfig(base))
    lin.train()
    x = torch.randn(3, 8)
    lin(x).sum().backward()
    grad = lin[0].weight.grad
    assert (grad != 0).all()  # straight-through at every entry, pruned ones included
    torch.testing.assert_close(grad, x.sum(0).expand(4, 8), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="already prepared for quantization-aware training"):
        qk.prepare_qat_(lin, qk.QATConfig(base))
    floaty = nn.Sequential(nn.Linear(8, 4))
    qk.prepare_sparse_(floaty, qk.SparsityConfig(pattern=(2, 4)))
    with pytest.raises(ValueError, match=r"SparsityConfig\(base=None\): its kept values stay float"):
        qk.prepare_qat_(floaty, qk.QATConfig(base))
    qat_first = nn.Sequential(nn.Linear(8, 4))
    qk.prepare_qat_(qat_first, qk.QATConfig(base))
    with pytest.raises(ValueError, match="is QAT-prepared; to train sparse and quantization-aware, start from the "
                                         "float model: prepare_sparse_"):
        qk.prepare_sparse_(qat_first, qk.SparsityConfig(pattern=(2, 4), base=base))


def test_sparse_qat_fake_quantizes_the_activations_of_a_dynamic_activation_base():
    base = qk.Int8DynamicActivationInt8WeightConfig()
    lin = nn.Sequential(nn.Linear(16, 8, bias=False))
    qk.prepare_sparse_(lin, qk.SparsityConfig(pattern=(2, 4), base=base), start_step=0, update_every=100)
    qk.prepare_qat_(lin, qk.QATConfig(base))
    lin.train()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    y = lin(x).detach()
    qk.convert_sparse_(lin)
    lin.eval()
    with torch.no_grad():
        converted = lin(x)
    # the converted layer rounds its activations to int8 per token: the trained forward did the same
    torch.testing.assert_close(converted, y, rtol=0, atol=1e-5)
