"""Kernel routes chosen by measurement (Note [Routes chosen by measurement] in csrc/cpu/route_choice.cpp): the first
call of a case times its routes and keeps the fastest, later calls give the same numbers, pins and
TORCHQKIT_CPU_ROUTES=rules skip the measuring, and kernels.save_routes / load_routes keep the table under its key."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import torchqkit as qk
from torchqkit import kernels
from torchqkit.kernels.reference import linear_int4wo_tiled_ref, linear_int8wo_plain_ref

from cpu_kernel_testing import assert_rel, cpu_levels, gen, needs_kernel

INT4 = torch.ops.torchqkit.linear_int4wo_tiled
INT8 = torch.ops.torchqkit.linear_int8wo_plain
INT4_LEVELS = cpu_levels("torchqkit::linear_int4wo_tiled", with_avx_vnni=True)
INT8_LEVELS = cpu_levels("torchqkit::linear_int8wo_plain")
# The int4 decode has a float32 and an int16-pair kernel at the AVX-VNNI level and at the AVX-512 levels.
DECODE_LEVEL = next((lv for lv in ("avx512_vnni", "avx_vnni") if lv in INT4_LEVELS), None)
# The float32 prefill has the panels and the sgemm route at the avx512_vnni and avx2 levels.
PREFILL_LEVEL = next((lv for lv in ("avx512_vnni", "avx2") if lv in INT8_LEVELS), None)
needs_decode_routes = pytest.mark.skipif(DECODE_LEVEL is None, reason="no AVX-VNNI or AVX-512 level on this CPU")
needs_prefill_routes = needs_kernel(INT8_LEVELS)
PINS = ("TORCHQKIT_CPU_ROUTES", "TORCHQKIT_CPU_FP32_PREFILL", "TORCHQKIT_CPU_INT4_DECODE", "TORCHQKIT_CPU_ISA")


@pytest.fixture(autouse=True)
def empty_table(monkeypatch):
    for name in PINS:
        monkeypatch.delenv(name, raising=False)
    kernels.clear_routes()
    yield
    kernels.clear_routes()


def _int4(n=256, k=512, g=32, t=8):
    w = torch.randn(n, k, generator=gen(0))
    tiled = qk.quantize_weight(w, qk.qdtypes.uint4, qk.PerGroup(g), qk.TensorCoreTiledLayout(inner_k_tiles=t),
                               mapping="asymmetric", zero_point_domain="float")
    return lambda x: (x, tiled.qdata, tiled.scale_and_zero, g, n, None)


def _int8(n=96, k=256):
    q = torch.randint(-127, 128, (n, k), generator=gen(0), dtype=torch.int8)
    s = torch.rand(n, 1, generator=gen(1)) / 100 + 1e-3
    return lambda x: (x, q, s, None)


def _one(site):
    rows = [r for r in kernels.routes() if r["site"] == site]
    assert len(rows) == 1, kernels.routes()
    return rows[0]


@needs_decode_routes
def test_first_int4_decode_times_both_kernels_and_keeps_the_faster(monkeypatch):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", DECODE_LEVEL)
    args = _int4()
    x = torch.randn(1, 512, generator=gen(2))
    first = INT4(*args(x))
    row = _one("int4_decode")
    assert (row["op"], row["isa"], row["m"], row["n"], row["k"]) == ("torchqkit::linear_int4wo_tiled", DECODE_LEVEL,
                                                                      "1", 256, 512)
    assert set(row["median_us"]) == {"float", "int16"} and all(t > 0 for t in row["median_us"].values())
    assert row["choice"] == min(row["median_us"], key=row["median_us"].get)
    assert row["rule"] == ("int16" if DECODE_LEVEL == "avx_vnni" else "float") and not row["loaded"]
    assert row["threads"] == torch.get_num_threads() and row["dtype"] == "Float"
    # every call of the case gives the kept route's numbers, the first one included
    assert torch.equal(INT4(*args(x)), first)
    monkeypatch.setenv("TORCHQKIT_CPU_INT4_DECODE", row["choice"])
    assert torch.equal(INT4(*args(x)), first)
    # both routes are exact to the reference's tolerance (test_linear_int4.py covers every case)
    for route in ("float", "int16"):
        monkeypatch.setenv("TORCHQKIT_CPU_INT4_DECODE", route)
        assert_rel(INT4(*args(x)), linear_int4wo_tiled_ref(*args(x)), 2e-5, route)
    assert len(kernels.routes()) == 1  # pinned calls measure nothing


@needs_decode_routes
def test_cases_are_kept_apart_by_rows_shape_and_threads(monkeypatch):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", DECODE_LEVEL)
    small, large = _int4(n=64, k=256), _int4(n=128, k=256)
    INT4(*small(torch.randn(1, 256)))
    INT4(*small(torch.randn(1, 256)))  # the same case: not measured again
    INT4(*large(torch.randn(1, 256)))
    INT4(*small(torch.randn(3, 256)))  # M = 3: one kernel only, nothing to measure, nothing kept
    assert sorted((r["n"], r["m"]) for r in kernels.routes()) == [(64, "1"), (128, "1")]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        INT4(*small(torch.randn(1, 256)))
    finally:
        torch.set_num_threads(threads)
    assert sorted(r["threads"] for r in kernels.routes() if r["n"] == 64) == sorted({1, threads})


@needs_prefill_routes
def test_prefill_route_measured_per_class_of_m(monkeypatch):
    if PREFILL_LEVEL is None:
        pytest.skip("no avx512_vnni or avx2 level")
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", PREFILL_LEVEL)
    args = _int8()
    x64, x100 = torch.randn(64, 256, generator=gen(3)), torch.randn(100, 256, generator=gen(4))
    out64 = INT8(*args(x64))
    INT8(*args(x100))  # M = 64..127: the same class, measured once
    row = _one("fp32_prefill")
    assert row["m"] == "64-127" and set(row["median_us"]) == {"panels", "sgemm"}
    assert row["choice"] == min(row["median_us"], key=row["median_us"].get)
    monkeypatch.setenv("TORCHQKIT_CPU_FP32_PREFILL", row["choice"])
    assert torch.equal(INT8(*args(x64)), out64)
    assert_rel(out64, linear_int8wo_plain_ref(*args(x64)), 2e-5, "measured route")
    monkeypatch.delenv("TORCHQKIT_CPU_FP32_PREFILL")
    INT8(*args(torch.randn(8, 256)))  # below the prefill: the dot kernel only
    assert [r["m"] for r in kernels.routes()] == ["64-127"]


@needs_decode_routes
def test_rules_mode_measures_nothing_and_takes_the_rule(monkeypatch):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", DECODE_LEVEL)
    monkeypatch.setenv("TORCHQKIT_CPU_ROUTES", "rules")
    args = _int4()
    x = torch.randn(1, 512, generator=gen(2))
    by_rule = INT4(*args(x))
    assert kernels.routes() == []
    monkeypatch.setenv("TORCHQKIT_CPU_INT4_DECODE", "int16" if DECODE_LEVEL == "avx_vnni" else "float")
    assert torch.equal(INT4(*args(x)), by_rule)


@needs_decode_routes
def test_bad_settings_are_errors_naming_the_choices(monkeypatch):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", DECODE_LEVEL)
    args = _int4()
    x = torch.randn(1, 512)
    monkeypatch.setenv("TORCHQKIT_CPU_INT4_DECODE", "fast")
    with pytest.raises(RuntimeError, match="TORCHQKIT_CPU_INT4_DECODE=fast is not one of float, int16, bf16"):
        INT4(*args(x))
    monkeypatch.delenv("TORCHQKIT_CPU_INT4_DECODE")
    monkeypatch.setenv("TORCHQKIT_CPU_ROUTES", "fastest")
    with pytest.raises(RuntimeError, match="TORCHQKIT_CPU_ROUTES=fastest is not one of measure, rules"):
        INT4(*args(x))
    assert kernels.routes() == []


@needs_decode_routes
def test_save_and_load_keep_the_table_under_its_key(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", DECODE_LEVEL)
    args = _int4()
    x = torch.randn(1, 512, generator=gen(2))
    out = INT4(*args(x))
    measured = _one("int4_decode")
    path = tmp_path / "routes.json"
    assert kernels.save_routes(path) == 1
    saved = json.loads(path.read_text())
    assert saved["key"] == kernels.route_cache_key() and saved["key"]["extension"]
    kernels.clear_routes()
    assert kernels.routes() == [] and kernels.load_routes(path) == 1
    loaded = _one("int4_decode")
    assert loaded["loaded"] and (loaded["key"], loaded["choice"]) == (measured["key"], measured["choice"])
    assert torch.equal(INT4(*args(x)), out) and _one("int4_decode")["loaded"]  # taken, not measured again
    rows = [r for r in kernels.status() if r["layout"] == "(route)"]
    assert rows and rows[0]["path"] == f"int4_decode: {measured['choice']}" and "loaded" in rows[0]["why"]
    # another CPU's (or torch's, torchqkit's, the extension's) table is not taken
    saved["key"]["cpu"] = "Some Other CPU"
    path.write_text(json.dumps(saved))
    kernels.clear_routes()
    with pytest.warns(UserWarning, match="not loaded, the table was measured under another key .*cpu: file "
                                         "'Some Other CPU'"):
        assert kernels.load_routes(path) == 0
    assert kernels.routes() == []
    path.write_text("{\"routes\": []}")
    with pytest.raises(ValueError, match="routes.json is not a route table .* needs 'key' and 'routes'"):
        kernels.load_routes(path)


@needs_decode_routes
def test_status_lists_measured_routes_with_their_times(monkeypatch):
    monkeypatch.setenv("TORCHQKIT_CPU_ISA", DECODE_LEVEL)
    args = _int4()
    INT4(*args(torch.randn(1, 512)))
    [row] = [r for r in kernels.status() if r["layout"] == "(route)"]
    assert row["linear"].startswith(f"torchqkit::linear_int4wo_tiled {DECODE_LEVEL} Float M 1 N 256 K 512")
    assert "measured at the first call: float " in row["why"] and ", int16 " in row["why"]


@needs_decode_routes
def test_route_cache_variable_loads_at_import_and_writes_at_exit(tmp_path):
    path = tmp_path / "cache.json"
    script = ("import torch, torchqkit as qk\n"
              "w = qk.quantize_weight(torch.randn(64, 256), qk.qdtypes.uint4, qk.PerGroup(32),"
              " qk.TensorCoreTiledLayout(inner_k_tiles=8), mapping='asymmetric', zero_point_domain='float')\n"
              "torch.ops.torchqkit.linear_int4wo_tiled(torch.randn(1, 256), w.qdata, w.scale_and_zero, 32, 64, None)\n"
              "print([r['loaded'] for r in qk.kernels.routes()])\n")
    env = {k: v for k, v in os.environ.items() if k not in PINS}
    env.update(TORCHQKIT_CPU_ROUTE_CACHE=str(path), TORCHQKIT_CPU_ISA=DECODE_LEVEL)
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert first.stdout.strip() == "[False]" and path.exists()
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert second.stdout.strip() == "[True]", second.stderr
