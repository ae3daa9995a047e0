"""Layers for XLA:CPU: the same functions as flax's stock layers, computed in fewer passes.

Each class or function here stands in for one stock layer (`kernels.CPU_LAYERS`), takes that
layer's arguments, supports the subset of its options named in its docstring and raises
`ValueError` on any other, so a model built with them is the model built with the stock layers.
They are written for XLA:CPU, where each was measured (docs/performance.md); on GPU and TPU the
stock layers map onto cuDNN and the TPU's convolution units, so `kernels.select_layers` only
swaps these in on CPU.
"""

from collections.abc import Sequence

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp


def _unsupported(layer: str, what: str) -> ValueError:
  return ValueError(f'kernels.cpu.{layer} does not implement {what}; use the stock flax layer '
                    "(config.cpu_kernels='off') for it.")


class Conv(nnx.Conv):
  """`nnx.Conv` whose 2-D stride-1 'SAME' convolution runs as im2col matmuls in training.

  Under differentiation the forward pass is patches(x) @ kernel, and the backward pass two
  matmuls (patches^T @ dy for the kernel, dy @ kernel^T for the patches) and the transpose of
  the patch extraction back to the input: XLA:CPU runs these matmuls faster than its own
  convolutions and their gradients. Without differentiation (eval, predict) it runs XLA's
  convolution, which needs no patches in memory. The price: the backward pass keeps the patches,
  kh * kw times the input's size (9x for a 3x3 kernel), until the gradient is computed.

  Supports every `nnx.Conv` argument except: a kernel_size other than 2-D, strides other than 1,
  padding other than 'SAME', input or kernel dilation, feature groups, `precision`,
  `preferred_element_type` and a custom `conv_general_dilated`. `dtype` works as in the stock
  layer, which casts the input and kernel to it before the convolution this class replaces.
  """

  def __init__(self, in_features: int, out_features: int, kernel_size: int | Sequence[int],
               strides: int | Sequence[int] | None = 1, *, padding='SAME',
               input_dilation: int | Sequence[int] | None = 1,
               kernel_dilation: int | Sequence[int] | None = 1, feature_group_count: int = 1,
               precision=None, preferred_element_type=None, **kwargs):
    if isinstance(kernel_size, int) or len(kernel_size) != 2:
      raise _unsupported('Conv', f'kernel_size={kernel_size!r} (only 2-D kernels, e.g. (3, 3))')
    for name, value in (('strides', strides), ('input_dilation', input_dilation),
                        ('kernel_dilation', kernel_dilation)):
      if value not in (None, 1, (1, 1), [1, 1]):
        raise _unsupported('Conv', f'{name}={value!r} (only 1)')
    if padding != 'SAME':
      raise _unsupported('Conv', f"padding={padding!r} (only 'SAME')")
    for name, value, default in (('feature_group_count', feature_group_count, 1),
                                 ('precision', precision, None),
                                 ('preferred_element_type', preferred_element_type, None)):
      if value != default:
        raise _unsupported('Conv', f'{name}={value!r} (only {default})')
    if 'conv_general_dilated' in kwargs:
      raise _unsupported('Conv', 'a custom conv_general_dilated')
    super().__init__(in_features, out_features, kernel_size, strides, padding=padding,
                     input_dilation=input_dilation, kernel_dilation=kernel_dilation,
                     conv_general_dilated=_conv_general_dilated, **kwargs)


_NHWC = lax.ConvDimensionNumbers((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))


def _conv_general_dilated(lhs, rhs, window_strides, padding, *, lhs_dilation, rhs_dilation,
                          dimension_numbers, feature_group_count, precision, out_sharding=None):
  """`conv_same` behind `nnx.Conv`'s `conv_general_dilated` hook; `Conv` checked the options."""
  if ((tuple(window_strides), padding, tuple(lhs_dilation), tuple(rhs_dilation),
       dimension_numbers, feature_group_count, precision, out_sharding)
      != ((1, 1), 'SAME', (1, 1), (1, 1), _NHWC, 1, None, None)):
    raise _unsupported('Conv', f'this convolution (strides {window_strides}, padding '
                       f'{padding!r}, dimension numbers {dimension_numbers})')
  return conv_same(lhs, rhs)


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
  return y.reshape(*x.shape[:3], -1), (patches, kernel)


def _conv_same_bwd(residuals, dy):
  patches, kernel = residuals
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

  Supports every `nnx.Dropout` argument except `broadcast_dims`, and every call argument.
  """

  def __init__(self, rate: float, *, broadcast_dims: Sequence[int] = (), **kwargs):
    if tuple(broadcast_dims):
      raise _unsupported('Dropout', f'broadcast_dims={broadcast_dims!r} (only ())')
    super().__init__(rate, **kwargs)

  def __call__(self, inputs: jax.Array, *, deterministic: bool | None = None,
               rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None) -> jax.Array:
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
  """`nnx.avg_pool` over non-overlapping 2-D windows, as a reshape and a mean.

  XLA:CPU runs a reduce-window (and its gradient) as separate passes over the activations,
  while a mean over reshaped axes fuses with the elementwise ops around it. Supports NHWC inputs
  with 2-D windows equal to the strides and 'VALID' padding (trailing rows and columns that do
  not fill a window are dropped, as the stock layer does); `count_include_pad` has no effect
  without padding.
  """
  del count_include_pad  # 'VALID' pads nothing.
  window_shape = tuple(window_shape)
  if len(window_shape) != 2 or inputs.ndim != 4:
    raise _unsupported('avg_pool', f'window_shape={window_shape} on inputs of shape '
                       f'{inputs.shape} (only 2-D windows on NHWC inputs)')
  if strides is None or tuple(strides) != window_shape:
    raise _unsupported('avg_pool', f'strides={strides} with window_shape={window_shape} '
                       '(only strides equal to the window)')
  if padding != 'VALID':
    raise _unsupported('avg_pool', f"padding={padding!r} (only 'VALID')")
  (wh, ww), (n, h, w, c) = window_shape, inputs.shape
  x = inputs[:, :h // wh * wh, :w // ww * ww]
  return x.reshape(n, h // wh, wh, w // ww, ww, c).mean(axis=(2, 4))
