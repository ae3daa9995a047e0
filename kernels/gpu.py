"""Layers for JAX's CUDA backend, swapped in by `kernels.select_layers` with the same function
as the stock ones.

`dot_product_attention`: `jax.nn.dot_product_attention` run by cuDNN's fused attention where
cuDNN takes the inputs. The stock function's default (`implementation=None`) is XLA's own
attention, which writes the (batch, heads, tokens, tokens) scores to memory and reads them back
for the softmax, forward and backward; cuDNN's kernel keeps them on chip.
"""

import jax
import jax.numpy as jnp

# What cuDNN's fused attention takes: half-precision inputs, and heads of at most 128 features
# in multiples of 8.
_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_CUDNN_MAX_HEAD_FEATURES = 128


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                          bias: jax.Array | None = None, mask: jax.Array | None = None,
                          **options) -> jax.Array:
  """`jax.nn.dot_product_attention` (inputs (batch, tokens, heads, head features)) through
  cuDNN when the inputs are bfloat16 or float16, with no bias, mask or other option, and heads
  cuDNN takes (`_cudnn_attention`); any other case as the stock function runs it."""
  head_features = query.shape[-1]
  if (bias is None and mask is None and not options
      and {query.dtype, key.dtype, value.dtype} <= set(_CUDNN_DTYPES)
      and len({query.dtype, key.dtype, value.dtype}) == 1
      and head_features <= _CUDNN_MAX_HEAD_FEATURES and head_features % 8 == 0):
    return _cudnn_attention(query, key, value)
  return jax.nn.dot_product_attention(query, key, value, bias, mask, **options)


def _cudnn_attention(query: jax.Array, key: jax.Array, value: jax.Array) -> jax.Array:
  """cuDNN's attention, its tokens padded to an even count where they are odd (a ViT's 196
  patches and class token: cuDNN's training kernels take even lengths only); the padding is
  masked out by the sequence lengths and cut off the output."""
  batch, tokens, keys = query.shape[0], query.shape[1], key.shape[1]

  def even(array):
    return jnp.pad(array, ((0, 0), (0, array.shape[1] % 2), (0, 0), (0, 0)))

  lengths = {}
  if tokens % 2 or keys % 2:
    lengths = dict(query_seq_lengths=jnp.full((batch,), tokens, jnp.int32),
                   key_value_seq_lengths=jnp.full((batch,), keys, jnp.int32))
  output = jax.nn.dot_product_attention(even(query), even(key), even(value),
                                        implementation='cudnn', **lengths)
  return output[:, :tokens]
