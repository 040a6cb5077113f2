"""Loading quantized models: SmolLM2's GGUF file two ways (load_gguf.py), and transformers' from_pretrained five ways
with their memory (load_hf.py).

    python -m benchmarks load                                # both parts
    python -m benchmarks load --parts hf --config int4-wo-g64 --tokens 512
    python -m benchmarks load --quick                        # the hf part on a tiny model, in this process (seconds)

--quick leaves out the GGUF part: it reads SmolLM2's file twice (about 20 s here), more than a smoke run may take.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from .common import cli, llm
from .common.configs import check

GROUP = "load"
PARTS = ("gguf", "hf")


def main(argv=None) -> int:
    p = cli.parser(GROUP, __doc__)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--config", default="int4-wo-g128", help="hf: the config quantizing the model (default %(default)s)")
    p.add_argument("--tokens", type=int, default=None, help="perplexity tokens (default: gguf 2048, hf 512)")
    p.add_argument("--new-tokens", type=int, default=32, help="gguf: greedy tokens per timed decode (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="gguf: timed decodes, median (default 3)")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # hf: one way, in this fresh process
    args, rec = cli.start(GROUP, p, argv)
    if args.child:
        from . import load_hf
        mode, work, tokens, config = args.child
        print(json.dumps(load_hf.child(mode, Path(work), int(tokens), config)))
        return 0
    try:
        check([args.config])
    except ValueError as e:
        p.error(f"--config: {e}")
    parts = [x for x in args.parts.split(",") if x]
    if set(parts) - set(PARTS):
        p.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; known: {', '.join(PARTS)}")
    if args.quick:
        parts = [x for x in parts if x != "gguf"]
    cli.quick(args, argv, tokens=64, config="int4-wo-g32")  # the tiny model's K = 64 has no group of 128
    if "gguf" in parts:
        from . import load_gguf
        load_gguf.run(argparse.Namespace(**{**vars(args), "tokens": args.tokens or 2048}), rec)
    if "hf" in parts:
        from . import load_hf
        args.tokens = args.tokens or 512
        with tempfile.TemporaryDirectory() as d:
            load_hf.run(args, rec, llm.load(args.quick), Path(d))
    rec.print_table()
    return 0
