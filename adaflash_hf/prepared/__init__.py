"""The prepared target: a target in the dtype this CPU verifies fastest in, with a forward whose every row is bitwise
the same whatever the number of rows it shares a forward with (batch invariance), so that speculative greedy decoding
and batched serving equal plain greedy decoding of the same target token for token.

- ``prepare.py``: ``prepare_target`` (cast, install, check) and ``is_prepared``; the public entry point is
  ``adaflash_hf.prepare_target``;
- ``forward.py``: the batch-invariant forward it installs on the model (linears, attention, rotary embeddings);
- ``lean.py``: a Llama decoder layer run as one function of the same ops (bitwise transformers' layer, less Python);
- ``native.py``: that layer as one compiled call of the same ATen ops, for ``generate``'s forwards and the serving
  engine's packed forward (``csrc/decode_layer.cpp``, built on first use; bitwise the Python layer, which runs where
  it cannot be built);
- ``tiles.py``: the construction under it: every call of an op at one fixed row count, checked for row position
  (and a one-row call, and for long inputs calls of several tiles, where this machine checks they agree);
- ``linear.py``, ``attention.py``: the linear (oneDNN's prepacked kernels) and the causal attention run in tiles;
  ``linear.py`` also runs a drafter's linears on prepacked weights (``fast_linears``; a draft needs no batch
  invariance: the target verifies it);
- ``cpu.py``: what this CPU offers bf16 matrix products (its model and bf16 flags).

Importing this package imports none of them.
"""
