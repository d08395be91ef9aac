r"""Forward kernel of ``kl_penalized_rewards``: per-sequence sums of the masked log-ratio.

Program ``i`` reads sequence ``i`` in blocks of ``BLOCK`` tokens and writes
:math:`D_i = \sum_t M_{it} (\ell_{it} - \ell^{ref}_{it})` and :math:`\tilde r_i = r_i - \beta D_i`
(float32). Sequence ``i`` is row ``i`` of ``(B, T)`` tensors (rows may be strided), or with
``PACKED`` the tokens ``offsets[i]:offsets[i + 1]`` of one packed row (``cu_seqlens``).
Unselected tokens are zeros before the subtraction (``tl.where``): NaN/inf there reaches nothing.
"""

import triton
import triton.language as tl


@triton.jit
def kl_rewards_kernel(
    policy_ptr, reference_ptr, rewards_ptr, mask_ptr, offsets_ptr, divergence_ptr, penalized_ptr,
    tokens, policy_row_stride, reference_row_stride, mask_row_stride, beta,
    PACKED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Sequence ``program_id(0)``: ``D_i`` and ``r_i - beta D_i``."""
    row = tl.program_id(0).to(tl.int64)
    if PACKED:  # one packed row: the sequence's run of tokens
        first = tl.load(offsets_ptr + row).to(tl.int64)
        last = tl.load(offsets_ptr + row + 1).to(tl.int64)
        policy_row = policy_ptr
        reference_row = reference_ptr
        mask_row = mask_ptr
    else:
        first = 0
        last = tokens
        policy_row = policy_ptr + row * policy_row_stride
        reference_row = reference_ptr + row * reference_row_stride
        mask_row = mask_ptr + row * mask_row_stride
    total = tl.zeros((BLOCK,), tl.float32)
    for start in range(first, last, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        inside = columns < last
        selected = (tl.load(mask_row + columns, mask=inside, other=0) != 0) & inside
        policy = tl.load(policy_row + columns, mask=inside, other=0.0)
        reference = tl.load(reference_row + columns, mask=inside, other=0.0)
        policy = tl.where(selected, policy.to(tl.float32), 0.0)
        reference = tl.where(selected, reference.to(tl.float32), 0.0)
        total += policy - reference
    divergence = tl.sum(total, axis=0)
    reward = tl.load(rewards_ptr + row).to(tl.float32)
    tl.store(divergence_ptr + row, divergence)
    tl.store(penalized_ptr + row, reward - beta * divergence)
