r"""LM-head kernels: log-probabilities and entropy from ``hidden @ weight.T`` without logits.

With :math:`z = \mathrm{cap}_c(s(h W^\top + b)) / \tau` (never stored; the logit scale
:math:`s`, the softcap :math:`\mathrm{cap}_c(u) = c \tanh(u/c)` when ``HAS_SOFTCAP``, the
temperature one number or one per row when ``ROW_TEMPERATURE``; the product accumulated in
float32, rounded to the input dtype first when ``ROUND``), :math:`\mathrm{lse} = \log\sum_v
e^{z_v}`, :math:`\ell = z_y - \mathrm{lse}`, :math:`p = e^{z - \mathrm{lse}}`,
:math:`H = -\sum_v p_v \log p_v`:

- :func:`lse_partial_kernel`: one program per (row block, vocabulary split) walks the split's
  vocabulary blocks, forming each ``(BLOCK_N, BLOCK_V)`` logits tile in registers (``tl.dot``
  over ``BLOCK_H`` slices of the hidden width, float32 accumulation) and folding it into an
  online log-sum-exp: running max :math:`m`, :math:`s = \sum e^{z - m}`,
  :math:`t = \sum e^{z - m} (z - m)` (for the entropy) and the target logit.
- :func:`lse_combine_kernel`: merges the splits into ``lse``, ``log_probs`` and ``entropy``
  (:math:`H = \log s - t / s`).
- :func:`grad_logits_kernel`: recomputes logits tiles of one vocabulary chunk and writes
  :math:`g_\ell (\mathbb{1}_y - p) - g_H\, p (\log p + H)` times the transform's derivative
  :math:`s(1 - t^2)/\tau` (:math:`s/\tau` without a softcap), plus per-row-block partial column
  sums (the bias gradient).
- :func:`matmul_kernel`: ``out = a @ b (+ acc)`` with float32 accumulation, an optional mask on
  the contraction index, written once in ``out``'s dtype: ``grad_weight`` rows of a chunk
  (``dZ^T @ hidden``) and ``grad_hidden`` (``dZ @ weight``).

Masked rows are loaded as zeros (masked loads: NaN in their hidden rows is never read) and their
outputs and gradients are exact zeros. ``-inf`` logits (a ``-inf`` bias bans a token) give
``p = 0`` and contribute nothing: every ``p * log p`` style product is guarded by ``p > 0``.
"""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with float32 accumulation.

    ``UPCAST`` (set under the interpreter): widen the operands to float32 first. Triton 3.9's
    interpreter multiplies the raw uint16 bit patterns of bfloat16 operands in ``tl.dot``; a
    bf16 x bf16 product is exact in float32, so widening gives the tensor-core result up to the
    order of the float32 accumulation.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def grouped_tile(pid, tiles_m, tiles_n, GROUP: tl.constexpr):
    """Tile ``(pid_m, pid_n)`` of program ``pid`` in grouped order (L2 reuse).

    Consecutive programs walk ``GROUP`` row tiles down one column tile before moving right, so
    the operand tiles they share stay in L2 (the ordering of Triton's matmul tutorial).
    """
    per_group = GROUP * tiles_n
    first = (pid // per_group) * GROUP
    height = tl.minimum(tiles_m - first, GROUP)
    return first + (pid % per_group) % height, (pid % per_group) // height


@triton.jit
def row_inverse(inverse_ptr, rows, rows_in, inv_temperature, ROW_TEMPERATURE: tl.constexpr):
    r"""``(BLOCK_N,)`` float32 :math:`1/\tau` of the rows: loaded per row, or the one number."""
    if ROW_TEMPERATURE:
        return tl.load(inverse_ptr + rows, mask=rows_in, other=1.0).to(tl.float32)
    return rows.to(tl.float32) * 0.0 + inv_temperature


@triton.jit
def transform(accumulator, inverse, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    r"""``(x, t)``: the transform of a float32 tile and its :math:`\tanh`.

    :math:`x = \mathrm{cap}_c(s z) / \tau` and :math:`t = \tanh(s z / c)` (0 without a
    softcap). ``inverse`` is ``(BLOCK_N,)``.

    :math:`\tanh(u) = \mathrm{sign}(u) (1 - e^{-2|u|}) / (1 + e^{-2|u|})` (no overflow; ``-inf``
    gives -1, NaN stays NaN).
    """
    if HAS_SOFTCAP:
        u = accumulator * (scale / softcap)
        decay = tl.exp(-2.0 * tl.abs(u))
        t = (1.0 - decay) / (1.0 + decay)
        t = tl.where(u < 0.0, -t, t)
        x = t * softcap
    else:
        t = accumulator * 0.0
        x = accumulator * scale
    return x * inverse[:, None], t


@triton.jit
def _logits_tile(
    hidden_ptr, weight_ptr, bias_ptr, rows, active, columns, columns_in, width,
    hidden_row_stride, weight_row_stride, inverse, scale, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ROUND: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    r"""``(x, t)``: the ``(BLOCK_N, BLOCK_V)`` float32 tile of ``z`` and its :math:`\tanh`.

    ``-inf`` outside the vocabulary; :func:`transform`.
    """
    accumulator = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    for start in range(0, width, BLOCK_H):
        depth = start + tl.arange(0, BLOCK_H)
        depth_in = depth < width
        hidden = tl.load(
            hidden_ptr + rows[:, None] * hidden_row_stride + depth[None, :],
            mask=active[:, None] & depth_in[None, :],
            other=0.0,
        )
        weight = tl.load(
            weight_ptr + columns[None, :] * weight_row_stride + depth[:, None],
            mask=columns_in[None, :] & depth_in[:, None],
            other=0.0,
        )
        accumulator = dot(hidden, weight, accumulator, PRECISION, UPCAST)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + columns, mask=columns_in, other=0.0).to(tl.float32)
        accumulator += bias[None, :]
    if ROUND:  # the product in the input dtype, as hidden @ weight.T (fp32_head=False)
        accumulator = accumulator.to(hidden_ptr.dtype.element_ty).to(tl.float32)
    logits, t = transform(accumulator, inverse, scale, softcap, HAS_SOFTCAP)
    return tl.where(columns_in[None, :], logits, float("-inf")), t


@triton.jit
def lse_partial_kernel(
    hidden_ptr, weight_ptr, bias_ptr, tokens_ptr, mask_ptr,
    max_ptr, sum_ptr, moment_ptr, target_ptr, inverse_ptr,
    n, vocab, width, split_size, hidden_row_stride, weight_row_stride, inv_temperature,
    scale, softcap,
    HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    ROW_TEMPERATURE: tl.constexpr, ROUND: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Online ``(m, s, t, z_y)`` of one row block over vocabulary split ``program_id(1)``.

    Partial outputs are ``(splits, N)`` float32, row-major. The running max starts at
    ``-inf``; shifts use ``safe = where(max == -inf, 0, max)`` so that blocks of banned
    tokens (all ``-inf``) give zeros, never ``-inf - -inf``.
    """
    split = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rows_in = rows < n
    active = rows_in & (tl.load(mask_ptr + rows, mask=rows_in, other=0) != 0)
    tokens = tl.where(active, tl.load(tokens_ptr + rows, mask=rows_in, other=0), -1)
    inverse = row_inverse(inverse_ptr, rows, rows_in, inv_temperature, ROW_TEMPERATURE)
    running_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_N,), tl.float32)
    moment = tl.zeros((BLOCK_N,), tl.float32)
    target = tl.zeros((BLOCK_N,), tl.float32)
    split_start = split * split_size
    split_end = tl.minimum(split_start + split_size, vocab)
    for start in range(split_start, split_end, BLOCK_V):
        columns = (start + tl.arange(0, BLOCK_V)).to(tl.int64)
        columns_in = columns < split_end
        logits, _ = _logits_tile(
            hidden_ptr, weight_ptr, bias_ptr, rows, active, columns, columns_in, width,
            hidden_row_stride, weight_row_stride, inverse, scale, softcap,
            HAS_BIAS, HAS_SOFTCAP, ROUND, PRECISION, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H,
        )  # fmt: skip
        hit = columns[None, :] == tokens[:, None]
        target += tl.sum(tl.where(hit, logits, 0.0), axis=1)
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        old_shift = tl.where(running_max == float("-inf"), shift, running_max)
        rescale = tl.exp(running_max - shift)
        shifted = logits - shift[:, None]
        probs = tl.exp(shifted)
        if WITH_ENTROPY:
            block_moment = tl.sum(tl.where(probs > 0.0, probs * shifted, 0.0), axis=1)
            moment = rescale * (moment - (shift - old_shift) * total) + block_moment
        total = total * rescale + tl.sum(probs, axis=1)
        running_max = new_max
    out = split * n + rows
    tl.store(max_ptr + out, running_max, mask=rows_in)
    tl.store(sum_ptr + out, total, mask=rows_in)
    tl.store(target_ptr + out, target, mask=rows_in)
    if WITH_ENTROPY:
        tl.store(moment_ptr + out, moment, mask=rows_in)


@triton.jit
def lse_combine_kernel(
    max_ptr, sum_ptr, moment_ptr, target_ptr, mask_ptr, lse_ptr, log_probs_ptr, entropy_ptr,
    n, splits, WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r"""Merge the vocabulary splits of each row into ``lse``, ``log_prob`` and ``H``.

    :math:`M = \max_j m_j`, :math:`s = \sum_j e^{m_j - M} s_j`,
    :math:`t = \sum_j e^{m_j - M} (t_j + (m_j - M) s_j)`; ``lse = M + log s``,
    ``log_prob = z_y - lse``, ``H = log s - t / s``; zeros at masked rows.
    """
    rows = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    rows_in = rows < n
    active = rows_in & (tl.load(mask_ptr + rows, mask=rows_in, other=0) != 0)
    overall = tl.full((BLOCK,), float("-inf"), tl.float32)
    for split in range(0, splits):
        part = tl.load(max_ptr + split * n + rows, mask=rows_in, other=float("-inf"))
        overall = tl.maximum(overall, part)
    shift = tl.where(overall == float("-inf"), 0.0, overall)
    total = tl.zeros((BLOCK,), tl.float32)
    moment = tl.zeros((BLOCK,), tl.float32)
    target = tl.zeros((BLOCK,), tl.float32)
    for split in range(0, splits):
        index = split * n + rows
        part_max = tl.load(max_ptr + index, mask=rows_in, other=float("-inf"))
        part_sum = tl.load(sum_ptr + index, mask=rows_in, other=0.0)
        rescale = tl.exp(part_max - shift)
        total += rescale * part_sum
        target += tl.load(target_ptr + index, mask=rows_in, other=0.0)
        if WITH_ENTROPY:
            offset = tl.where(part_max == float("-inf"), 0.0, part_max - shift)
            part_moment = tl.load(moment_ptr + index, mask=rows_in, other=0.0)
            moment += rescale * (part_moment + offset * part_sum)
    log_total = tl.log(total)
    lse = shift + log_total
    tl.store(lse_ptr + rows, tl.where(active, lse, 0.0), mask=rows_in)
    tl.store(log_probs_ptr + rows, tl.where(active, target - lse, 0.0), mask=rows_in)
    if WITH_ENTROPY:
        entropy = log_total - moment / total
        tl.store(entropy_ptr + rows, tl.where(active, entropy, 0.0), mask=rows_in)


@triton.jit
def grad_logits_kernel(
    hidden_ptr, weight_ptr, bias_ptr, tokens_ptr, mask_ptr, lse_ptr, entropy_ptr,
    grad_log_probs_ptr, grad_entropy_ptr, out_ptr, bias_partial_ptr, inverse_ptr,
    n, vocab, width, chunk_start, chunk_width, hidden_row_stride, weight_row_stride,
    inv_temperature, scale, softcap,
    HAS_BIAS: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, NEED_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, ROW_TEMPERATURE: tl.constexpr, ROUND: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    r"""One ``(BLOCK_N, BLOCK_V)`` tile of ``dL/d(hW^T + b)``, vocabulary ``[start, +width)``.

    ``out`` is ``(N, chunk_width)`` row-major in its own dtype; ``bias_partial`` is
    ``(row_blocks, chunk_width)`` float32 (column sums of the float32 tile, before rounding).
    """
    row_block, vocab_block = grouped_tile(
        tl.program_id(0), tl.cdiv(n, BLOCK_N), tl.cdiv(chunk_width, BLOCK_V), GROUP
    )
    rows = (row_block * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rows_in = rows < n
    active = rows_in & (tl.load(mask_ptr + rows, mask=rows_in, other=0) != 0)
    local = (vocab_block * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    columns = chunk_start + local
    columns_in = (local < chunk_width) & (columns < vocab)
    inverse = row_inverse(inverse_ptr, rows, rows_in, inv_temperature, ROW_TEMPERATURE)
    logits, t = _logits_tile(
        hidden_ptr, weight_ptr, bias_ptr, rows, active, columns, columns_in, width,
        hidden_row_stride, weight_row_stride, inverse, scale, softcap,
        HAS_BIAS, HAS_SOFTCAP, ROUND, PRECISION, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H,
    )  # fmt: skip
    lse = tl.where(active, tl.load(lse_ptr + rows, mask=rows_in, other=0.0), 0.0)
    tokens = tl.where(active, tl.load(tokens_ptr + rows, mask=rows_in, other=0), -1)
    grad = tl.load(grad_log_probs_ptr + rows, mask=rows_in, other=0.0).to(tl.float32)
    grad = tl.where(active, grad, 0.0)
    log_probs = logits - lse[:, None]
    probs = tl.exp(log_probs)
    onehot = tl.where(columns[None, :] == tokens[:, None], 1.0, 0.0)
    grad_logits = grad[:, None] * (onehot - probs)
    if HAS_ENTROPY_GRAD:
        grad_entropy = tl.load(grad_entropy_ptr + rows, mask=rows_in, other=0.0).to(tl.float32)
        grad_entropy = tl.where(active, grad_entropy, 0.0)
        entropy = tl.where(active, tl.load(entropy_ptr + rows, mask=rows_in, other=0.0), 0.0)
        spread = tl.where(probs > 0.0, probs * (log_probs + entropy[:, None]), 0.0)
        grad_logits -= grad_entropy[:, None] * spread
    keep = active[:, None] & columns_in[None, :]
    derivative = inverse[:, None] * scale  # dx/dz = s (1 - t^2) / tau
    if HAS_SOFTCAP:
        derivative = derivative * (1.0 - t * t)
    grad_logits = tl.where(keep, grad_logits * derivative, 0.0)
    store_mask = rows_in[:, None] & (local < chunk_width)[None, :]
    out = out_ptr + rows[:, None] * chunk_width + local[None, :]
    tl.store(out, grad_logits.to(out_ptr.dtype.element_ty), mask=store_mask)
    if NEED_BIAS:
        column_sums = tl.sum(grad_logits, axis=0)
        tl.store(
            bias_partial_ptr + row_block * chunk_width + local,
            column_sums,
            mask=local < chunk_width,
        )


@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, out_ptr, accumulator_ptr, k_mask_ptr,
    m, n, k, a_stride_m, a_stride_k, b_stride_k, b_stride_n, out_stride_m, out_stride_n,
    ACCUMULATE: tl.constexpr, HAS_K_MASK: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):  # fmt: skip
    """``out = a @ b (+ accumulator)`` tile by tile, float32 accumulation, one write.

    One-dimensional grid in grouped tile order (:func:`grouped_tile`). Strides express
    transposes. ``HAS_K_MASK``: contraction indices whose ``k_mask`` is 0 are
    loaded as zeros in both operands (NaN there never enters a product). ``accumulator`` is
    float32 with ``out``'s strides; it may be ``out`` itself (each element is read and written
    by the one program that owns it).
    """
    tile_m, tile_n = grouped_tile(tl.program_id(0), tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N), GROUP)
    rows = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    columns = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rows_in = rows < m
    columns_in = columns < n
    accumulator = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in range(0, k, BLOCK_K):
        depth = (start + tl.arange(0, BLOCK_K)).to(tl.int64)
        depth_in = depth < k
        if HAS_K_MASK:
            depth_in = depth_in & (tl.load(k_mask_ptr + depth, mask=depth_in, other=0) != 0)
        a = tl.load(
            a_ptr + rows[:, None] * a_stride_m + depth[None, :] * a_stride_k,
            mask=rows_in[:, None] & depth_in[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + depth[:, None] * b_stride_k + columns[None, :] * b_stride_n,
            mask=depth_in[:, None] & columns_in[None, :],
            other=0.0,
        )
        accumulator = dot(a, b, accumulator, PRECISION, UPCAST)
    offsets = rows[:, None] * out_stride_m + columns[None, :] * out_stride_n
    inside = rows_in[:, None] & columns_in[None, :]
    if ACCUMULATE:
        accumulator += tl.load(accumulator_ptr + offsets, mask=inside, other=0.0)
    tl.store(out_ptr + offsets, accumulator.to(out_ptr.dtype.element_ty), mask=inside)
