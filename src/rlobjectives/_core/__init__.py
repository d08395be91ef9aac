"""The private core every concern builds on: validation, layout, masking, reduction, chunking.

Nothing here knows a loss. ``validation`` (coercion, checks, messages that name the argument) and
``spellings`` (the peers' names) are the bottom; ``masking``, ``layout``, ``segments`` and
``packing`` describe which tokens count and which form a sequence; ``reduction`` turns per-token
values into the named reductions; ``chunking`` drives loops over row blocks; ``backend`` chooses
the PyTorch path or the Triton kernels for a call.
"""
