"""csrc/common/dequant.h (the bit-unpacking helpers the CUDA kernels share) on the host: compiled with the
C++ compiler into csrc/common/dequant_selftest.cpp and compared bit for bit with torch's own float8
conversions, the oracle's NF4 / e2m1 tables, and the tiled-int4 packing of TensorCoreTiledLayout."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import torchqkit as qk
from torchqkit.core.qdtype import fp4_e2m1, nf4
from torchqkit.kernels.reference import int4_tiled_codes

ROOT = Path(__file__).resolve().parents[3]
CXX = shutil.which("c++") or shutil.which("g++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler to build csrc/common/dequant_selftest.cpp")


@pytest.fixture(scope="module")
def selftest(tmp_path_factory):
    exe = tmp_path_factory.mktemp("common") / "dequant_selftest"
    subprocess.run([CXX, "-std=c++17", "-O1", "-Wall", "-Werror", "-I", str(ROOT / "csrc" / "common"),
                    str(ROOT / "csrc" / "common" / "dequant_selftest.cpp"), "-o", str(exe)], check=True)
    return exe


def _run(exe, *args) -> str:
    return subprocess.run([str(exe), *map(str, args)], check=True, capture_output=True, text=True).stdout


def _bits(values: torch.Tensor) -> list[str]:
    return [f"{v & 0xFFFFFFFF:08x}" for v in values.float().contiguous().view(torch.int32).tolist()]


def _table(out: str, name: str) -> list[str]:
    return [line.split()[2] for line in out.splitlines() if line.split()[0] == name]


def test_element_decoders_match_torch_and_the_oracle(selftest):
    out = _run(selftest, "tables")
    every_byte = torch.arange(256, dtype=torch.uint8)
    for name, dtype in (("e4m3fn", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2),
                        ("e4m3fnuz", torch.float8_e4m3fnuz), ("e5m2fnuz", torch.float8_e5m2fnuz)):
        want, got = _bits(every_byte.view(dtype)), _table(out, name)
        nan = every_byte.view(dtype).float().isnan().tolist()
        assert [g for g, n in zip(got, nan) if not n] == [w for w, n in zip(want, nan) if not n], name
        assert all(int(g, 16) & 0x7F800000 == 0x7F800000 and int(g, 16) & 0x7FFFFF for g, n in zip(got, nan) if n)
    e8m0 = torch.where(every_byte == 0, 2.0 ** -127, torch.exp2(every_byte.double() - 127)).float()
    assert _table(out, "e8m0")[:255] == _bits(e8m0)[:255] and int(_table(out, "e8m0")[255], 16) == 0x7FC00000
    assert _table(out, "e2m1") == _bits(torch.tensor(fp4_e2m1.levels))
    assert _table(out, "nf4") == _bits(torch.tensor(nf4.levels))
    # The tables the CPU kernels load (TORCHQKIT_NF4_LEVELS / TORCHQKIT_FP4_E2M1_LEVELS): the same bits.
    assert _table(out, "nf4_table") == _bits(torch.tensor(nf4.levels))
    assert _table(out, "e2m1_table") == _bits(torch.tensor(fp4_e2m1.levels))
    codes = {line.split()[0] + line.split()[1]: int(line.split()[2]) for line in out.splitlines() if "_code" in line}
    assert [codes[f"nf4_code{k}"] for k in range(4)] == [1, 15, 10, 2]
    assert [codes[f"mxfp4_code{k}"] for k in range(4)] == [15, 1, 2, 10]
    assert "int4_dequant " + _bits(torch.tensor([(3 - 8) * 0.5 + 0.25]))[0] in out
    assert "nf4_dq_absmax " + _bits(torch.tensor([-3 * 0.125 + 1.0]))[0] in out


@pytest.mark.parametrize("mode", ["tiled", "pairs"])
@pytest.mark.parametrize("tiles", [2, 4, 8])
def test_int4_tiled_positions_match_the_layout(selftest, tmp_path, mode, tiles):
    """Every code of a real TensorCoreTiledLayout weight, read per element and through the mma pair view."""
    lin = torch.nn.Linear(2 * 16 * tiles, 19, bias=False)
    qk.quantize_(lin, qk.Int4WeightOnlyConfig(group_size=32, layout=qk.TensorCoreTiledLayout(inner_k_tiles=tiles)))
    q = lin.weight.qdata
    path = tmp_path / "q.bin"
    path.write_bytes(q.contiguous().numpy().tobytes())
    got = [[int(v) for v in line.split()] for line in _run(selftest, mode, path, q.shape[0] * 8, q.shape[1],
                                                               q.shape[3]).splitlines()]
    want = int4_tiled_codes(q).long()
    assert torch.tensor(got).equal(want)
    assert want[:19, :lin.in_features].equal(lin.weight.qlayout.unpack(lin.weight).qdata.long())


@pytest.mark.parametrize("tiles", [2, 8])
def test_mma_kernel_b_fragments_hold_the_right_codes(selftest, tmp_path, tiles):
    """The int4 mma kernel's B path (int4_tiled_lane_word + int4_tiled_pair + mma_b_coord, as in
    csrc/cuda/int4_tiled_mma.cu): every element a lane feeds mma.sync is the code of the (n, k) the PTX
    fragment layout puts there, and together the lanes cover every code exactly once."""
    lin = torch.nn.Linear(2 * 16 * tiles, 19, bias=False)
    qk.quantize_(lin, qk.Int4WeightOnlyConfig(group_size=32, layout=qk.TensorCoreTiledLayout(inner_k_tiles=tiles)))
    q = lin.weight.qdata
    path = tmp_path / "q.bin"
    path.write_bytes(q.contiguous().numpy().tobytes())
    rows = torch.tensor([[int(v) for v in line.split()] for line in
                         _run(selftest, "fragments", path, q.shape[0] * 8, q.shape[1], q.shape[3]).splitlines()])
    codes = int4_tiled_codes(q).long()
    assert len(rows) == codes.numel() and len(set(map(tuple, rows[:, :2].tolist()))) == codes.numel()
    assert rows[:, 2].equal(codes[rows[:, 0], rows[:, 1]])


def test_mma_fragment_coordinates_tile_each_matrix_once(selftest):
    """Across the 32 lanes, A covers the 16 x 16 tile, B the 16 x 8 (k x n) and C the 16 x 8 tile exactly once."""
    out = [line.split() for line in _run(selftest, "coords").splitlines()]
    for name, shape in (("A", (16, 16)), ("B", (16, 8)), ("C", (16, 8))):
        cells = [(int(r), int(c)) for kind, r, c in out if kind == name]
        assert sorted(cells) == [(r, c) for r in range(shape[0]) for c in range(shape[1])], name
