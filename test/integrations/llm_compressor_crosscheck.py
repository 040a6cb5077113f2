"""llm-compressor's own output loaded by torchqkit.from_pretrained, against llm-compressor's own loader.

llm-compressor 0.14 pins transformers <= 5.17 and compressed-tensors 0.19, so it can't share an environment with
the test suite; this script runs in two interpreters:

    PEER/bin/python test/integrations/llm_compressor_crosscheck.py produce DIR   # a venv with llmcompressor
    python test/integrations/llm_compressor_crosscheck.py check DIR              # torchqkit's environment

``produce`` quantizes a small random LLaMA with llm-compressor's ``oneshot`` and ``QuantizationModifier`` for each
preset scheme below (round to nearest: no calibration data), saves it compressed (``save_compressed=True``), loads
it back with transformers + compressed-tensors (their loader, which decompresses), and records that loader's
logits and weights. ``check`` loads each directory with torchqkit.from_pretrained, and prints, per scheme, whether
every Linear's ``weight.dequantize()`` equals their loader's weight bit for bit and the largest logit difference.
The committed output is llm_compressor_crosscheck.txt.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

SCHEMES = ("W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8_DYNAMIC")
IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 101, 127, 0, 64, 200, 17]])


def _model():
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def _linears(model):
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]


def produce(root: Path) -> None:
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    _model().save_pretrained(root / "float")  # oneshot reads the model's config from its directory
    for scheme in SCHEMES:
        model = transformers.AutoModelForCausalLM.from_pretrained(root / "float").eval()
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
        out = root / scheme
        model.save_pretrained(out, save_compressed=True)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            logits = theirs(IDS).logits
        weights = {n: theirs.get_submodule(n).weight.detach().clone() for n in _linears(theirs)}
        torch.save({"logits": logits, "weights": weights}, out / "their_loader.pt")
        print(scheme, "written:", out)


def check(root: Path) -> None:
    import torchqkit as qk
    for scheme in SCHEMES:
        d = root / scheme
        ref = torch.load(d / "their_loader.pt")
        model = qk.from_pretrained(d)
        exact = all(torch.equal(model.get_submodule(n).weight.dequantize(), w) for n, w in ref["weights"].items())
        kinds = {model.torchqkit_report[n].config for n in ref["weights"]}
        with torch.no_grad():
            diff = float((model(IDS).logits.float() - ref["logits"].float()).abs().max())
        print(f"{scheme:<12} Linears {len(ref['weights'])}, weights bit-exact: {exact}, max |logit diff| {diff:.3g} "
              f"(max |logit| {float(ref['logits'].abs().max()):.3g}); {sorted(kinds)[0]}")


if __name__ == "__main__":
    {"produce": produce, "check": check}[sys.argv[1]](Path(sys.argv[2]))
