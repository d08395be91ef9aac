r"""The logit transform of the model and the sampler: scale, then softcap, then temperature.

The trainers and the samplers do not take the softmax of the raw product :math:`z = h W^\top +
b`: Cohere multiplies it by ``logit_scale``, Granite and MiniCPM3 divide it by ``logits_scaling``,
Gemma 2 (and Gemma 3 when configured) caps it with ``final_logit_softcapping``, and the sampler
divides by its temperature. The functions of this package apply them in TRL's order
(``trl.kernels.ChunkedLogProbFunction``, ``_transform``):

.. math::

    x = \frac{\mathrm{cap}_c(s\,z)}{\tau}, \qquad
    \mathrm{cap}_c(u) = c \tanh(u / c) \ (c \text{ given}), \quad u \ (c = \text{None}),

with :math:`s` = ``logit_scale``, :math:`c` = ``final_logit_softcapping`` and :math:`\tau` =
``temperature`` (a number, or one value per token). Its derivative is, with :math:`t = \tanh(s z /
c)`,

.. math::

    \frac{\partial x}{\partial z} = \frac{s\,(1 - t^2)}{\tau} \quad (c \text{ given}), \qquad
    \frac{s}{\tau} \quad (c = \text{None}):

a per-row factor :math:`s/\tau` (:meth:`LogitTransform.row_factor`, folded into the per-row
coefficients of the closed-form gradients) times, with a softcap, the element-wise
:math:`1 - t^2` (:func:`softcap_derivative`), recovered from :math:`x` as
:math:`\max(1 - (x\tau/c)^2, 0)` (every PyTorch path recovers it the same way, so the
recomputing, the saving and the fused paths give the same numbers; ``-inf`` outside a kept set
gives 0; the Triton kernel forms :math:`t` itself). A ``-inf`` logit (a banned token) becomes
:math:`-c/\tau` under a softcap, as in the peers' forward passes.

:func:`~rlobjectives.logprobs.head.validate_transform` checks the three public arguments; a
per-token temperature is ``(B, T)`` (padded) or ``(N,)`` / ``(1, N)`` (packed), any value where
the row is not selected (those rows use 1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["PLAIN", "LogitTransform", "apply_transform_", "softcap_derivative"]


class LogitTransform(NamedTuple):
    r"""A validated transform :math:`z \mapsto \mathrm{cap}_c(s z) / \tau` (module docstring).

    Attributes:
        scale: :math:`s` (``logit_scale``).
        softcap: :math:`c` (``final_logit_softcapping``), or None.
        inverse: :math:`1/\tau`: a Python float, or a per-row tensor in the computation dtype
            (1 at unselected rows) whose leading shape is that of the rows of the call (flat
            ``(N,)``, or the ``(B, T)`` of strided logits), indexed by the chunk's block.
    """

    scale: float = 1.0
    softcap: float | None = None
    inverse: float | torch.Tensor = 1.0

    @property
    def plain(self) -> bool:
        """Whether the transform is the identity (no scale, no softcap, temperature 1)."""
        return (
            self.scale == 1.0
            and self.softcap is None
            and not isinstance(self.inverse, torch.Tensor)
            and self.inverse == 1.0
        )

    @property
    def per_row(self) -> bool:
        """Whether the temperature is one value per token."""
        return isinstance(self.inverse, torch.Tensor)

    @property
    def leading(self) -> float:
        r"""The transform's first constant factor: :math:`s/c`, else :math:`s/\tau` (or :math:`s`).

        The number the product is multiplied by before anything else (the ``tanh``'s argument
        under a softcap; the whole transform with one temperature), which a GEMM can apply as
        its ``alpha`` (:func:`chunk_product`).
        """
        if self.softcap is not None:
            return self.scale / self.softcap
        if isinstance(self.inverse, torch.Tensor):
            return self.scale
        return self.scale * self.inverse

    def row_inverse(self, rows: object) -> float | torch.Tensor:
        r""":math:`1/\tau` of the rows ``rows`` (a block index): a float or an ``(n, 1)`` tensor."""
        if isinstance(self.inverse, torch.Tensor):
            return self.inverse[rows].reshape(-1, 1)  # type: ignore[index]
        return self.inverse

    def row_factor(self, rows: object) -> float | torch.Tensor:
        r""":math:`\partial x / \partial z` without the softcap's :math:`1 - t^2`: :math:`s/\tau`.

        A float, or an ``(n,)`` tensor for a per-token temperature.
        """
        inverse = self.row_inverse(rows)
        if isinstance(inverse, torch.Tensor):
            return inverse.reshape(-1) * self.scale
        return inverse * self.scale

    def flat(self) -> LogitTransform:
        """The transform with a per-token temperature flattened to ``(N,)`` rows."""
        if isinstance(self.inverse, torch.Tensor):
            return self._replace(inverse=self.inverse.reshape(-1))
        return self


#: The identity transform.
PLAIN = LogitTransform()


def apply_transform_(
    scores: torch.Tensor, transform: LogitTransform, rows: object, *, led: bool = False
) -> torch.Tensor:
    r"""``scores`` :math:`z` ``(n, V)`` becomes :math:`x = \mathrm{cap}_c(s z)/\tau`, in place.

    ``rows`` indexes the per-token temperature (the chunk's block); ``scores`` is in the
    computation dtype. ``led``: ``scores`` holds :math:`z` times
    :attr:`LogitTransform.leading` already. Returns ``scores``.
    """
    inverse = transform.row_inverse(rows)
    factor: float | torch.Tensor
    if transform.softcap is not None:
        if not led:
            scores.mul_(transform.leading)
        scores.tanh_()
        factor = inverse * transform.softcap
    elif led:  # what remains: a per-token 1/tau, or nothing
        factor = inverse if isinstance(inverse, torch.Tensor) else 1.0
    else:
        factor = inverse * transform.scale
    if isinstance(factor, torch.Tensor):
        scores.mul_(factor.to(scores.dtype))
    elif factor != 1.0:
        scores.mul_(factor)
    return scores


def softcap_derivative(
    scores: torch.Tensor, transform: LogitTransform, rows: object, out: torch.Tensor
) -> torch.Tensor:
    r""":math:`1 - t^2` with :math:`t = \mathrm{clamp}(x \tau / c, -1, 1)`, written into ``out``.

    ``scores`` are the transformed logits :math:`x` ``(n, V)`` (not modified); ``out`` an
    ``(n, V)`` buffer of their dtype. Only for a transform with a softcap. Formed as
    :math:`\max(1 - (\tau/c)^2 x^2, 0)` (equal in exact arithmetic: :math:`|t| \le 1` exactly
    where the clamp does nothing), two passes for one temperature (``-inf`` outside a kept set
    gives 0).
    """
    assert transform.softcap is not None
    inverse = transform.row_inverse(rows)
    rows_out = out[: scores.shape[0]]
    one = torch.ones((), dtype=scores.dtype, device=scores.device)
    if isinstance(inverse, torch.Tensor):
        torch.mul(scores, (1.0 / (inverse * transform.softcap)).to(scores.dtype), out=rows_out)
        torch.addcmul(one, rows_out, rows_out, value=-1.0, out=rows_out)
    else:
        factor = 1.0 / (inverse * transform.softcap)  # tau / c
        torch.addcmul(one, scores, scores, value=-(factor * factor), out=rows_out)
    return rows_out.clamp_(min=0.0)
