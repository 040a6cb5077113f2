"""GGUF metadata for save_gguf: the architecture keys llama.cpp builds the model from, and the tokenizer.

The keys are the ones llama.cpp's llama / qwen2 loaders read (``llama.context_length``, ``...head_count_kv``,
``...rope.freq_base``, ...), taken from the transformers config. Mistral models are written as ``llama`` (as
llama.cpp's own converter does: same tensors and rotary layout). The tokenizer is either carried over from a GGUF
file (every ``tokenizer.*`` key copied as it is) or built from a transformers tokenizer with gguf-py's vocabulary
readers (BPE and SentencePiece ``tokenizer.json`` files, merges and special token ids).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

__all__ = ["architecture_of", "add_architecture", "add_tokenizer", "tokenizer_source", "TokenizerSource"]

# transformers model_type -> the GGUF architecture written
# (Mixtral is ``llama`` with expert keys, as llama.cpp's converter writes it: Note [GGUF expert tensors]).
_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3_moe": "qwen3moe", "mixtral": "llama"}


def architecture_of(config, error) -> str:
    arch = _ARCHITECTURES.get(getattr(config, "model_type", None))
    if arch is None:
        raise error(f"torchqkit.save_gguf: model_type {getattr(config, 'model_type', None)!r} has no GGUF export "
                    f"(supported: {', '.join(sorted(_ARCHITECTURES))})")
    return arch


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return params
    return {"rope_theta": getattr(config, "rope_theta", 10000.0), "rope_type": "default",
            **(getattr(config, "rope_scaling", None) or {})}


def add_architecture(writer, config, arch: str, error) -> None:
    """The hyperparameters llama.cpp reads for ``arch``, from a transformers config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(heads))
    writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or heads))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))
    writer.add_rope_dimension_count(int(head_dim))
    if head_dim * heads != config.hidden_size:
        writer.add_key_length(int(head_dim))
        writer.add_value_length(int(head_dim))
    _add_experts(writer, config, arch, error)
    rope = _rope_parameters(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "linear":
        import gguf
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind not in ("default", None):
        raise error(f"torchqkit.save_gguf: rope type {kind!r} of the model's config is not exported (default and "
                    f"linear rope are); the file would compute other positions than the model")
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        raise error(f"torchqkit.save_gguf: the model attends within a sliding window of {window} tokens, which "
                    f"llama.cpp's {arch} architecture doesn't do; set config.sliding_window = None first if the "
                    f"model is only used on contexts up to {window} tokens")


def _add_experts(writer, config, arch: str, error) -> None:
    """Expert count, experts per token and (qwen3moe) the expert width. llama.cpp's qwen3moe and llama (Mixtral)
    graphs always renormalize the top-k routing weights and put every layer's MLP through the experts, so a config
    that does otherwise is refused: the file would compute other outputs than the model."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not experts:
        return
    name = config.model_type
    if not getattr(config, "norm_topk_prob", True):
        raise error(f"torchqkit.save_gguf: the {name} model's config has norm_topk_prob=False, but llama.cpp's "
                    f"{arch} graph always renormalizes the top-{config.num_experts_per_tok} routing weights; the file "
                    f"would compute other logits than the model")
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
        raise error(f"torchqkit.save_gguf: the {name} model has dense MLP layers between its MoE layers "
                    f"(mlp_only_layers / decoder_sparse_step), which llama.cpp's {arch} architecture doesn't have")
    writer.add_expert_count(int(experts))
    writer.add_expert_used_count(int(config.num_experts_per_tok))
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(int(config.moe_intermediate_size))


class TokenizerSource:
    """Where the tokenizer comes from: ``gguf`` (a path whose ``tokenizer.*`` keys are copied) or ``hf`` (a
    transformers tokenizer)."""

    def __init__(self, gguf_path: Path | None = None, hf=None):
        self.gguf_path, self.hf = gguf_path, hf
        self.reader = None
        if gguf_path is not None:  # read now: a bad path fails before any tensor is encoded
            from .gguf import open_gguf_reader
            self.reader = open_gguf_reader(gguf_path)

    def describe(self) -> str:
        if self.gguf_path is not None:
            return f"tokenizer copied from {self.gguf_path.name}"
        return f"tokenizer from {type(self.hf).__name__}"


def tokenizer_source(tokenizer, model, error) -> TokenizerSource:
    if tokenizer is None:
        origin = getattr(model, "torchqkit_gguf_source", None)
        if origin is None:
            raise error("torchqkit.save_gguf: no tokenizer: pass tokenizer= (a transformers tokenizer, or the path "
                        "of a .gguf file to copy it from); llama.cpp can't load a model file without one")
        return TokenizerSource(gguf_path=Path(origin))
    if isinstance(tokenizer, (str, Path)):
        return TokenizerSource(gguf_path=Path(tokenizer))
    if not hasattr(tokenizer, "save_pretrained"):
        raise error(f"torchqkit.save_gguf: tokenizer must be a transformers tokenizer or the path of a .gguf file, "
                    f"got {type(tokenizer).__name__}")
    return TokenizerSource(hf=tokenizer)


def add_tokenizer(writer, source: TokenizerSource, vocab_size: int, error) -> int:
    """Write the tokenizer keys; returns the number of tokens."""
    if source.reader is not None:
        return _copy_gguf_tokenizer(writer, source.reader, source.gguf_path, error)
    return _hf_tokenizer(writer, source.hf, vocab_size, error)


def _copy_gguf_tokenizer(writer, reader, path: Path, error) -> int:
    import gguf
    count = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            values = [_scalar(field.parts[i], sub) for i in field.data]
            writer.add_array(key, values)
            if key == "tokenizer.ggml.tokens":
                count = len(values)
        else:
            writer.add_key_value(key, _scalar(field.parts[field.data[0]], vtype), vtype)
    if count == 0:
        raise error(f"torchqkit.save_gguf: {path} has no tokenizer.ggml.tokens to copy the tokenizer from")
    return count


def _scalar(part: np.ndarray, vtype):
    import gguf
    if vtype == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    value = part.tolist()[0]
    return bool(value) if vtype == gguf.GGUFValueType.BOOL else value


def _hf_tokenizer(writer, tokenizer, vocab_size: int, error) -> int:
    """gguf-py's readers of a saved tokenizer folder: BPE (tokenizer.json with merges) or SentencePiece."""
    import gguf
    from gguf.vocab import BpeVocab, LlamaHfVocab, SpecialVocab
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        try:
            vocab, model = BpeVocab(Path(folder)), "gpt2"
        except (FileNotFoundError, TypeError, KeyError, ValueError):
            try:
                vocab, model = LlamaHfVocab(Path(folder)), "llama"
            except (FileNotFoundError, TypeError, KeyError, ValueError) as e:
                raise error(f"torchqkit.save_gguf: {type(tokenizer).__name__} is neither a BPE nor a SentencePiece "
                            f"tokenizer gguf-py can read ({type(e).__name__}: {e}); pass tokenizer= the path of a "
                            f".gguf file with the right tokenizer instead") from None
        tokens, scores, types = [], [], []
        for text, score, ttype in vocab.all_tokens():
            tokens.append(text)
            scores.append(score)
            types.append(ttype)
        if len(tokens) > vocab_size:
            raise error(f"torchqkit.save_gguf: the tokenizer has {len(tokens)} tokens but the model's embedding only "
                        f"{vocab_size} rows")
        while len(tokens) < vocab_size:  # llama.cpp wants one token per embedding row
            tokens.append(f"[PAD{len(tokens)}]".encode())
            scores.append(-1000.0)
            types.append(gguf.TokenType.UNUSED)
        writer.add_tokenizer_model(model)
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        SpecialVocab(Path(folder), load_merges=model == "gpt2", n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    return len(tokens)
