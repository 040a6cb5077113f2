"""`python -m torchqkit eval (--gguf FILE | --hf DIR) --config NAME|JSON`: perplexity, Linear weight bytes
and decode speed of a causal LM before and after quantization (the subparser torchqkit/cli.py adds)."""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

import torchqkit
from torchqkit.api import presets
from torchqkit.files.open_checked import open_regular_file
# The same NAME|JSON parsing as `python -m torchqkit quantize`, so both commands accept the same configs.
from torchqkit.serialization.cli import parse_config_arg

from .float_layers import float_layer_time
from ..kvcache import KV_DTYPES, KVCacheConfig
from .cached_perplexity import cached_perplexity
from .models import EVAL_TEXT_SOURCE, ModelLoadError, eval_text, load_gguf, load_hf
from .permute import permute_llama_channels_
from .perplexity import perplexity
from .speed import DecodeLoop

__all__ = ["add_eval_parser"]

PROMPT_TOKENS = 16


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


def _gguf_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return path


def _hf_dir(text: str) -> Path:
    path = Path(text)
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text}: not a transformers checkpoint directory (no config.json)")
    return path


def _text_file(text: str) -> str:
    with open_regular_file(text, argparse.ArgumentTypeError, "text file") as f:  # the rule for every file read
        try:
            return f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise argparse.ArgumentTypeError(f"{text}: can't read it as UTF-8 text ({err})") from None


def add_eval_parser(commands) -> None:
    parser = commands.add_parser(
        "eval", help="perplexity, Linear weight bytes and decode tokens/s of a causal LM, float vs quantized",
        description="Loads a causal LM offline (transformers, plus gguf and accelerate for --gguf), measures it "
                    "in float32, quantizes its Linears in place with --config and measures it again. Progress "
                    "goes to stderr, results to stdout.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", type=_gguf_file, metavar="FILE", help="a GGUF file (dequantized to float32)")
    source.add_argument("--hf", type=_hf_dir, metavar="DIR", help="a transformers checkpoint directory")
    parser.add_argument("--config", type=parse_config_arg, required=True, metavar="NAME|JSON",
                        help=f"preset name ({', '.join(presets.names())}) or a JSON file (a config dict or "
                             f"ModuleConfigs, e.g. with \"lm_head\": null to keep the output layer float)")
    parser.add_argument("--text", type=_text_file, default=None, metavar="FILE",
                        help=f"UTF-8 text to score (default: the text torchqkit ships: {EVAL_TEXT_SOURCE})")
    parser.add_argument("--tokens", type=_int_at_least(2), default=4096, metavar="N",
                        help="score the first N tokens of the text (default: 4096; fewer if the text is shorter)")
    parser.add_argument("--window", type=_int_at_least(2), default=512, metavar="W",
                        help="tokens per forward pass (default: 512)")
    parser.add_argument("--stride", type=_int_at_least(1), default=None, metavar="S",
                        help="sliding-window stride (default: W, non-overlapping windows)")
    parser.add_argument("--new-tokens", type=_int_at_least(2), default=32, metavar="N",
                        help="greedy tokens generated per timed decode run (default: 32)")
    parser.add_argument("--repeats", type=_int_at_least(1), default=3, metavar="N",
                        help="timed decode runs; the median is reported (default: 3)")
    parser.add_argument("--decode", choices=("lean", "generate"), default="lean",
                        help="decode loop timed: lean = torchqkit.eval.LeanDecoder (static KV cache, one-token "
                             "step), generate = transformers' generate() (default: lean)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the lean loop's one-token step (fullgraph); the compile time is "
                             "reported, not timed as decode")
    parser.add_argument("--fuse", action="store_true",
                        help="after quantizing, fuse the Linears a module runs on one input (q/k/v, gate/up) into "
                             "one quantized matmul each (torchqkit.fuse_shared_input_linears): fewer, larger calls "
                             "per decode step, the same weights")
    parser.add_argument("--permute", action="store_true",
                        help="first permute hidden / intermediate / value-head channels (Llama-style models; "
                             "same function), so a model dequantized from a group-wise GGUF format no longer "
                             "sits on that format's grid")
    parser.add_argument("--threads", type=_int_at_least(1), default=None, metavar="N",
                        help="torch threads (default: torch's choice; on a busy machine fewer threads than cores "
                             "can decode several times faster)")
    parser.add_argument("--kv-cache", choices=KV_DTYPES, default=None, metavar="DTYPE",
                        help="the quantized model decodes with a quantized KV cache of this format (int8, int4 with "
                             "per-channel keys, float8_e4m3fn, float8_e5m2; groups of 64 or the head dim), and its "
                             "perplexity through that cache, token by token over the first --kv-tokens tokens, is reported next "
                             "to the float cache's; needs --decode lean")
    parser.add_argument("--kv-tokens", type=_int_at_least(2), default=256, metavar="N",
                        help="tokens scored token by token through the KV cache with --kv-cache (default: 256)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars on stderr")
    parser.set_defaults(run=_run_eval)


def _run_eval(args: argparse.Namespace) -> int:
    bars = _quiet_transformers() if args.quiet else None
    try:
        return _evaluate(args)
    except (ModelLoadError, ValueError) as err:
        print(f"python -m torchqkit eval: error: {err}", file=sys.stderr)
        return 2
    finally:
        if bars is not None:
            bars.enable_progress_bar()


def _quiet_transformers():
    """Turn transformers' own progress bars (loading weights) off; returns its logging module to turn them
    back on, or None if there is nothing to restore (bars already off, or no transformers: the model
    loader then says what to install)."""
    try:
        from transformers.utils import logging
    except ImportError:
        return None
    if not logging.is_progress_bar_enabled():
        return None
    logging.disable_progress_bar()
    return logging


def _evaluate(args: argparse.Namespace) -> int:
    if args.compile and args.decode != "lean":
        raise ValueError("--compile compiles the lean loop's step: use it with --decode lean")
    if args.kv_cache and args.decode != "lean":
        raise ValueError("--kv-cache quantizes the lean loop's KV cache: use it with --decode lean")
    if args.stride is not None and args.stride > args.window:
        raise ValueError(f"--stride {args.stride} is larger than --window {args.window}: tokens in between would "
                         f"never be scored")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    source = f"GGUF {args.gguf}" if args.gguf is not None else f"transformers checkpoint {args.hf}"
    _status(f"loading {source}", args.quiet)
    model, tokenizer = load_gguf(args.gguf) if args.gguf is not None else load_hf(args.hf)
    text = eval_text() if args.text is None else args.text
    ids = tokenizer(text, return_tensors="pt", verbose=False).input_ids[0]
    available = ids.numel()
    ids = ids[:args.tokens]
    if args.permute:
        permute_llama_channels_(model)
    window = min(args.window, ids.numel())
    stride = None if args.stride is None else min(args.stride, window)
    print(f"model: {source} ({type(model).__name__}){', channels permuted' if args.permute else ''}")
    print(f"text: {'torchqkit eval text' if args.text is None else 'given file'}, {ids.numel()} of {available} "
          f"tokens, window {window}, stride {stride or window}; decode: {args.new_tokens} greedy tokens "
          f"after a {PROMPT_TOKENS}-token prompt, median of {args.repeats}, {torch.get_num_threads()} threads, "
          f"{_loop_name(args)}")
    float_ppl, float_speed, _ = _measure(model, ids, window, stride, args, "float32")
    _status("quantizing", args.quiet)
    report = torchqkit.quantize_(model, args.config)
    print(f"config: {_describe(args.config)}")
    print(f"Linears: {_counts(report)}")
    for note in report.notes:  # a float weight that reads more bytes per token than the quantized Linears
        print(f"note: {note}")
    if args.fuse:
        fused = torchqkit.fuse_shared_input_linears(model)
        left = {k: v for k, v in fused.items() if v != "fused"}
        print(f"fused projections: {len(fused) - len(left)} groups fused, {len(left)} left as they were"
              + "".join(f"; {k}: {v.removeprefix('left as it was: ')}" for k, v in list(left.items())[:3]))
    q_ppl, q_speed, loop = _measure(model, ids, window, stride, args, "quantized")
    print(f"Linear weight MB: {report.bytes_before / 1e6:.2f} -> {report.bytes_after / 1e6:.2f}"
          f" ({report.bytes_before / max(report.bytes_after, 1):.2f}x smaller; all {len(report)} Linears, the ones "
          f"left alone at their float size)")
    print(f"perplexity: float32 {float_ppl:.4f}, quantized {q_ppl:.4f} "
          f"({q_ppl - float_ppl:+.4f}, {100 * (q_ppl / float_ppl - 1):+.2f}%)")
    print(f"decode tokens/s: float32 {float_speed:.1f}, quantized {q_speed:.1f} ({q_speed / float_speed:.2f}x)"
          + (f" (quantized: {args.kv_cache} KV cache)" if args.kv_cache else ""))
    _print_float_layer_time(model, loop, q_speed, args)
    if args.kv_cache:
        _kv_cache_report(model, ids[:args.kv_tokens], args)
    return 0


def _print_float_layer_time(model, loop, speed: float, args: argparse.Namespace) -> None:
    """One line per shape of float Linear left in the quantized model: its measured share of a decode step
    (Note [Float layer time] in float_layers.py)."""
    _status("quantized: time of the float Linears left (one profiled decode run)", args.quiet)
    step_ms = 1e3 / speed
    for t in float_layer_time(loop, model):
        names = ", ".join(t.names[:3]) + (f" and {len(t.names) - 3} more" if len(t.names) > 3 else "")
        what = f"float Linear{'s' if len(t.names) > 1 else ''} left: {names} ({t.dtype}, {t.shape[0]} x {t.shape[1]})"
        print(f"{what}: {t.ms:.2f} ms of {step_ms:.2f} ms per decode step ({100 * t.ms / step_ms:.0f}%), "
              f"{t.calls:.0f} matmul call{'s' if t.calls != 1 else ''} per step ({t.how})")


def kv_cache_config(dtype: str, model) -> KVCacheConfig:
    """The KV cache format --kv-cache names: groups of 64 (of the whole head dim where 64 does not divide it); int4
    with per-channel keys (KIVI's layout)."""
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return KVCacheConfig(dtype, key_granularity="channel" if dtype == "int4" else "token",
                         group_size=64 if head_dim % 64 == 0 else head_dim)


def _kv_cache_report(model, ids, args: argparse.Namespace) -> None:
    """The quantized model's perplexity token by token through a float and a quantized KV cache, and the bytes per
    cached position of each."""
    from ..kvcache.cache import QuantizedKVCache

    cfg = kv_cache_config(args.kv_cache, model)
    _status(f"quantized: perplexity through the float and the {args.kv_cache} KV cache", args.quiet)
    float_ppl = cached_perplexity(model, ids, progress=not args.quiet)
    kv_ppl = cached_perplexity(model, ids, cfg, progress=not args.quiet)
    own = model.config._attn_implementation
    cache = QuantizedKVCache(model.config, cfg)
    model.config._attn_implementation = own
    print(f"KV cache ({ids.numel()} tokens token by token, quantized model): perplexity float cache {float_ppl:.4f}, "
          f"{args.kv_cache} cache {kv_ppl:.4f} ({100 * (kv_ppl / float_ppl - 1):+.2f}%); bytes per cached position "
          f"{cache.bytes_per_token():g} vs {cache.float_bytes_per_token()} in float32 "
          f"({cache.bytes_per_token() / cache.float_bytes_per_token():.3f}x)")


def _measure(model, ids, window: int, stride: int | None, args: argparse.Namespace,
             label: str) -> tuple[float, float, DecodeLoop]:
    """(perplexity, decode tokens/s, the decode loop timed: warm, ready to run again)."""
    kv_cache = kv_cache_config(args.kv_cache, model) if args.kv_cache and label == "quantized" else None
    _status(f"{label}: perplexity", args.quiet)
    ppl = perplexity(model, ids, window, stride=stride, progress=not args.quiet)
    _status(f"{label}: decode speed ({_loop_name(args)})", args.quiet)
    prompt = ids[:min(PROMPT_TOKENS, ids.numel())]
    # One loop for the warm-up (which compiles) and the timed runs, so the compile time can be reported
    # (the rate is decode_tokens_per_second's: the median run of `repeats` after one untimed run).
    loop = DecodeLoop(model, prompt, args.new_tokens, decode=args.decode, compile=args.compile,
                      kv_cache=kv_cache)
    loop.run()
    if args.compile:
        print(f"{label}: decode step compiled in {loop.compile_seconds:.1f} s (warm-up, not timed)")
    durations = sorted(t[-1] - t[0] for t in (loop.run() for _ in range(args.repeats)))
    return ppl, (args.new_tokens - 1) / durations[len(durations) // 2], loop


def _loop_name(args: argparse.Namespace) -> str:
    if args.decode == "generate":
        return "HF generate()"
    return "lean loop, compiled step" if args.compile else "lean loop, eager"


def _describe(config) -> str:
    if hasattr(config, "describe"):
        return config.describe()
    return ", ".join(f"{key}: {'float (None)' if value is None else value.describe()}"
                     for key, value in config.configs.items())


def _counts(report) -> str:
    """'N quantized, M skipped, K kept' and the most common reasons for the ones left alone."""
    text = (f"{len(report.quantized)} quantized, {len(report.skipped)} skipped, "
            f"{len(report.by_status('kept'))} kept of {len(report)}")
    reasons = Counter(e.reason for e in report.entries if e.status != "quantized")
    if reasons:
        text += "; " + "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common(3))
        if len(reasons) > 3:
            text += f"; ... ({len(reasons) - 3} more reasons)"
    return text


def _status(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"[eval] {message}", file=sys.stderr, flush=True)
