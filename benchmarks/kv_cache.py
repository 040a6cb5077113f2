"""python -m benchmarks.kv_cache: what a quantized KV cache costs SmolLM2-135M, next to transformers' QuantizedCache.

Perplexity of the float32 model (SmolLM2-135M's GGUF dequantized; the KV cache is what is quantized, the weights stay
float) on the first --tokens tokens of the text torchqkit ships, scored token by token through the cache
(torchqkit.eval.cached_perplexity: every token is predicted by a one-token forward that reads all earlier positions
from the cache), and the cache's bytes per cached position (exact arithmetic: codes + float16 scales and zero points)
against a float32 cache. Peers, where installed in this Python: transformers' QuantizedCache with the quanto (int4)
and HQQ (int4, int8) backends, at transformers' defaults (per-token groups of 64 along the head dim, residual 128).
Writes a markdown table (--out, rewritten after every row so a long run keeps what it measured) and prints it.
A script of its own, not a group of the `python -m benchmarks` runner: its rows are perplexities through caches, not
the runner's per-config records.

Decode speed with a long cached context is python -m benchmarks.kv_cache_speed (prefill excluded, llama.cpp beside)."""
from __future__ import annotations

import argparse
import sys
import traceback

import torch

import torchqkit as qk
from torchqkit.eval import cached_perplexity, eval_text, load_gguf, smollm2_gguf_path

CONFIGS = {  # row name -> KVCacheConfig
    "int8 per token g64": qk.KVCacheConfig("int8"),
    "int8 per-channel keys g64, per-token values g64": qk.KVCacheConfig("int8", key_granularity="channel"),
    "int4 per-channel keys g64, per-token values g64": qk.KVCacheConfig("int4", key_granularity="channel"),
    "int4 per-channel keys g64, per-token values g32": qk.KVCacheConfig("int4", key_granularity="channel",
                                                                       value_group_size=32),
    "int4 per-channel keys g64, per-token values g16": qk.KVCacheConfig("int4", key_granularity="channel",
                                                                       value_group_size=16),
    "int4 per-channel keys g64, per-token values g64, residual 128": qk.KVCacheConfig(
        "int4", key_granularity="channel", residual_length=128),
    "int8 per-channel keys g64, per-token values g64, residual 128": qk.KVCacheConfig(
        "int8", key_granularity="channel", residual_length=128),
    "float8_e4m3fn per token g64": qk.KVCacheConfig("float8_e4m3fn"),
    "float8_e4m3fn per-channel keys g64, per-token values g64": qk.KVCacheConfig("float8_e4m3fn",
                                                                                 key_granularity="channel"),
    "float8_e5m2 per token g64": qk.KVCacheConfig("float8_e5m2"),
}
PEERS = {  # row name -> transformers QuantizedCache arguments
    "transformers QuantizedCache quanto int4": {"backend": "quanto", "nbits": 4},
    "transformers QuantizedCache HQQ int4": {"backend": "hqq", "nbits": 4},
    "transformers QuantizedCache HQQ int8": {"backend": "hqq", "nbits": 8},
}


def _peer_cache(model, kwargs):
    from transformers import QuantizedCache

    return QuantizedCache(config=model.config, **kwargs)


def _rows(model, ids, args):
    float_ppl = cached_perplexity(model, ids, progress=not args.quiet)
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    float_bytes = text.num_hidden_layers * text.num_key_value_heads * 2 * head_dim * 4  # keys + values, float32
    yield "float32 cache (DynamicCache)", float_ppl, float_ppl, float_bytes, float_bytes, ""
    for name, cfg in CONFIGS.items():
        if (args.only and args.only not in name) or (args.rows and name not in args.rows):
            continue
        cache = qk.QuantizedKVCache(model.config, cfg, max_length=ids.numel())
        model.config._attn_implementation = "sdpa"
        ppl = cached_perplexity(model, ids, cfg, progress=not args.quiet)
        yield f"torchqkit {name}", ppl, float_ppl, cache.bytes_per_token(), float_bytes, ""
    if args.no_peers:
        return
    for name, kwargs in PEERS.items():
        try:
            ppl = cached_perplexity(model, ids, cache=_peer_cache(model, kwargs), progress=not args.quiet)
            yield name, ppl, float_ppl, None, float_bytes, ""
        except Exception as err:  # a peer that is not installed or refuses: its row says why, the others still run
            traceback.print_exc(limit=1)
            yield name, None, float_ppl, None, float_bytes, f"not run: {type(err).__name__}: {str(err)[:120]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_cache", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens scored through the cache (default 256)")
    parser.add_argument("--out", default=None, help="write the markdown table here as well")
    parser.add_argument("--no-peers", action="store_true", help="skip transformers' QuantizedCache rows")
    parser.add_argument("--only", default=None, metavar="TEXT",
                        help="only the torchqkit rows whose name contains TEXT (the float row and peers still run)")
    parser.add_argument("--rows", type=lambda text: text.split(";"), default=None, metavar="NAME;NAME",
                        help="only these torchqkit rows (exact names, ';'-separated; the float row and peers still "
                             "run)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    model, tokenizer = load_gguf(smollm2_gguf_path())
    model.eval()
    model.set_attn_implementation("sdpa")
    ids = tokenizer(eval_text(), return_tensors="pt", verbose=False).input_ids[0][:args.tokens]
    lines = [f"SmolLM2-135M (float32 weights), {ids.numel()} tokens of torchqkit's eval text scored token by token "
             f"through the cache; torch {torch.__version__}, torchqkit {qk.__version__}",
             f"command: python -m benchmarks.kv_cache --tokens {args.tokens}{' --no-peers' if args.no_peers else ''}"
             + (f" --only '{args.only}'" if args.only else "")
             + (f" --rows '{';'.join(args.rows)}'" if args.rows else ""),
             "", "| cache | perplexity | vs float32 cache | bytes per position | vs float32 |",
             "|---|---|---|---|---|"]
    for name, ppl, float_ppl, nbytes, float_bytes, note in _rows(model, ids, args):
        ppl_text = "-" if ppl is None else f"{ppl:.4f}"
        rel = "-" if ppl is None else f"{100 * (ppl / float_ppl - 1):+.2f}%"
        size = "-" if nbytes is None else f"{nbytes:g}"
        ratio = "-" if nbytes is None else f"{nbytes / float_bytes:.4f}x"
        lines.append(f"| {name} | {ppl_text} | {rel} | {size} | {ratio} |" + (f" {note}" if note else ""))
        print(lines[-1], file=sys.stderr, flush=True)
        _write(args.out, lines)
    print("\n".join(lines))
    _write(args.out, lines)
    return 0


def _write(path, lines) -> None:
    if path:
        from torchqkit.files.atomic_write import atomic_write_bytes

        atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))


if __name__ == "__main__":
    sys.exit(main())
