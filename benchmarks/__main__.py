"""python -m benchmarks <group> [options]   (python -m benchmarks <group> --help for each group's own)

Groups: kernels, targets, decode, prefill, moe_decode, moe_calibration, quality, calibration, formats, rotation,
sparsity, load, gguf_export, train, distributed; then plot (PNG figures from the JSON lines) and report (markdown tables of the latest
run per case).

Run it from the repository root: the benchmarks package sits next to torchqkit, not inside the installed package."""
from __future__ import annotations

import importlib
import sys

GROUPS = {
    "kernels": "quantized linear ops next to F.linear and torch's own ops, per shape and M",
    "targets": "the CPU kernel targets at every ISA level this CPU runs (one process per level)",
    "decode": "LLM greedy decode tokens/s, next to llama.cpp",
    "prefill": "LLM prompt processing tokens/s, next to llama.cpp",
    "moe_decode": "a random ~1B mixture-of-experts model's decode tokens/s and bytes read, per experts implementation",
    "moe_calibration": "GPTQ of a random mixture-of-experts model's experts against round-to-nearest",
    "quality": "perplexity per config (and peers), a synthetic decoder's tok/s, MiniLM throughput",
    "calibration": "GPTQ / AWQ / SmoothQuant / static int8 against round-to-nearest; GPTQ memory",
    "formats": "NVFP4 / MXFP4 / FP6 / int4 g128 side by side: SmolLM2 perplexity, MiniLM cosine, the format targets",
    "rotation": "rotate_ (QuaRot) with W4A8 / W4A4 / MX activations: SmolLM2 perplexity with and without, the targets",
    "sparsity": "2:4 magnitude / Wanda / SparseGPT, float and int4 g32: SmolLM2 perplexity, MiniLM cosine, the targets",
    "load": "loading: GGUF two ways, transformers' from_pretrained five ways",
    "gguf_export": "llama.cpp reading save_gguf's files: perplexity next to torchqkit's and llama.cpp's Q4_0 / Q4_1",
    "train": "QAT recovery on MiniLM, float8 training loss curves",
    "distributed": "tensor parallel, per-rank loading and FSDP2 QLoRA over 2 processes",
}
TOOLS = {"plot": "PNG plots from the JSON lines", "report": "markdown tables of the latest run per case"}


def usage() -> str:
    rows = [f"  {name:<12} {what}" for name, what in {**GROUPS, **TOOLS}.items()]
    return "usage: python -m benchmarks <group> [options]\n" + "\n".join(rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in GROUPS and name not in TOOLS:
        print(f"python -m benchmarks: unknown group {name!r}; groups: {', '.join(GROUPS)}; tools: {', '.join(TOOLS)}",
              file=sys.stderr)
        return 2
    return importlib.import_module(f"benchmarks.{name}").main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
