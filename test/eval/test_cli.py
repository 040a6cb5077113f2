"""`python -m torchqkit eval` end to end on a tiny random Llama saved with save_pretrained, and its clean
exit code 2 (message, no traceback) for bad arguments and unloadable models."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchqkit.cli import main as cli_main

from .models import SAMPLE_TEXT, tiny_llama, tiny_tokenizer

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
FAST = ["--tokens", "80", "--window", "32", "--new-tokens", "3", "--repeats", "1"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = tiny_tokenizer()
    # Untied: lm_head is an ordinary Linear that every config quantizes.
    tiny_llama(len(tokenizer), tied=False).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    text = directory / "text.txt"
    text.write_text(SAMPLE_TEXT)
    return directory, text


def _numbers(line_prefix: str, out: str) -> list[float]:
    line = next(line for line in out.splitlines() if line.startswith(line_prefix))
    return [float(x) for x in re.findall(r"[-+]?\d+\.\d+", line)]


def test_eval_float_vs_int8(checkpoint, capsys):
    directory, text = checkpoint
    assert cli_main(["eval", "--hf", str(directory), "--config", "int8-wo", "--text", str(text), *FAST]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "text: given file, 80 of " in out and "window 32, stride 32" in out
    assert "Linears: 15 quantized, 0 skipped, 0 kept of 15" in out      # 2 layers x 7 + lm_head
    before, after, ratio = _numbers("Linear weight MB:", out)
    assert after < before and ratio > 3.3                           # int8 codes + one float32 scale per row of 32
    float_ppl, q_ppl, delta, _ = _numbers("perplexity:", out)
    assert math.isfinite(float_ppl) and float_ppl > 1
    assert q_ppl == pytest.approx(float_ppl, rel=0.05) and delta == pytest.approx(q_ppl - float_ppl, abs=1e-3)
    float_speed, q_speed, _ = _numbers("decode tokens/s:", out)
    assert float_speed > 0 and q_speed > 0
    assert ", lean loop, eager" in out
    assert "\rperplexity [####################] 79/79 tokens (100%)" in captured.err


def test_eval_kv_cache_decodes_and_scores_through_the_quantized_cache(checkpoint, capsys):
    directory, text = checkpoint
    assert cli_main(["eval", "--hf", str(directory), "--config", "int8-wo", "--text", str(text), "--quiet",
                     "--kv-cache", "int8", "--kv-tokens", "24", *FAST]) == 0
    out = capsys.readouterr().out
    assert "(quantized: int8 KV cache)" in out
    float_ppl, kv_ppl, delta, ratio = _numbers("KV cache (24 tokens token by token", out)
    assert kv_ppl == pytest.approx(float_ppl, rel=0.01) and math.isfinite(delta)
    text_config = tiny_llama(8).config
    head_dim = text_config.hidden_size // text_config.num_attention_heads  # one group per head and position
    assert ratio == pytest.approx(round((head_dim + 4) / (4 * head_dim), 3))


def test_eval_fuse_fuses_the_projections_and_keeps_the_perplexity(checkpoint, capsys):
    directory, text = checkpoint
    args = ["eval", "--hf", str(directory), "--config", "int4-wo-g32", "--text", str(text), "--quiet", *FAST]
    assert cli_main(args) == 0
    plain = capsys.readouterr().out
    assert cli_main([*args, "--fuse"]) == 0
    fused = capsys.readouterr().out
    assert "fused projections: 4 groups fused, 0 left as they were" in fused  # 2 layers x (q/k/v, gate/up)
    assert "fused projections" not in plain
    # the same weights: the same perplexity up to the kernels' summation order
    assert _numbers("perplexity:", fused)[:2] == pytest.approx(_numbers("perplexity:", plain)[:2], rel=1e-4)


def test_eval_module_configs_json_keeps_lm_head(checkpoint, tmp_path, capsys):
    directory, text = checkpoint
    config = tmp_path / "mixed.json"
    config.write_text(json.dumps({"lm_head": None, "_default": {"type": "Int4WeightOnlyConfig", "group_size": 32}}))
    assert cli_main(["eval", "--hf", str(directory), "--config", str(config), "--text", str(text), "--quiet",
                     "--permute", "--decode", "generate", *FAST]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "channels permuted" in captured.out and ", HF generate()" in captured.out
    assert "Linears: 14 quantized, 0 skipped, 1 kept of 15; 1 x ModuleConfigs['lm_head'] is None" in captured.out
    float_ppl, q_ppl, _, _ = _numbers("perplexity:", captured.out)
    assert q_ppl != float_ppl and q_ppl == pytest.approx(float_ppl, rel=0.5)


@pytest.mark.parametrize("args, message", [
    (["--config", "int3-magic"], "'int3-magic' is neither a preset name"),
    (["--config", "int8-wo", "--text", "/no/such/text.txt"], "/no/such/text.txt: can't open"),
    (["--config", "int8-wo", "--window", "1"], "--window: must be at least 2"),
    (["--config", "int8-wo", "--tokens", "many"], "--tokens: expected an integer"),
    (["--config", "int8-wo", "--gguf", "TEXT"], "argument --gguf: not allowed with argument --hf"),
])
def test_bad_arguments_exit_2(checkpoint, capsys, args, message):
    directory, text = checkpoint
    args = [str(text) if arg == "TEXT" else arg for arg in args]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["eval", "--hf", str(directory), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_model_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["eval", "--gguf", str(tmp_path / "model.gguf"), "--config", "int8-wo"])
    assert exit_info.value.code == 2
    assert "model.gguf: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["eval", "--hf", str(tmp_path), "--config", "int8-wo"])
    assert "no config.json" in capsys.readouterr().err


def test_not_a_gguf_file_exits_2(tmp_path, capsys):
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a GGUF file")
    assert cli_main(["eval", "--gguf", str(fake), "--config", "int8-wo", "--quiet"]) == 2
    err = capsys.readouterr().err
    # Without gguf / accelerate installed the message says what to install; with them, what is wrong with the file.
    assert err.startswith("python -m torchqkit eval: error: ")
    assert "pip install" in err or f"{fake}: could not load a tokenizer" in err


def test_stride_above_window_exits_2_before_loading(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")      # never read: the check comes first
    assert cli_main(["eval", "--hf", str(tmp_path), "--config", "int8-wo", "--window", "8", "--stride", "9"]) == 2
    assert "--stride 9 is larger than --window 8" in capsys.readouterr().err


def test_compile_with_generate_exits_2_before_loading(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert cli_main(["eval", "--hf", str(tmp_path), "--config", "int8-wo", "--decode", "generate", "--compile"]) == 2
    assert "--compile compiles the lean loop's step: use it with --decode lean" in capsys.readouterr().err


def test_text_too_short_exits_2(checkpoint, tmp_path, capsys):
    directory, _ = checkpoint
    short = tmp_path / "short.txt"
    short.write_text("A")
    assert cli_main(["eval", "--hf", str(directory), "--config", "int8-wo", "--text", str(short), "--quiet"]) == 2
    assert "error: input_ids has 1 token(s)" in capsys.readouterr().err


def test_unloadable_checkpoint_is_a_message_not_a_traceback(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    proc = subprocess.run([sys.executable, "-m", "torchqkit", "eval", "--hf", str(tmp_path), "--config", "int8-wo",
                           "--quiet"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "python -m torchqkit eval: error:" in proc.stderr and "could not load" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_tied")
    tokenizer = tiny_tokenizer()
    # Tied: lm_head (300 x 32) stays float32 with a plain config, and reads more bytes than the quantized Linears.
    tiny_llama(len(tokenizer), tied=True).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_eval_says_when_the_float_output_layer_dominates(tied_checkpoint, checkpoint, capsys):
    _, text = checkpoint
    args = ["eval", "--hf", str(tied_checkpoint), "--text", str(text), "--quiet", *FAST]
    assert cli_main([*args, "--config", "int4-wo-g32"]) == 0
    out = capsys.readouterr().out
    note = next(line for line in out.splitlines() if line.startswith("note: "))
    # 300 x 32 float32 = 38.4 kB; 14 int4 g32 Linears (tiled, padded) read less than half of it
    assert note.startswith("note: lm_head (tied to model.embed_tokens) stays float32: 38.4 kB read per token, ")
    assert "x all 14 quantized Linears together" in note and "'int4-wo-g32-out8'" in note
    timed = next(line for line in out.splitlines() if line.startswith("float Linear left: lm_head"))
    ms, step_ms = _numbers("float Linear left: lm_head", out)[-2:]  # measured: positive, within the step
    assert "(float32, 300 x 32)" in timed and "1 matmul call per step (profiled in the decode loop)" in timed
    assert 0 < ms <= step_ms
    assert cli_main([*args, "--config", "int4-wo-g32-out8"]) == 0
    out8 = capsys.readouterr().out
    assert "note: " not in out8 and "float Linear" not in out8
    assert "Linears: 15 quantized, 0 skipped, 0 kept of 16; 1 x shares lm_head.weight" in out8
