"""FIPO's future sums: ``F_t = sum_{s >= t} gamma^(s - t) v_s`` over a sequence's later positions.

``_core.segments.future_discounted_sums``: padded rows with a number ``gamma`` take a blocked
reverse cumulative sum (blocks of ``34 / -log gamma`` positions, the blocks joined by the doubling
scan); packed sequences and a tensor ``gamma`` take the doubling scan. Both against the float64
recursion of ``tests/reference.py`` on widths that span one block and several, for every kind of
discount (0, tiny, small, ms-swift's, near 1, 1); a NaN or infinity reaches the earlier positions
only.
"""

from __future__ import annotations

import math

import pytest
import torch

import reference
from rlobjectives._core.layout import packed_layout, padded
from rlobjectives._core.segments import future_discounted_sums
from tolerances import assert_close

F64 = torch.float64
MS_SWIFT_GAMMA = 2 ** (-1 / 32)  # its default decay rate 32: blocks of 1569 positions
GAMMAS = [0.0, 1e-12, 0.3, 0.5, 0.9, MS_SWIFT_GAMMA, 0.999, 1.0]


def _expected(values: torch.Tensor, gamma: float) -> list[list[float]]:
    return [reference.future_discounted_sums(row.tolist(), gamma) for row in values]


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("width", [1, 2, 7, 157, 3301])
def test_padded_rows_equal_the_recursion(gamma: float, width: int) -> None:
    # gamma .5: blocks of 49 (157 = 4 blocks), .3: 28, .9: 322, ms-swift's: 1569 (3301 = 3).
    values = torch.randn(3, width, dtype=F64, generator=torch.Generator().manual_seed(width))
    got = future_discounted_sums(values, padded(width), gamma)
    assert_close(got, _expected(values, gamma))
    tensor = future_discounted_sums(values, padded(width), torch.tensor(gamma, dtype=F64))
    assert_close(tensor, got)  # the doubling scan, for a tensor gamma


def test_float32_rows_are_within_float32_rounding() -> None:
    values = torch.randn(4, 4096, generator=torch.Generator().manual_seed(0)) * 0.3
    got = future_discounted_sums(values, padded(4096), MS_SWIFT_GAMMA)
    assert got.dtype == torch.float32
    assert_close(got, _expected(values.double(), MS_SWIFT_GAMMA), dtype=torch.float32)


def test_golden_two_blocks() -> None:
    # gamma = e^-17: blocks of int(34 / 17) = 2 positions. v = [1, 2, 4]: F_2 = 4,
    # F_1 = 2 + 4 g, F_0 = 1 + 2 g + 4 g^2 (the third position alone in the second block).
    g = math.exp(-17.0)
    got = future_discounted_sums(torch.tensor([[1.0, 2.0, 4.0]], dtype=F64), padded(3), g)
    assert_close(got, [[1 + 2 * g + 4 * g * g, 2 + 4 * g, 4.0]])


def test_packed_sequences_equal_their_rows() -> None:
    lengths = [5, 0, 160, 1, 61]
    values = torch.randn(sum(lengths), dtype=F64, generator=torch.Generator().manual_seed(1))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    got = future_discounted_sums(values[None], packed_layout(cu_seqlens, len(values)), 0.5)
    pieces = values.split(lengths)
    want = [x for piece in pieces for x in reference.future_discounted_sums(piece.tolist(), 0.5)]
    assert_close(got, [want])


@pytest.mark.parametrize("gamma", [0.5, 0.9])
def test_a_non_finite_value_reaches_the_earlier_positions_only(gamma: float) -> None:
    # Row 0: +inf at 120; row 1: -inf at 7; row 2: NaN at 250; row 3: +inf at 40 and -inf at 90
    # (NaN up to 40, -inf from 41 to 90). After each, the sums equal those without it, bit for bit.
    inf, nan = math.inf, math.nan
    values = torch.randn(4, 300, generator=torch.Generator().manual_seed(2))
    hostile = values.clone()
    for row, position, value in [(0, 120, inf), (1, 7, -inf), (2, 250, nan), (3, 40, inf)]:
        hostile[row, position] = value
    hostile[3, 90] = -inf
    clean = torch.where(hostile.isfinite(), hostile, 0.0)
    got = future_discounted_sums(hostile, padded(300), gamma)
    base = future_discounted_sums(clean, padded(300), gamma)
    assert (got[0, :121] == inf).all() and torch.equal(got[0, 121:], base[0, 121:])
    assert (got[1, :8] == -inf).all() and torch.equal(got[1, 8:], base[1, 8:])
    assert got[2, :251].isnan().all() and torch.equal(got[2, 251:], base[2, 251:])
    assert got[3, :41].isnan().all() and (got[3, 41:91] == -inf).all()
    assert torch.equal(got[3, 91:], base[3, 91:])
