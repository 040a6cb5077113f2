"""Quality per config: SmolLM2-135M perplexity (torchqkit and the peers installed in this Python), a synthetic
decoder's decode tokens/s and all-MiniLM-L6-v2's encode throughput and cosine to float32.

    python -m benchmarks quality                                   # every part
    python -m benchmarks quality --parts llm --configs float32,int4-wo-g64,int4-wo-g64+hqq --tokens 2048
    PEERS_VENV/bin/python -m benchmarks quality --parts llm        # a venv where torchao / optimum-quanto / hqq are
    python -m benchmarks quality --quick                           # tiny models (seconds), minilm only if named

Parts: llm (quality_llm.py), synthetic (the synthetic decoder, quality_synthetic.py), minilm (the demo's MiniLM).
"""
from __future__ import annotations

from .common import cli
from .common.configs import check, split_names

GROUP = "quality"
PARTS = ("llm", "synthetic", "minilm")
DEFAULT_CONFIGS = ["float32", "int4-wo-g32", "int4-wo-g64", "int4-wo-g128", "int4-wo-g32+hqq", "int4-wo-g64+hqq",
                   "int4-wo-g128+hqq", "int8-wo"]
SPEED_CONFIGS = ["float32", "bfloat16", "int8-wo", "int4-wo-g128", "nf4-b64", "fp8-wo"]


def main(argv=None) -> int:
    p = cli.parser(GROUP, __doc__)
    cli.add_configs(p, DEFAULT_CONFIGS)
    p.add_argument("--speed-configs", default=",".join(SPEED_CONFIGS), help="configs of the synthetic and minilm parts")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--tokens", type=int, default=4096, help="llm: tokens of the text to score (default 4096)")
    p.add_argument("--window", type=int, default=512, help="llm: tokens per forward pass (default 512)")
    p.add_argument("--no-permute", action="store_true", help="llm: measure the raw (Q4_1-grid) model")
    p.add_argument("--no-peers", action="store_true", help="llm: torchqkit rows only")
    p.add_argument("--new-tokens", type=int, default=32, help="llm: greedy tokens per decode run (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="timed decode runs, median (default 3)")
    p.add_argument("--steps", type=int, default=32, help="synthetic: decode steps per measurement (default 32)")
    p.add_argument("--prompt", type=int, default=8, help="synthetic: prompt tokens (prefill before decoding)")
    p.add_argument("--no-compile", action="store_true", help="synthetic: eager only")
    args, rec = cli.start(GROUP, p, argv)
    try:
        args.speed_configs = check(split_names(args.speed_configs))
    except ValueError as e:
        p.error(f"--speed-configs: {e}")
    # --quick: the demo's MiniLM (~30 s to load and encode here) runs only when --parts names it
    cli.quick(args, argv, tokens=128, window=64, new_tokens=4, repeats=1, no_peers=True, steps=4,
              configs=["float32", "int4-wo-g32"], speed_configs=["float32", "int8-wo"], parts="llm,synthetic")
    args.parts = split_names(args.parts) if isinstance(args.parts, str) else args.parts
    if set(args.parts) - set(PARTS):
        p.error(f"--parts: unknown {sorted(set(args.parts) - set(PARTS))}; known: {', '.join(PARTS)}")
    from . import quality_llm, quality_synthetic
    if "llm" in args.parts:
        quality_llm.run(args, rec)
    if "synthetic" in args.parts:
        quality_synthetic.run_decoder(args, rec)
    if "minilm" in args.parts:
        quality_synthetic.run_minilm(args, rec)
    rec.print_table()
    return 0
