"""Peak memory (fresh processes, VmHWM after resetting it) of quantize_checkpoint and load_quantized on a
100 MB float32 checkpoint of 24 Linear(1024, 1024): loading stays at the quantized size, quantizing at a few
float tensors.
See test/serialization/peak_memory.py for the method."""
from __future__ import annotations

from .peak_memory import measure

MB = 1 << 20


def test_peak_memory_tracks_quantized_size(tmp_path):
    r = measure(tmp_path, layers=24, dim=1024)
    assert r["float_bytes"] > 95 * MB and r["quantized_bytes"] < 0.3 * r["float_bytes"]
    # load_quantized into a meta-device model: the packed tensors themselves, plus a little slack.
    assert r["load_delta"] < 1.15 * r["quantized_bytes"] + 8 * MB, r
    assert r["load_delta"] < 0.5 * r["float_bytes"], r
    # quantize_checkpoint: one float tensor, its quantization temporaries and its packed form at a time.
    assert r["quantize_delta"] < 8 * r["largest_tensor"] + 8 * MB, r
    assert r["quantize_delta"] < 0.5 * r["float_bytes"], r
