"""Layers for XLA:CPU: the same functions as flax's stock layers, computed in fewer passes.

Each class or function here stands in for one stock layer (`kernels.CPU_LAYERS`), takes all of
that layer's arguments, computes the cases named in its docstring its own way and every other
case as the stock layer does, so a model built with them is the model built with the stock
layers, and may use any option of theirs.
They are written for XLA:CPU, where each was measured (docs/performance.md); on GPU and TPU the
stock layers map onto cuDNN and the TPU's convolution units, so `kernels.select_layers` only
swaps these in on CPU.
"""

from collections.abc import Sequence

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp


class Conv(nnx.Conv):
  """`nnx.Conv` whose 2-D stride-1 'SAME' convolution runs as im2col matmuls in training.

  Under differentiation the forward pass is patches(x) @ kernel, and the backward pass two
  matmuls (patches^T @ dy for the kernel, dy @ kernel^T for the patches) and the transpose of
  the patch extraction back to the input: XLA:CPU runs these matmuls faster than its own
  convolutions and their gradients. Without differentiation (eval, predict) it runs XLA's
  convolution, which needs no patches in memory. The forward pass keeps only the input (as the
  stock layer does) and the backward pass rebuilds the patches, so one layer's patches are in
  memory at a time rather than every layer's from the forward pass to its gradient (at 224 px a
  ResNet's would be gigabytes). A patch matrix larger than `PATCHES_LIMIT_BYTES` (kh * kw times
  the input's size: large images, wide layers, large batches) is not built: that layer runs as
  the stock layer does.

  Takes every `nnx.Conv` argument. Any other convolution (strides, dilation, feature groups,
  other padding, 1-D or 3-D kernels, a `precision`) runs as the stock layer runs it, so a model
  may use any convolution. `dtype` works as in the stock layer, which casts the input and kernel
  to it before the convolution.
  """

  def __init__(self, *args, **kwargs):
    if 'conv_general_dilated' in kwargs:  # A convolution of the caller's own wins.
      super().__init__(*args, **kwargs)
    else:
      super().__init__(*args, conv_general_dilated=_conv_general_dilated, **kwargs)


_NHWC = lax.ConvDimensionNumbers((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))
# The largest patch matrix one convolution builds, in bytes. The backward pass holds it and its
# gradient at once; above this the layer runs XLA's convolution, whose memory is the stock
# layer's. 256 MiB keeps MNIST's and CIFAR's layers (a few MiB to 75 MiB at batch 128) on the
# matmuls, and bounds a 224-px ResNet's step (docs/performance.md, "Memory at 224 px").
PATCHES_LIMIT_BYTES = 256 * 2**20


def patches_bytes(input_shape: tuple[int, ...], kernel_shape: tuple[int, ...],
                  dtype) -> int:
  """The size of `conv_same`'s patch matrix for an NHWC input and an HWIO kernel."""
  n, h, w, _ = input_shape
  kh, kw, c, _ = kernel_shape
  return n * h * w * kh * kw * c * jnp.dtype(dtype).itemsize


def _conv_general_dilated(lhs, rhs, window_strides, padding, **options):
  """`conv_same` behind `nnx.Conv`'s `conv_general_dilated` hook where it computes the same
  convolution with patches of at most `PATCHES_LIMIT_BYTES`; `lax.conv_general_dilated` with
  the same arguments everywhere else."""
  if (_is_conv_same(window_strides, padding, options)
      and patches_bytes(lhs.shape, rhs.shape, lhs.dtype) <= PATCHES_LIMIT_BYTES):
    return conv_same(lhs, rhs)
  return lax.conv_general_dilated(lhs, rhs, window_strides, padding, **options)


def _is_conv_same(window_strides, padding, options: dict) -> bool:
  """Whether these `lax.conv_general_dilated` arguments ask for `conv_same`'s convolution."""
  undilated = all(tuple(options.get(name) or (1, 1)) == (1, 1)
                  for name in ('lhs_dilation', 'rhs_dilation'))
  defaults = all(options.get(name) is None
                 for name in ('precision', 'preferred_element_type', 'out_sharding'))
  return (tuple(window_strides) == (1, 1) and padding == 'SAME' and undilated and defaults
          and options.get('dimension_numbers') == _NHWC
          and options.get('feature_group_count', 1) == 1)


def _patches(x: jax.Array, kernel_shape: tuple[int, ...]) -> jax.Array:
  """The 'SAME'-padded kh x kw neighbourhood of every pixel: (N, H, W, kh * kw * C)."""
  kh, kw = kernel_shape[:2]
  _, h, w, _ = x.shape
  # lax's 'SAME': kh - 1 rows of zeros in all, the extra one (for even kh) at the bottom.
  padded = jnp.pad(x, ((0, 0), ((kh - 1) // 2, kh // 2), ((kw - 1) // 2, kw // 2), (0, 0)))
  return jnp.concatenate(
      [padded[:, i:i + h, j:j + w] for i in range(kh) for j in range(kw)], axis=-1)


@jax.custom_vjp
def conv_same(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """Stride-1 'SAME' NHWC convolution; under differentiation, one matmul over neighbourhoods."""
  return lax.conv_general_dilated(x, kernel, (1, 1), 'SAME',
                                  dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


def _conv_same_fwd(x, kernel):
  patches = _patches(x, kernel.shape)
  y = patches.reshape(-1, patches.shape[-1]) @ kernel.reshape(-1, kernel.shape[-1])
  return y.reshape(*x.shape[:3], -1), (x, kernel)


def _conv_same_bwd(residuals, dy):
  x, kernel = residuals
  # The barrier ties the patches to `dy`: XLA can neither merge them with the forward pass's
  # (common subexpressions) nor compute them early, either of which would hold every layer's
  # patches from the forward pass until its gradient.
  x, dy = lax.optimization_barrier((x, dy))
  patches = _patches(x, kernel.shape)
  dy = dy.reshape(-1, kernel.shape[-1])
  dkernel = (dy.T @ patches.reshape(dy.shape[0], -1)).T  # (out, in) order: the cheaper matmul.
  dpatches = (dy @ kernel.reshape(-1, kernel.shape[-1]).T).reshape(patches.shape)
  x_shape = jax.ShapeDtypeStruct((*patches.shape[:3], kernel.shape[2]), patches.dtype)
  dx, = jax.linear_transpose(lambda x: _patches(x, kernel.shape), x_shape)(dpatches)
  return dx, dkernel.reshape(kernel.shape)


conv_same.defvjp(_conv_same_fwd, _conv_same_bwd)


def _mix(x: jax.Array) -> jax.Array:
  """Chris Wellons' `lowbias32`: a bijective 32-bit integer hash with strong avalanche."""
  x ^= x >> 16
  x *= jnp.uint32(0x7FEB352D)
  x ^= x >> 15
  x *= jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


class Dropout(nnx.Dropout):
  """`nnx.Dropout` whose mask is a keyed hash of each element's index.

  `jax.random.bernoulli` draws 32 threefry bits per element into a mask in memory, which on
  XLA:CPU costs more than the convolutions around a large activation. Here each call draws one
  64-bit key from the module's RNG stream (threefry, as the stock layer does) and an element is
  kept when a two-round keyed hash of its index is at least `rate * 2**32`: a few integer ops
  that XLA fuses into the multiply that applies the mask, in the forward pass and again in the
  backward pass, so the mask never goes through memory. Masks differ from the stock layer's;
  the keep rate, the scaling and the independence of elements are the same.

  Takes every `nnx.Dropout` argument and call argument; with `broadcast_dims` (one mask shared
  along some axes) it draws its mask as the stock layer does.
  """

  def __call__(self, inputs: jax.Array, *, deterministic: bool | None = None,
               rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None) -> jax.Array:
    if tuple(self.broadcast_dims):
      return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
    deterministic = self.deterministic if deterministic is None else deterministic
    if deterministic or self.rate == 0.0:
      return inputs
    if self.rate == 1.0:
      return jnp.zeros_like(inputs)
    rngs = self.rngs if rngs is None else rngs
    if isinstance(rngs, nnx.Rngs):
      rngs = rngs[self.rng_collection]
    key = rngs() if isinstance(rngs, nnx.RngStream) else rngs
    if key is None:
      raise ValueError('Dropout needs rngs in training mode: pass rngs= to the constructor or '
                       'the call.')
    bits_key = jax.random.bits(key, (2,), jnp.uint32)
    index = lax.iota(jnp.uint32, inputs.size).reshape(inputs.shape)
    bits = _mix(_mix(index ^ bits_key[0]) ^ bits_key[1])
    keep = bits >= jnp.uint32(round(self.rate * 2**32))
    # A multiply, not jnp.where: its gradient needs no materialised zeros.
    return inputs * (keep.astype(inputs.dtype) / (1.0 - self.rate))


def avg_pool(inputs: jax.Array, window_shape: Sequence[int], strides: Sequence[int] | None = None,
             padding: str = 'VALID', count_include_pad: bool = True) -> jax.Array:
  """`nnx.avg_pool`, computed over non-overlapping 2-D windows as a reshape and a mean.

  XLA:CPU runs a reduce-window (and its gradient) as separate passes over the activations,
  while a mean over reshaped axes fuses with the elementwise ops around it. That applies to NHWC
  inputs with 2-D windows equal to the strides and 'VALID' padding (trailing rows and columns
  that do not fill a window are dropped, as the stock layer does); any other pooling runs as
  the stock function runs it.
  """
  window_shape = tuple(window_shape)
  if (len(window_shape) != 2 or inputs.ndim != 4 or strides is None
      or tuple(strides) != window_shape or padding != 'VALID'):
    return nnx.avg_pool(inputs, window_shape, strides, padding, count_include_pad)
  (wh, ww), (n, h, w, c) = window_shape, inputs.shape
  x = inputs[:, :h // wh * wh, :w // ww * ww]
  return x.reshape(n, h // wh, wh, w // ww, ww, c).mean(axis=(2, 4))
