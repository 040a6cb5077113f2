"""llama.cpp reading torchqkit's GGUF exports: perplexity of each exported file in llama.cpp against torchqkit's own
perplexity of the model it came from, and against llama.cpp's own Q4_0 / Q4_1 quantization of the same float model.

    python -m benchmarks gguf_export --peers-python PEERS_VENV/bin/python          # SmolLM2-135M, 2048 tokens
    python -m benchmarks gguf_export --configs int4-wo-g32,int4-wo-g64+gptq --tokens 1024 --peers-python ...

SmolLM2-135M: its GGUF dequantized to float32 with channels permuted as in the quality and calibration groups (its
Linears sit on the file's Q4_1 grid otherwise, where int4 g32 round-to-nearest is lossless); the tied lm_head /
embedding stays float32 (F32 in every file), every other Linear is quantized by the config, exported with
torchqkit.save_gguf (the tokenizer copied from the packaged GGUF) and read back by llama.cpp. Perplexity: tokens
[0, --tokens) of the text torchqkit ships, windows of 512 (torchqkit.eval.perplexity, stride = window); llama.cpp scores
the same token ids in the same windows (peer_llama_cpp_quality.py). Calibrated configs (+gptq, +awq) use the
calibration group's batches (text from token 8192 on). The baselines: the float32 model exported as F32 (what
llama.cpp's own arithmetic changes: it quantizes activations to 8 bits inside its Q4 / Q8 dot products), and llama.cpp's
llama_model_quantize of that F32 file to Q4_0 and Q4_1 (the embedding kept F32). Also checked: the packaged Q4_1 file
read by qk.from_gguf and written back by save_gguf has the same bytes in every tensor. Without --peers-python the
llama.cpp rows say "skipped"; --quick runs the tiny random LLaMA with a placeholder tokenizer (seconds; it checks the
code, not the figures).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import torchqkit as qk
from torchqkit.eval import perplexity, smollm2_gguf_path

from . import calibration
from .common import cli, llm, peers
from .common.configs import build
from .common.placeholder_tokenizer import placeholder_tokenizer

GROUP = "gguf_export"
DEFAULT_CONFIGS = ["int4-wo-g32", "int4-wo-g64", "int4-wo-g64+hqq", "int4-wo-g64+gptq", "int4-wo-g64+awq"]
EXPORTED = "save_gguf file"
PEER_SCRIPT = Path(__file__).resolve().parent / "peer_llama_cpp_quality.py"


def _peer(python: str, *args: str) -> dict:
    """peer_llama_cpp_quality.py's JSON, or {'note': why there is none}."""
    import subprocess
    if not python:
        return {"note": f"skipped (no --peers-python / ${peers.ENV})"}
    done = subprocess.run([python, str(PEER_SCRIPT), *args], capture_output=True, text=True)
    if done.returncode != 0:
        err = done.stderr.strip()
        return {"note": f"failed: {err.splitlines()[-1] if err else done.returncode}"}
    return json.loads(done.stdout)


def _file_bytes(path: Path) -> int:
    return path.stat().st_size


def _byte_identical_reexport(rec, folder: Path) -> None:
    """The packaged Q4_1 file through from_gguf and save_gguf: tensors whose bytes differ (expected: none)."""
    import gguf
    source = smollm2_gguf_path()
    out = folder / "reexport.gguf"
    report = qk.save_gguf(qk.from_gguf(source, progress=False), out, progress=False)
    theirs = {t.name: t for t in gguf.GGUFReader(out).tensors}
    differ = [t.name for t in gguf.GGUFReader(source).tensors
              if t.name not in theirs or theirs[t.name].tensor_type != t.tensor_type
              or not np.array_equal(np.asarray(theirs[t.name].data).view(np.uint8), np.asarray(t.data).view(np.uint8))]
    rec.add("re-export of the packaged Q4_1 file", "llama.cpp", {"model": "SmolLM2-135M", "tensors": len(theirs)},
            "tensors with other bytes", len(differ), "", types=dict(report.types), differ=differ[:10])


def main(argv=None) -> int:
    p = cli.parser(GROUP, __doc__)
    cli.add_configs(p, DEFAULT_CONFIGS)
    peers.add_option(p)
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the text to score (default 2048)")
    p.add_argument("--calib-batches", type=int, default=16, help="+gptq / +awq: calibration windows of 256 tokens")
    p.add_argument("--no-reexport", action="store_true", help="skip the byte-identical re-export check")
    args, rec = cli.start(GROUP, p, argv)
    cli.quick(args, argv, tokens=128, calib_batches=2, configs=["int4-wo-g32"], no_reexport=True)
    model_llm, ids, batches = calibration.smollm2(args)
    window = 64 if args.quick else 512
    shape = {"model": model_llm.name, "tokens": ids.numel(), "window": window}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tokenizer = placeholder_tokenizer(folder / "tokenizer.gguf", llm.TINY_VOCAB) if args.quick else smollm2_gguf_path()
        ids_file = folder / "ids.json"
        ids_file.write_text(json.dumps(ids.tolist()))

        def llama_ppl(path: Path) -> dict:
            return _peer(args.peers_python, "perplexity", str(path), "--ids", str(ids_file), "--window", str(window),
                         "--threads", str(args.threads or torch.get_num_threads()))

        def row(case: str, name: str, model, path: Path, how: str, **extra) -> None:
            ours = perplexity(model, ids, window, progress=False) if model is not None else None
            theirs = llama_ppl(path)
            got = theirs.get("perplexity")
            rec.add(case, name, shape, "llama.cpp perplexity", got, "", file=how, bytes=_file_bytes(path),
                    **({"note": theirs["note"]} if "note" in theirs else {}), **extra)
            if ours is not None:
                rec.add(case, name, shape, "torchqkit perplexity", ours, "")
                if got is not None:
                    rec.add(case, name, shape, "llama.cpp vs torchqkit", 100 * (got - ours) / ours, "%")

        print("[gguf_export] float32", file=sys.stderr, flush=True)
        float_file = folder / "float32.gguf"
        qk.save_gguf(model_llm.model, float_file, tokenizer, progress=False)
        row(EXPORTED, "float32", model_llm.model, float_file, "save_gguf F32")
        for ftype in ("Q4_0", "Q4_1"):
            print(f"[gguf_export] llama.cpp {ftype}", file=sys.stderr, flush=True)
            out = folder / f"llama-{ftype}.gguf"
            made = _peer(args.peers_python, "quantize", str(float_file), str(out), "--ftype", ftype)
            case = f"llama.cpp's own {ftype} of the F32 file"
            if "note" in made:
                rec.add(case, "llama.cpp", shape, "llama.cpp perplexity", None, "", note=made["note"])
                continue
            row(case, "llama.cpp", None, out, f"llama_model_quantize {ftype}")
        for name in args.configs:
            print(f"[gguf_export] {name}", file=sys.stderr, flush=True)
            q, _, done = calibration._quantize(model_llm.model, name, batches, keep_lm_head=True)
            out = folder / f"{name}.gguf"
            try:
                report = qk.save_gguf(q, out, tokenizer, progress=False)
            except qk.GGUFError as err:
                rec.add(EXPORTED, name, shape, "llama.cpp perplexity", None, "", quantized=done,
                        note=f"save_gguf refused: {str(err)[:400]}")
                continue
            rounded = sum(t.scales_rounded for t in report.exact)
            row(EXPORTED, name, q, out, "save_gguf", quantized=done, types=dict(report.types), exact=len(report.exact),
                scales_rounded=rounded, described=build(name).describe())
            del q
        if not args.no_reexport:
            print("[gguf_export] re-export of the packaged file", file=sys.stderr, flush=True)
            _byte_identical_reexport(rec, folder)
    rec.print_table()
    return 0
