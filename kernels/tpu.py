"""Layers for JAX's TPU backend, swapped in by `kernels.select_layers` with the same function as
the stock ones: small convolutions as matmuls (which XLA:TPU compiles in a fraction of the
time), and attention and the GELU for bfloat16 activations (config.compute_dtype='bfloat16').

Measured on one TPU v5e chip, ViT-S/16's bfloat16 train step at batch 256 spent 64 of its 148 ms
in `jax.nn.dot_product_attention`, and its MLP's forward matmuls, the exact GELU's erf fused
into them, ran at 76 TFLOP/s against the backward ones' 126 (docs/accelerators.md has the
profile and its artefact). big_vision's ViT computes both as below.
"""

import functools

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp

from kernels import cpu

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


# MNIST's and CIFAR's convolutions: at most 32 x 32 output pixels, 3 x 3 over at most 56
# channels, a patch matrix of at most 256 MiB (an eval batch of 512 MNIST images: 110 MiB).
PATCHES_MAX_CONTRACTION = 512
PATCHES_MAX_PIXELS = 32 * 32
PATCHES_LIMIT_BYTES = 256 * 2**20


def small_conv_as_matmul(lhs, rhs, window_strides, padding, **options):
  """`lax.conv_general_dilated`, as one matmul over the windows (im2col, `cpu.patches_matmul`)
  for small 2-D convolutions, in training and in eval; JAX differentiates the matmul and the
  windows' slices.

  XLA:TPU takes seconds to compile some convolutions' gradients (MNIST's first layer, one input
  channel, most of all), where it compiles a matmul in a fraction of a second (MNIST's whole
  run on one v5e chip with these matmuls and with XLA's convolutions: docs/accelerators.md).
  For such convolutions the chip's step time is its dispatch, whichever way they run. Larger
  convolutions run faster as XLA's own, and keep it: those with more than
  `PATCHES_MAX_CONTRACTION` products per output value (kh * kw * input channels: a 224-px
  ResNet's past its stem, a ViT's patch embedding), an output larger than
  `PATCHES_MAX_PIXELS` (a ResNet's stem), or a patch matrix over `PATCHES_LIMIT_BYTES`. So do
  the convolutions `kernels.cpu.Conv` leaves to the stock layer (dilated, grouped, 1-D or
  3-D, with a `precision`).
  """
  if (lhs.ndim == 4 and cpu.is_plain_2d(options)
      and options.get('feature_group_count', 1) == 1
      and rhs.shape[0] * rhs.shape[1] * rhs.shape[2] <= PATCHES_MAX_CONTRACTION):
    strides = tuple(int(s) for s in window_strides)
    pads = cpu.explicit_pads(lhs.shape, rhs.shape, strides, padding)
    if (min(min(pair) for pair in pads) >= 0
        and cpu.output_pixels(lhs.shape, rhs.shape, strides, pads) <= PATCHES_MAX_PIXELS
        and cpu.patches_bytes(lhs.shape, rhs.shape, lhs.dtype, strides, pads)
        <= PATCHES_LIMIT_BYTES):
      return cpu.patches_matmul(lhs, rhs, strides, pads)
  return lax.conv_general_dilated(lhs, rhs, window_strides, padding, **options)


# `nnx.Conv` through `small_conv_as_matmul` (a `conv_general_dilated` of the caller's own wins).
Conv = functools.partial(nnx.Conv, conv_general_dilated=small_conv_as_matmul)
