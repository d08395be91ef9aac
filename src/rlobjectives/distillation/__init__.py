"""On-policy distillation: top-k forward KL, reverse KL on the sampled tokens, GKD, IW-OPD."""

from .iw_opd import iw_opd_advantages
from .jsd import generalized_jsd_loss, generalized_jsd_loss_from_hidden
from .reverse import reverse_kl_loss, reverse_kl_loss_from_hidden, reverse_kl_rewards
from .topk import topk_forward_kl, topk_forward_kl_from_hidden

__all__ = [
    "generalized_jsd_loss",
    "generalized_jsd_loss_from_hidden",
    "iw_opd_advantages",
    "reverse_kl_loss",
    "reverse_kl_loss_from_hidden",
    "reverse_kl_rewards",
    "topk_forward_kl",
    "topk_forward_kl_from_hidden",
]
