"""llama.cpp (through llama-cpp-python) as the reader of a GGUF file: its perplexity on given token ids, or its own
quantization of a GGUF file, as JSON on stdout.

Run as a script by the gguf_export group with the Python of a venv where llama-cpp-python is installed
(--peers-python), never imported by torchqkit or the benchmarks package, so it stays a standalone file:

    PEERS_VENV/bin/python benchmarks/peer_llama_cpp_quality.py perplexity FILE.gguf --ids IDS.json --window 512
    PEERS_VENV/bin/python benchmarks/peer_llama_cpp_quality.py quantize IN.gguf OUT.gguf --ftype Q4_1

perplexity: the windows of torchqkit.eval.perplexity with stride = window (Note [Perplexity windows]): ids cut into
windows of --window tokens, each evaluated alone from an empty cache (Llama.reset), every position but a window's first
scored from the logits before it; exp(mean negative log-likelihood), summed in float64. The ids are torchqkit's own
tokenization, so both sides score the same tokens.
quantize: llama.cpp's own quantizer (llama_model_quantize) with the given file type; the token embedding keeps its type
in the input file (token_embedding_type = F32 when the input's is F32), so only the Linears are compared.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys

import numpy as np


def perplexity(args, llama_cpp) -> int:
    with open(args.ids) as f:
        ids = json.load(f)
    llm = llama_cpp.Llama(args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=args.window,
                          n_batch=args.window, n_ubatch=args.window, logits_all=True, verbose=False)
    nll, scored = 0.0, 0
    for begin in range(0, len(ids), args.window):
        window = ids[begin:begin + args.window]
        if len(window) < 2:
            break
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[:len(window) - 1], dtype=np.float64)
        top = logits.max(axis=-1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
        nll += float((log_z - logits[np.arange(len(window) - 1), window[1:]]).sum())
        scored += len(window) - 1
    json.dump({"version": llama_cpp.__version__, "perplexity": math.exp(nll / scored), "scored": scored,
               "system_info": llama_cpp.llama_print_system_info().decode()}, sys.stdout)
    return 0


def quantize(args, llama_cpp) -> int:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.ftype}")
    params.nthread = args.threads
    params.token_embedding_type = 0  # GGML_TYPE_F32: the embedding (tied lm_head) as in the input file
    done = llama_cpp.llama_model_quantize(args.gguf.encode(), args.out.encode(), ctypes.byref(params))
    if done != 0:
        raise SystemExit(f"llama_model_quantize returned {done}")
    json.dump({"version": llama_cpp.__version__, "ftype": args.ftype}, sys.stdout)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("perplexity")
    p.add_argument("gguf")
    p.add_argument("--ids", required=True, help="a JSON list of token ids")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    q = commands.add_parser("quantize")
    q.add_argument("gguf")
    q.add_argument("out")
    q.add_argument("--ftype", required=True, help="Q4_0, Q4_1, Q8_0, ...")
    q.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import llama_cpp
    return perplexity(args, llama_cpp) if args.command == "perplexity" else quantize(args, llama_cpp)


if __name__ == "__main__":
    sys.exit(main())
