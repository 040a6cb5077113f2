"""Note [N:M sparse storage]: masks, packing and its inverse, exact bytes."""
import pytest
import torch

from torchqkit.layouts.nm_format import check_nm_mask, nm_columns, nm_mask, pack_nm, position_bits, unpack_nm


def test_position_bits():
    assert [position_bits(m) for m in (2, 4, 8, 16, 3)] == [1, 2, 3, 4, 2]


def test_mask_keeps_top_n_per_block_lower_column_on_ties():
    s = torch.tensor([[1.0, 5.0, 3.0, 5.0, 0.0, 0.0, 0.0, 2.0]])
    assert nm_mask(s, 2, 4).tolist() == [[False, True, False, True, True, False, False, True]]


def test_pack_2_4_bytes():
    w = torch.tensor([[0.0, 7.0, 0.0, 8.0, 1.0, 0.0, 2.0, 0.0]])
    kept, pos = pack_nm(w, w != 0, 2, 4)
    assert kept.tolist() == [[7.0, 8.0, 1.0, 2.0]]
    # positions 1, 3, 0, 2 as 2-bit fields, least significant first
    assert pos.tolist() == [[1 | 3 << 2 | 0 << 4 | 2 << 6]]
    assert nm_columns(pos, 2, 4, 8).tolist() == [[1, 3, 4, 6]]


def test_underfull_block_keeps_explicit_zeros():
    w = torch.tensor([[0.0, 0.0, 0.0, 4.0]])
    kept, pos = pack_nm(w, w != 0, 2, 4)
    assert kept.tolist() == [[4.0, 0.0]]
    assert torch.equal(unpack_nm(kept, pos, 2, 4, 4), w)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8), (2, 8), (3, 16)])
def test_round_trip(n, m):
    g = torch.Generator().manual_seed(n * 100 + m)
    w = torch.randn(6, 4 * m, generator=g)
    mask = nm_mask(w.abs(), n, m)
    kept, pos = pack_nm(w, mask, n, m)
    assert kept.shape == (6, 4 * n) and pos.dtype == torch.uint8
    assert pos.shape[1] == -(-4 * n * position_bits(m) // 8)
    assert torch.equal(unpack_nm(kept, pos, n, m, 4 * m), w * mask)
    codes = torch.randint(-8, 8, (6, 4 * m), generator=g, dtype=torch.int8)
    kept_c, pos_c = pack_nm(codes, mask, n, m)
    assert kept_c.dtype == torch.int8
    assert torch.equal(unpack_nm(kept_c, pos_c, n, m, 4 * m), torch.where(mask, codes, torch.zeros_like(codes)))


def test_bad_input():
    with pytest.raises(ValueError, match=r"\(4, 4\) is not an N:M pattern"):
        nm_mask(torch.ones(2, 8), 4, 4)
    with pytest.raises(ValueError, match="divisible by 4"):
        nm_mask(torch.ones(2, 6), 2, 4)
    bad = torch.tensor([[True, True, True, False]])
    with pytest.raises(ValueError, match=r"row 0, block 0 \(columns 0..3\) keeps 3 values"):
        check_nm_mask(bad, 2, 4)
    with pytest.raises(ValueError, match="bool tensor"):
        pack_nm(torch.ones(1, 4), torch.ones(1, 4), 2, 4)
