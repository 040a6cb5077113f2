"""from_gguf trusts nothing in the file (Note [Checked GGUF files], torchqkit/integrations/gguf_checks.py): tensor
records, hyperparameters and block scales are checked before anything is built or decoded, and every problem is
one GGUFError naming the file and the tensor or metadata key."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

import torchqkit as qk

from ..integrations.tiny_gguf import write_tiny_llama

pytest.importorskip("gguf")


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_llama(tmp_path / "tiny.gguf")


def _edit(path, edit):
    """Apply ``edit(reader)`` to the file in place (gguf-py's reader in read-write mode maps the file)."""
    import gguf
    reader = gguf.GGUFReader(path, "r+")
    edit(reader)
    reader.data.flush()
    del reader
    return path


def _tensor(reader, name):
    return next(t for t in reader.tensors if t.name == name)


def _set_offset(name, value_of):
    def edit(reader):
        t = _tensor(reader, name)
        t.field.parts[5][0] = value_of(reader)
    return edit


def _raises(path, *words):
    with pytest.raises(qk.GGUFError) as err:
        qk.from_gguf(path)
    message = str(err.value)
    assert str(path) in message
    for w in words:
        assert w in message, message
    return message


def _relative_offset(reader, name):
    return _tensor(reader, name).data_offset - reader.data_offset


def test_two_tensors_on_the_same_bytes_are_refused(tiny):
    _edit(tiny, _set_offset("blk.0.attn_k.weight", lambda r: _relative_offset(r, "blk.0.attn_q.weight")))
    _raises(tiny, "overlap", "blk.0.attn_q.weight", "blk.0.attn_k.weight")


def test_a_tensor_running_into_the_next_one_is_refused(tiny):
    # attn_k starts 32 bytes (aligned) after attn_q does: attn_q's type claims more than the gap
    _edit(tiny, _set_offset("blk.0.attn_k.weight", lambda r: _relative_offset(r, "blk.0.attn_q.weight") + 32))
    _raises(tiny, "overlap")


def test_a_tensor_past_the_end_of_the_file_is_refused(tiny):
    size = os.path.getsize(tiny)
    _edit(tiny, _set_offset("output_norm.weight", lambda r: (size - r.data_offset) // 32 * 32))
    _raises(tiny, "output_norm.weight", "past the end")


def test_a_truncated_file_names_the_tensor_it_cuts(tiny):
    data = tiny.read_bytes()
    tiny.write_bytes(data[:len(data) - 100])
    _raises(tiny, "output_norm.weight", "past the end")


def test_a_misaligned_offset_is_refused(tiny):
    _edit(tiny, _set_offset("output_norm.weight", lambda r: _relative_offset(r, "output_norm.weight") + 4))
    _raises(tiny, "output_norm.weight", "alignment")


def test_an_unknown_tensor_type_is_refused_naming_the_tensor(tiny):
    def edit(reader):
        _tensor(reader, "blk.1.ffn_up.weight").field.parts[4][0] = 250
    _edit(tiny, edit)
    _raises(tiny, "blk.1.ffn_up.weight", "unknown GGML type 250")


@pytest.mark.parametrize("name, fmt, at", [("blk.0.attn_q.weight", "Q4_0", 0), ("blk.0.attn_k.weight", "Q4_1", 2),
                                           ("token_embd.weight", "Q8_0", 0), ("blk.0.ffn_down.weight", "Q4_K", 0),
                                           ("blk.1.ffn_down.weight", "Q6_K", 208)])
@pytest.mark.parametrize("bad", [0x7E00, 0x7C00], ids=["nan", "inf"])
def test_non_finite_block_scales_and_mins_are_refused(tiny, name, fmt, at, bad):
    def edit(reader):
        t = _tensor(reader, name)
        assert t.tensor_type.name == fmt
        t.data.reshape(-1)[at:at + 2] = np.frombuffer(np.uint16(bad).tobytes(), np.uint8)
    _edit(tiny, edit)
    _raises(tiny, name, "NaN or Inf")


def _set_field(key, value):
    def edit(reader):
        reader.fields[key].parts[-1][0] = value
    return edit


@pytest.mark.parametrize("key, value, words", [
    ("llama.block_count", 10**9, ["llama.block_count", "must be in"]),
    ("llama.block_count", 3, ["llama.block_count = 3", "layers 0..1"]),
    ("llama.embedding_length", 1 << 31, ["llama.embedding_length", "token_embd.weight"]),
    ("llama.feed_forward_length", 255, ["llama.feed_forward_length = 255", "ffn_up"]),
    ("llama.attention.head_count", 0, ["llama.attention.head_count = 0", "must be in"]),
    ("llama.attention.head_count", 3, ["llama.attention.head_count = 3", "not a multiple"]),
    ("llama.attention.head_count_kv", 0, ["llama.attention.head_count_kv = 0"]),
    ("llama.attention.head_count_kv", 3, ["not a multiple of llama.attention.head_count_kv = 3"]),
    ("llama.attention.head_count", 8, ["8 query and 2 KV heads"]),
    ("llama.context_length", 0, ["llama.context_length = 0"]),
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), ["llama.attention.layer_norm_rms_epsilon"]),
    ("llama.vocab_size", 95, ["llama.vocab_size = 95"]),
])
def test_hyperparameters_are_checked_against_the_tensors_before_building(tiny, key, value, words):
    _edit(tiny, _set_field(key, value))
    start = time.perf_counter()
    _raises(tiny, *words)
    assert time.perf_counter() - start < 10  # fails fast: no model of a billion layers is built


def test_a_symlinked_gguf_file_is_refused(tiny, tmp_path):
    link = tmp_path / "link.gguf"
    link.symlink_to(tiny)
    _raises(link, "symbolic link")
    assert qk.from_gguf(tiny) is not None  # the file itself loads
