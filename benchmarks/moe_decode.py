"""Mixture-of-experts greedy decode tokens/s: a random-weight Qwen3-MoE of about 1B parameters (1.0B of them in
experts), float32 and each config, per transformers experts implementation, with the weight bytes one decode step
reads (attention, router-chosen experts, lm_head) next to the bytes the model stores.

    python -m benchmarks moe_decode                                   # ~1B MoE, every config and implementation
    python -m benchmarks moe_decode --quick                           # a tiny MoE (seconds): checks the code only
    python -m benchmarks moe_decode --configs int4-wo-g32 --experts-impl grouped_mm --new-tokens 64
    python -m benchmarks moe_decode --peers-python PEERS_VENV/bin/python  # + llama.cpp on each config's save_gguf file

The weights are random (no MoE checkpoint ships with the machine): the rate depends on the shapes and the bytes
read, not on the values, but which experts the router picks does, so every row decodes the same prompt with the
same seed and "routed expert MB per token" is computed from the router's actual choices (distinct experts per layer
per decode step x each expert's stored bytes), counted on an uncompiled run of the same loop. Timing: torchqkit.eval's
DecodeLoop (Note [Decode timing] in torchqkit/eval/speed.py): the lean loop (static KV cache; --compile compiles its
step, as `python -m torchqkit eval --decode lean --compile` does) or HF generate (--decode generate), one warm-up
run, the median of --repeats runs.

llama.cpp column (--peers-python: a Python with llama-cpp-python): each config's model written by qk.save_gguf (its
codes exactly; a config with no exact GGUF type, e.g. NF4, gets no llama.cpp row and says why) with a placeholder
tokenizer, decoded by peer_llama_cpp.py with the same thread count and token counts. Its prompt is the placeholder
tokenizer's reading of a short text, not the ids above, so the routed experts differ from torchqkit's run (same
shapes and bytes per expert).

Dense reference (case "dense, same active"): a random Qwen3 (dense) model with the MoE's attention, layers and
vocabulary and an MLP of num_experts_per_tok x moe_intermediate_size (4 x 640 = 2560), i.e. the parameters one
token of the MoE uses, quantized with each config and decoded the same way: the MoE's time per token over this
model's is what routing and the expert stacks cost (the target: within 1.3x). --no-dense leaves it out.
"""
from __future__ import annotations

import copy
import shutil
import sys
import tempfile
from pathlib import Path

import torch

import torchqkit as qk
from torchqkit.eval import DecodeLoop

from .common import cli, peers
from .common.configs import build
from .common.llm import tensor_bytes
from .common.memory import QUICK_BYTES, read_bandwidth
from .common.placeholder_tokenizer import placeholder_tokenizer

GROUP = "moe_decode"
DEFAULT_CONFIGS = ["float32", "int4-wo-g32", "int8-wo", "nf4-b64", "int8-dyn-int8"]
IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")
# About 1B parameters: 16 layers x 32 experts x 3 x 1024 x 640 = 1.01B in experts, 4 of 32 routed per token.
SHAPE = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
             head_dim=64, intermediate_size=2816, moe_intermediate_size=640, num_experts=32, num_experts_per_tok=4)
QUICK_SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)


def _args(argv):
    p = cli.parser(GROUP, __doc__)
    cli.add_configs(p, DEFAULT_CONFIGS)
    p.add_argument("--experts-impl", default=",".join(IMPLEMENTATIONS),
                   help="comma-separated transformers experts implementations (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per run (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up (default: %(default)s)")
    p.add_argument("--no-dense", action="store_true", help="skip the dense model with the same active parameters")
    p.add_argument("--decode", choices=("lean", "generate"), default="lean",
                   help="the decode loop: torchqkit.eval's lean loop (static KV cache) or HF generate "
                        "(default: %(default)s)")
    p.add_argument("--compile", action="store_true", help="compile the lean loop's step (torch.compile)")
    peers.add_option(p)
    args, rec = cli.start(GROUP, p, argv)
    cli.quick(args, argv, new_tokens=4, repeats=1, prompt_tokens=4)
    args.experts_impl = [i for i in args.experts_impl.split(",") if i]
    unknown = sorted(set(args.experts_impl) - set(IMPLEMENTATIONS))
    if unknown:
        p.error(f"--experts-impl: {unknown} are not CPU experts implementations; choose from {IMPLEMENTATIONS}")
    if args.compile and args.decode != "lean":
        p.error("--compile compiles the lean loop's step: use it with --decode lean")
    return args, rec


def random_moe(quick: bool) -> torch.nn.Module:
    import transformers
    torch.manual_seed(0)
    # norm_topk_prob: as Qwen3-30B-A3B, and what llama.cpp's qwen3moe graph computes (save_gguf checks it).
    config = transformers.Qwen3MoeConfig(**(QUICK_SHAPE if quick else SHAPE), decoder_sparse_step=1,
                                         mlp_only_layers=[], tie_word_embeddings=False, norm_topk_prob=True)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def random_dense_same_active(quick: bool) -> torch.nn.Module:
    """A random Qwen3 with the MoE's attention, layers and vocabulary and one MLP as wide as the experts a token
    uses (num_experts_per_tok x moe_intermediate_size): the dense model with the MoE's active parameters."""
    import transformers
    torch.manual_seed(0)
    shape = dict(QUICK_SHAPE if quick else SHAPE)
    shape["intermediate_size"] = shape.pop("num_experts_per_tok") * shape.pop("moe_intermediate_size")
    shape.pop("num_experts")
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape, tie_word_embeddings=False)).eval()


class RoutedBytes:
    """Counts, over decode steps (one token: the prefill is left out), the stored bytes of the distinct experts the
    routers pick (what the step must read from the expert stacks), by a forward hook on each router."""

    def __init__(self, model):
        self.total, self.steps, self.handles = 0, 0, []
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                experts = model.get_submodule(name.rpartition(".")[0] + ".experts")
                per_expert = sum(tensor_bytes(p) for n, p in experts.named_parameters() if n.endswith("_proj"))
                per_expert //= experts.num_experts
                self.handles.append(module.register_forward_hook(self._hook(per_expert)))

    def _hook(self, per_expert: int):
        def hook(module, args, out):
            if args[0].reshape(-1, args[0].shape[-1]).shape[0] == 1:  # one token: a decode step
                self.total += per_expert * int(out[2].unique().numel())  # out: (logits, scores, indices)
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def dense_bytes(model) -> int:
    """Bytes every step reads whatever the routing: every Parameter outside the expert stacks but the embedding."""
    return sum(tensor_bytes(p) for n, p in model.named_parameters()
               if ".experts." not in n and "embed_tokens" not in n)


def timed_loop(model, ids, args) -> DecodeLoop:
    """The decode loop --decode / --compile ask for, run once (warm-up; a compiled step compiles here)."""
    loop = DecodeLoop(model, ids, args.new_tokens, decode=args.decode, compile=args.compile)
    loop.run()
    return loop


def loop_name(args) -> str:
    return args.decode + (" compiled" if args.compile else "")


def measure(model, ids, args) -> dict:
    per_token = median_seconds_per_token(timed_loop(model, ids, args), args.repeats)
    # The routers' choices, counted by hooks on an uncompiled run of the same loop (a compiled step runs no hooks).
    routed = RoutedBytes(model)
    DecodeLoop(model, ids, args.new_tokens, decode=args.decode).run()
    routed.close()
    return {"s_per_token": per_token, "routed_mb": routed.total / (args.new_tokens - 1) / 1e6}  # first token: prefill


def median_seconds_per_token(loop, repeats: int) -> float:
    """The median over `repeats` runs of a DecodeLoop of its seconds per decoded token (prefill excluded)."""
    durations = sorted((t[-1] - t[0]) / (len(t) - 1) for t in (loop.run() for _ in range(repeats)))
    return durations[len(durations) // 2]


PEER_PROMPT = "ab " * 8  # the placeholder tokenizer's tokens: llama.cpp needs text to tokenize


def llama_cpp_row(rec, name, model, folder: Path, args) -> None:
    """The config's model through save_gguf and llama.cpp's decode: a 'llama.cpp' row, or why there is none."""
    if not args.peers_python:
        return
    path = folder / f"{name}.gguf"
    try:
        report = qk.save_gguf(model, path, placeholder_tokenizer(folder / "tokenizer.gguf", model.config.vocab_size, "qwen3moe"))
    except qk.GGUFError as e:
        print(f"[{GROUP}] llama.cpp {name}: no GGUF export: {str(e)[:240]} ...", file=sys.stderr)
        return
    row = peers.run(args.peers_python, path, "--prompt", PEER_PROMPT, "--new-tokens", str(args.new_tokens),
                    "--threads", str(torch.get_num_threads()), "--repeats", str(args.repeats))
    if "tok_s" not in row:
        print(f"[{GROUP}] llama.cpp {name}: {row['note']}", file=sys.stderr)
        return
    types = ", ".join(f"{n} {k}" for k, n in sorted(report.types.items()))
    shape = {"model": "qwen3-moe random " + ("tiny" if args.quick else "1B"), "experts_impl": "llama.cpp",
             "new_tokens": args.new_tokens, "gguf": types, "llama_cpp": row["version"],
             "simd": peers.simd(row["system_info"])}
    rec.add("llama.cpp", name, shape, "decode", row["tok_s"], "tok/s")
    rec.add("llama.cpp", name, shape, "weights stored", path.stat().st_size / 1e6, "MB")
    path.unlink()


def dense_row(rec, name: str, model, ids, args) -> None:
    """The dense model with the MoE's active parameters (random_dense_same_active) under config `name`."""
    config = build(name)
    if config is not None:
        qk.quantize_(model, config)
    print(f"[{GROUP}] {name} dense, same active", file=sys.stderr, flush=True)
    per_token = median_seconds_per_token(timed_loop(model, ids, args), args.repeats)
    shape = {"model": "qwen3 dense random, the MoE's active parameters", "experts_impl": "-",
             "loop": loop_name(args), "new_tokens": args.new_tokens}
    read = sum(tensor_bytes(p) for n, p in model.named_parameters() if "embed_tokens" not in n) / 1e6
    for metric, value, unit in (("decode", 1 / per_token, "tok/s"), ("per token", 1e3 * per_token, "ms"),
                                ("weights read per token", read, "MB")):
        rec.add("dense, same active", name, shape, metric, value, unit)


def main(argv=None) -> int:
    args, rec = _args(argv)
    base = random_moe(args.quick)
    ids = torch.randint(0, base.config.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1))
    rec.read_bw_gbs = read_bandwidth(nbytes=QUICK_BYTES) if args.quick else read_bandwidth()
    folder = Path(tempfile.mkdtemp(prefix="moe_decode_gguf_"))
    for name in args.configs:
        model, config = copy.deepcopy(base), build(name)
        if config is not None:
            qk.quantize_(model, config)
        stored = sum(tensor_bytes(p) for p in model.parameters()) / 1e6
        for impl in args.experts_impl:
            print(f"[{GROUP}] {name} {impl}", file=sys.stderr, flush=True)
            model.set_experts_implementation(impl)
            row = measure(model, ids, args)
            shape = {"model": "qwen3-moe random " + ("tiny" if args.quick else "1B"), "experts_impl": impl,
                     "loop": loop_name(args), "new_tokens": args.new_tokens}
            read = dense_bytes(model) / 1e6 + row["routed_mb"]
            for metric, value, unit in (("decode", 1 / row["s_per_token"], "tok/s"),
                                        ("per token", 1e3 * row["s_per_token"], "ms"),
                                        ("routed expert MB per token", row["routed_mb"], "MB"),
                                        ("weights read per token", read, "MB"),
                                        ("weights stored", stored, "MB")):
                rec.add("mixture of experts", name, shape, metric, value, unit)
        llama_cpp_row(rec, name, model, folder, args)
        del model
        if not args.no_dense:
            dense_row(rec, name, random_dense_same_active(args.quick), ids, args)
    shutil.rmtree(folder, ignore_errors=True)
    rec.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
