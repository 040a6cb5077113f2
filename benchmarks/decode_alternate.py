"""decode --alternate: only the compiled lean loop of each config, all compiled first, then --repeats rounds that time
one decode of each config in turn (the order rotating): on a shared 2-vCPU host a config's tok/s moved 10-20% between
rows a minute apart, more than the changes compared; with rounds a slow spell slows every config of that round alike,
and the median over rounds of each config is compared with the first config's, in the same run."""
from __future__ import annotations

import statistics
import sys

from torchqkit.eval import DecodeLoop

from .common import llm


def run(args, rec, model_llm) -> int:
    from .decode import PROMPT, inductor_options, quantized_copy
    ids = model_llm.tokenize(PROMPT)
    loops = {}
    compiled = not args.quick  # --quick: the eager lean loop (compiling takes minutes)
    for name in args.configs:
        print(f"[decode] {name}: quantize{', compile' if compiled else ''}", file=sys.stderr, flush=True)
        model, _ = quantized_copy(model_llm.model, name)
        loop = DecodeLoop(model, ids, args.new_tokens, decode="lean", compile=compiled,
                          inductor_options=inductor_options(name, args) if compiled else None)
        loop.run()
        loops[name] = (loop, llm.weight_mb_per_token(model))
    ms = {name: [] for name in loops}
    names = list(loops)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times = loops[name][0].run()
            ms[name].append((times[-1] - times[0]) / (len(times) - 1) * 1e3)
    first = statistics.median(ms[names[0]])
    case = f"lean-{'compiled' if compiled else 'eager'}, alternating rounds"
    for name, (loop, mb) in loops.items():
        med = statistics.median(ms[name])
        shape = {"model": model_llm.name, "new_tokens": args.new_tokens, "rounds": args.repeats}
        extra = dict(min_ms=min(ms[name]), max_ms=max(ms[name]), replayed=compiled and not loop.replay_off)
        rec.add(case, name, shape, "decode", 1e3 / med, "tok/s", **extra)
        rec.add(case, name, shape, "weights read per token", mb, "MB")
        rec.add(case, name, shape, f"x {names[0]}", first / med, "x")
    rec.print_table()
    return 0
