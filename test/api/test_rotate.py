"""rotate_ / RotationConfig: function-preserving QuaRot-style rotations of LLaMA-family models, before quantize_."""
import copy
import io

import pytest
import torch
import transformers

import torchqkit as qk
from torchqkit.algorithms.rotation import OnlineRotation, online_rotation_of

from ..eval.models import tiny_llama

IDS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def _relative(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tied,bias", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("config", [qk.RotationConfig(), qk.RotationConfig(kind="random", seed=3),
                                    qk.RotationConfig(online_down_proj=False, rotate_ov=False)],
                         ids=["hadamard", "random", "residual-only"])
def test_rotation_preserves_the_logits(tied, bias, config):
    model = tiny_llama(tied=tied, bias=bias)  # hidden 32, MLP 48 = 12 x 4, head_dim 8
    ref = _logits(model)
    report = qk.rotate_(model, config)
    # float64 rewrite, float32 weights: the only change is float32 rounding (measured about 2e-6)
    assert _relative(_logits(model), ref) < 1e-4
    assert report.layers == 2 and report.untied_lm_head is tied
    assert report.residual == ("randomized hadamard 32" if config.kind == "hadamard" else "random orthogonal 32")
    hooks = [online_rotation_of(layer.mlp.down_proj) for layer in model.model.layers]
    if config.online_down_proj:
        assert hooks[0] is hooks[1] and isinstance(hooks[0], OnlineRotation)
        assert report.down_proj.startswith("hadamard 48 (12 x 4)" if config.kind == "hadamard" else "random")
    else:
        assert hooks == [None, None] and report.down_proj == "none"
    norms = [m.weight for n, m in model.named_modules() if n.endswith("norm")]
    assert len(norms) == 5 and all(torch.equal(w, torch.ones_like(w)) for w in norms)  # folded into the Linears


def test_the_residual_is_rotated():
    model = tiny_llama(tied=False)
    embed = model.model.embed_tokens.weight.clone()
    qk.rotate_(model)
    new = model.model.embed_tokens.weight
    # each embedding row is turned (the same length, every feature changed): E Q with Q orthogonal
    torch.testing.assert_close(new.norm(dim=1), embed.norm(dim=1), rtol=1e-5, atol=0)
    assert (new - embed).abs().min(dim=1).values.gt(0).all()
    torch.testing.assert_close(new @ new.T, embed @ embed.T, rtol=1e-4, atol=1e-5)


def test_a_tied_lm_head_is_untied():
    model = tiny_llama(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    ref = _logits(model)
    report = qk.rotate_(model)
    assert _relative(_logits(model), ref) < 1e-4
    assert report.untied_lm_head
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings is False
    # the embedding holds E Q, the lm_head E diag(g) Q: different tensors
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    model.tie_weights()  # transformers doesn't tie them back
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_qwen3_with_head_norms_is_rotated():
    config = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    ref = _logits(model)
    qk.rotate_(model)
    assert _relative(_logits(model), ref) < 1e-4


def _outlier_llama():
    """A LLaMA whose norms amplify two features 50x: the Linears' inputs carry outlier channels, as LLMs' do."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 17]] = 50.0
    return model


@pytest.mark.parametrize("config,bound", [(qk.Int8DynamicActivationInt8WeightConfig(), 0.5),
                                          (qk.Int4DynamicActivationInt4WeightConfig(), 0.8)])
def test_rotation_makes_low_bit_activations_closer_to_float(config, bound):
    # Measured (relative logit error, lm_head float): int8 x int8 0.162 -> 0.068 rotated; int4 x int4 g32
    # 0.758 -> 0.556 (its int4 weights on this random model dominate what remains).
    model = _outlier_llama()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = _logits(model, ids)
    errors = []
    for rotate in (False, True):
        q = copy.deepcopy(model)
        if rotate:
            qk.rotate_(q)
        report = qk.quantize_(q, qk.ModuleConfigs({"lm_head": None, "_default": config}), strict=True)
        assert len(report.quantized) == 14
        errors.append(float((_logits(q, ids) - ref).norm() / ref.norm()))
    assert errors[1] < bound * errors[0], errors


def test_quantize_and_gptq_after_rotation_see_rotated_inputs():
    model = tiny_llama(tied=True)
    qk.rotate_(model)
    batches = [torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    config = qk.GPTQConfig(qk.Int4DynamicActivationInt4WeightConfig(group_size=16))
    report = qk.quantize_(model, qk.ModuleConfigs({"lm_head": None, "_default": config}), calibration_data=batches,
                          strict=True)
    assert len(report.quantized) == 14
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down.weight, qk.AffineQuantizedTensor) and online_rotation_of(down) is not None
    # the hook runs before the quantized linear: its input is the rotated activation
    seen = []
    down.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    x = torch.randn(1, 3, 48)
    down(x)
    torch.testing.assert_close(seen[0], online_rotation_of(down)(down, (x,))[0])


def test_a_rotated_model_pickles_with_its_online_rotations():
    model = tiny_llama()
    qk.rotate_(model)
    qk.quantize_(model, qk.ModuleConfigs({"lm_head": None, "_default": qk.Int4DynamicActivationInt4WeightConfig(
        group_size=16)}))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert online_rotation_of(loaded.model.layers[1].mlp.down_proj) is not None
    assert torch.equal(_logits(loaded), _logits(model))


def test_config_round_trips_and_checks_its_fields():
    config = qk.RotationConfig(kind="random", seed=7, online_down_proj=False, rotate_ov=False)
    assert config.to_dict() == {"type": "RotationConfig", "kind": "random", "seed": 7, "online_down_proj": False,
                                "rotate_ov": False}
    assert qk.RotationConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="kind must be one of"):
        qk.RotationConfig(kind="givens")
    with pytest.raises(ValueError, match="seed must be >= 0"):
        qk.RotationConfig(seed=-1)
    with pytest.raises(TypeError, match="online_down_proj must be True or False"):
        qk.RotationConfig(online_down_proj=1)
    with pytest.raises(TypeError, match="unknown fields"):
        qk.RotationConfig.from_dict({"type": "RotationConfig", "angle": 3})
    with pytest.raises(TypeError, match="expected a dict with type 'RotationConfig'"):
        qk.RotationConfig.from_dict(qk.Int4WeightOnlyConfig().to_dict())
    with pytest.raises(TypeError, match="config must be a RotationConfig"):
        qk.rotate_(tiny_llama(), qk.Int4WeightOnlyConfig())


def _bert():
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=48)
    return transformers.BertModel(config).eval()


def _gemma():
    config = transformers.GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.GemmaForCausalLM(config).eval()


def _quantized():
    model = tiny_llama()
    qk.quantize_(model, qk.Int8WeightOnlyConfig())
    return model


def _extra_parameter():
    model = tiny_llama()
    model.model.layers[0].mlp.register_parameter("gate_scale", torch.nn.Parameter(torch.ones(48)))
    return model


def _rotated():
    model = tiny_llama()
    qk.rotate_(model)
    return model


@pytest.mark.parametrize("build,message", [
    (_bert, "BertModel is not a LLaMA-family causal LM"),
    (_gemma, r"model.norm \(GemmaRMSNorm\) doesn't compute x / rms\(x\) \* weight"),
    (_quantized, "weight is AffineQuantizedTensor.*call rotate_ before quantize_"),
    (_extra_parameter, r"parameters outside the LLaMA layout.*model.layers.0.mlp.gate_scale"),
    (_rotated, "rotated already"),
], ids=["bert", "gemma", "quantized", "extra-parameter", "twice"])
def test_unsupported_models_are_refused_unchanged(build, message):
    model = build()
    before = _state(model)
    hooks = [len(m._forward_pre_hooks) for m in model.modules()]
    with pytest.raises(qk.RotationError, match=message) as info:
        qk.rotate_(model)
    assert "unchanged" in str(info.value)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        a, b = before[k], after[k]
        assert torch.equal(a.dequantize() if isinstance(a, qk.AffineQuantizedTensor) else a,
                           b.dequantize() if isinstance(b, qk.AffineQuantizedTensor) else b), k
    assert hooks == [len(m._forward_pre_hooks) for m in model.modules()]
