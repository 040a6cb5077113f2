"""Fuzzing the loader: random mutations of a valid file (header JSON fields, safetensors tensor entries,
raw bytes, truncation) must end in CheckpointError or in a model that loads and runs. Anything else (another
exception type, a crash, a hang) fails the test. Seeded, so a failure reproduces."""
from __future__ import annotations

import copy
import faulthandler
import json
import random

import pytest
import torch

import torchqkit as qk

from .headers import read_header, write_header
from .models import meta_model, model_input, quantized_model

POOL = [None, True, False, 0, -1, 1, 2, 3, 7, 8, 32, 64, 65, 2 ** 31, 2 ** 63, 10 ** 30, 1.5, -0.0, float("nan"), "",
        "plain", "nf4", "mx", "tensor_core_tiled", "int8", "uint4", "fp4_e2m1", "float32", "bfloat16", "F32", "U8",
        "I32", "BOOL", "marlin", "none", "int", "float", "auto", "reference", "symmetric", "PerRow", [], [0], [1, 64],
        [64, 64], [64, 32], [2 ** 62, 2], [1, 0], [-1, 64], {}, {"type": "plain"}, {"type": "PerToken"}, "x" * 300]


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _mutate_json(obj, rng: random.Random):
    obj = copy.deepcopy(obj)
    paths = [p for p in _paths(obj) if p]
    for _ in range(rng.choice((1, 1, 2, 3))):
        path = rng.choice(paths)
        op = rng.random()
        try:
            parent = obj
            for key in path[:-1]:
                parent = parent[key]
            if op < 0.7:
                parent[path[-1]] = rng.choice(POOL)
            elif op < 0.85 and isinstance(parent, dict):
                del parent[path[-1]]
            elif isinstance(parent, dict):
                parent[path[-1] + rng.choice(("_", "x"))] = rng.choice(POOL)
        except (KeyError, IndexError, TypeError):
            pass  # the path vanished under an earlier mutation of this round
    return obj


def _variant(raw: bytes, rng: random.Random) -> bytes:
    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    kind = rng.random()
    if kind < 0.45:  # the torchqkit JSON inside __metadata__
        tq = json.loads(header["__metadata__"]["torchqkit"])
        header["__metadata__"]["torchqkit"] = json.dumps(_mutate_json(tq, rng))
    elif kind < 0.7:  # safetensors' own entries (shapes, dtypes, offsets, names)
        header = _mutate_json(header, rng)
    elif kind < 0.85:  # raw bytes of the header region (mostly invalid JSON / lengths)
        out = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(0, 8 + n)] = rng.randrange(256)
        return bytes(out)
    elif kind < 0.93:  # truncation anywhere
        return raw[:rng.randrange(len(raw))]
    else:  # data bytes: a valid file with other values must still load and run
        out = bytearray(raw)
        for _ in range(rng.randint(1, 16)):
            out[rng.randrange(8 + n, len(raw))] = rng.randrange(256)
        return bytes(out)
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


@pytest.mark.parametrize("seed", [0, 1])
def test_random_mutations_error_cleanly_or_load(tmp_path, seed):
    model = quantized_model()
    path = tmp_path / "model.safetensors"
    qk.save_quantized(model, path)
    raw = path.read_bytes()
    rng = random.Random(seed)
    x = model_input()
    outcomes = {"error": 0, "loaded": 0}
    faulthandler.dump_traceback_later(120, exit=True)  # a hang kills the run with a traceback
    try:
        for i in range(200):
            path.write_bytes(_variant(raw, rng))
            try:
                loaded = qk.load_quantized(meta_model(), path)
            except qk.CheckpointError:
                outcomes["error"] += 1
                continue
            except Exception as e:  # noqa: BLE001 - any other exception is the bug this test hunts
                pytest.fail(f"seed {seed} mutation {i}: {type(e).__name__}: {e}")
            with torch.no_grad():
                out = loaded(x)
            assert out.shape == (2, 5, 32)
            outcomes["loaded"] += 1
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert outcomes["error"] > 80 and outcomes["loaded"] > 5, outcomes


def test_index_mutations_error_cleanly_or_load(tmp_path):
    model = quantized_model()
    qk.save_quantized(model, tmp_path / "model.safetensors", max_shard_bytes=6000)
    index = tmp_path / "model.safetensors.index.json"
    text = index.read_text()
    rng = random.Random(3)
    x = model_input()
    outcomes = {"error": 0, "loaded": 0}
    for i in range(80):
        if rng.random() < 0.8:
            index.write_text(json.dumps(_mutate_json(json.loads(text), rng)))
        else:
            index.write_bytes(text.encode()[:rng.randrange(len(text))])
        try:
            loaded = qk.load_quantized(meta_model(), index)
        except qk.CheckpointError:
            outcomes["error"] += 1
            continue
        except Exception as e:  # noqa: BLE001 - any other exception is the bug this test hunts
            pytest.fail(f"index mutation {i}: {type(e).__name__}: {e}")
        with torch.no_grad():
            assert torch.equal(loaded(x), model(x))  # the index only points at shards: same weights or an error
        outcomes["loaded"] += 1
    assert outcomes["error"] > 40 and outcomes["loaded"] > 1, outcomes
