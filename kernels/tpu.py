"""Layers for JAX's TPU backend, swapped in by `kernels.select_layers` with the same function as
the stock ones, for bfloat16 activations (config.compute_dtype='bfloat16').

Measured on one TPU v5e chip, ViT-S/16's bfloat16 train step at batch 256 spent 64 of its 148 ms
in `jax.nn.dot_product_attention`, and its MLP's forward matmuls, the exact GELU's erf fused
into them, ran at 76 TFLOP/s against the backward ones' 126 (docs/accelerators.md has the
profile and its artefact). big_vision's ViT computes both as below.
"""

import jax
import jax.numpy as jnp

_BFLOAT16 = jnp.dtype(jnp.bfloat16)


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                          bias: jax.Array | None = None, mask: jax.Array | None = None,
                          **options) -> jax.Array:
  """`jax.nn.dot_product_attention` (inputs (batch, tokens, heads, head features)) with its
  scores in bfloat16 when the inputs are, with no bias, mask or other option; any other case as
  the stock function runs it.

  The stock function's XLA path writes the (batch, heads, tokens, tokens) scores in float32,
  and XLA:TPU reads and writes that array several times forward and backward (a memory-bound
  step: ViT-S/16 at 224 px, 238 MB a block at batch 256). Here the scores leave the matmul in
  bfloat16 (accumulated in float32 inside the MXU), the softmax computes in float32 inside its
  fusion, and the probabilities are rounded to bfloat16 for the second matmul, as the stock
  function rounds them: only the stored scores differ, by bfloat16's rounding.
  """
  if (bias is not None or mask is not None or options
      or {query.dtype, key.dtype, value.dtype} != {_BFLOAT16}):
    return jax.nn.dot_product_attention(query, key, value, bias, mask, **options)
  scale = jnp.asarray(query.shape[-1] ** -0.5, query.dtype)
  logits = jnp.einsum('btnh,bsnh->bnts', query * scale, key)
  probabilities = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(value.dtype)
  return jnp.einsum('bnts,bsnh->btnh', probabilities, value)


def gelu(x: jax.Array) -> jax.Array:
  """The GELU, exact (erf) on float32 inputs; on bfloat16 inputs, its tanh form computed in
  float32 and rounded to bfloat16.

  XLA:TPU computes erf as a long polynomial on the vector units (the tanh form's tanh has
  its own unit). In bfloat16 the two forms differ by less than the rounding: over every
  bfloat16 in [-10, 10], the tanh form computed in float32 and rounded is nearer the true GELU
  (mean error 2.7e-4) than the exact form computed in bfloat16 (3.2e-4), and rounds to the
  correctly rounded GELU on 90% of them (`tests/test_kernels.py` checks this).
  """
  if x.dtype != _BFLOAT16:
    return jax.nn.gelu(x, approximate=False)
  return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)
