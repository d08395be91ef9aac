"""The context-parallel plumbing in one process: validation, the no-group identities, the layout's
local helpers and the carry fold of the reverse scans (golden values, arithmetic in comments).

The collectives themselves run with real ranks in tests/distributed/test_context_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

import rlobjectives as rlo
from rlobjectives._core.context import carry_from_later_ranks, context_max, context_sum
from rlobjectives._core.layout import packed_layout, padded
from rlobjectives._core.validation import validate_context_group


def test_no_group_is_none_and_no_collective() -> None:
    assert validate_context_group(None) is None
    values = torch.tensor([1.0, 2.0])
    assert context_sum(None, values)[0] is values  # returned as given
    assert context_max(None, values) is values
    layout = padded(2)
    assert layout.combine(values)[0] is values


@pytest.mark.parametrize("value", ["cp", 0, 1.5, [0, 1], object()])
def test_a_group_that_is_not_a_process_group_is_a_type_error(value: object) -> None:
    with pytest.raises(TypeError, match=r"^context_group must be a torch.distributed.ProcessGroup"):
        validate_context_group(value)


def test_non_group_member_is_named() -> None:
    # new_group returns GroupMember.NON_GROUP_MEMBER (-100) to the ranks outside the group
    with pytest.raises(ValueError, match=r"^context_group must contain this rank"):
        validate_context_group(torch.distributed.GroupMember.NON_GROUP_MEMBER)


def test_public_functions_name_context_group_without_a_process_group() -> None:
    zeros, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"^context_group"):
        rlo.policy_loss(zeros, zeros, torch.zeros(1), mask, context_group="world")
    with pytest.raises(TypeError, match=r"^context_group"):
        rlo.gae(zeros, zeros, mask, gamma=1.0, lam=1.0, context_group=1)


def test_first_and_local_last_selected_padded_and_packed() -> None:
    mask = torch.tensor([[False, True, True, False], [False, False, False, False]])
    layout = padded(2)
    # row 0: selected at 1 and 2 (first 1, last 2); row 1: nothing
    assert layout.first_selected(mask).tolist() == [[False, True, False, False], [False] * 4]
    assert layout.local_last_selected(mask).tolist() == [[False, False, True, False], [False] * 4]
    packed = packed_layout(torch.tensor([0, 3, 3, 6]), 6)  # sequences of 3, 0 and 3 tokens
    flat = torch.tensor([[True, False, True, False, True, True]])
    # sequence 0: tokens 0..2 selected at 0, 2; sequence 2: tokens 3..5 selected at 4, 5
    assert packed.first_selected(flat).tolist() == [[True, False, False, False, True, False]]
    assert packed.local_last_selected(flat).tolist() == [[False, False, True, False, False, True]]


def test_carry_fold_golden() -> None:
    # REINFORCE++-style carry, discount 0.5: state [holds, G0 at first token, P at first token].
    # Three chunks of one sequence; this rank is 0, so chunks 2 then 1 are folded:
    # chunk 2: holds, G0 = 4, P = 0.25 -> G_first = 4 + 0.25 * 0.5 * 0 = 4
    # chunk 1: holds nothing -> carry unchanged (4)
    # carry into chunk 0: 4; its correction gamma * 4 = 2
    states = torch.tensor([[[1.0, 9.0, 1.0]], [[0.0, 0.0, 0.0]], [[1.0, 4.0, 0.25]]])

    def step(state: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
        start = state[:, 1] + state[:, 2] * 0.5 * carry[:, 0]
        return torch.where(state[:, :1] > 0, start.unsqueeze(-1), carry)

    carry = carry_from_later_ranks(states, 0, torch.zeros(1, 1), step)
    assert carry.tolist() == [[4.0]]
    # the last rank has no later chunk: the start, still connected to the states (zero weight)
    states.requires_grad_(True)
    last = carry_from_later_ranks(states, 2, torch.zeros(1, 1), step)
    assert last.tolist() == [[0.0]] and last.requires_grad


def test_selected_after_golden() -> None:
    # padded row [1, 0, 1, 1]: after t = 0 two (2, 3), after 1 two, after 2 one, after 3 none
    mask = torch.tensor([[True, False, True, True]])
    assert padded(1).local_selected_after(mask).tolist() == [[2, 2, 1, 0]]
    # packed sequences [1, 1] and [0, 1, 1]: counted within each sequence only
    layout = packed_layout(torch.tensor([0, 2, 5]), 5)
    flat = torch.tensor([[True, True, False, True, True]])
    assert layout.local_selected_after(flat).tolist() == [[1, 0, 2, 1, 0]]
    assert padded(2).local_selected_after(torch.zeros(2, 0, dtype=torch.bool)).shape == (2, 0)
