"""The private core every concern builds on: validation, layout, masking, reduction, chunking.

Nothing here knows a loss. ``validation`` (coercion, checks, messages that name the argument),
``nested`` (the walk of a nested-list argument) and ``spellings`` (the peers' names) are the
bottom; ``layout``, ``segments`` and ``packing`` describe which tokens form a sequence;
``reduction`` (and ``masked``, the public masked reductions) turns per-token values into the
named reductions; ``chunking`` drives loops over row blocks; ``backend`` chooses the PyTorch
path or the Triton kernels for a call.
"""
