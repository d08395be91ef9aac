"""Token selections computed from a whole batch, as functions of their own.

``entropy``: :func:`rlobjectives.top_entropy_mask` (the high-entropy tokens, "80/20");
``batch``: :func:`rlobjectives.m2po_mask` and :func:`rlobjectives.cov_selection`, the
selections of M2PO, Clip-Cov and KL-Cov on any batch (to compute once per mini-batch and hand
to the objects or the loss's mask). :mod:`rlobjectives.distributed` has their variants over
every data-parallel rank.
"""
