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
import functools
import math

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp


class Conv(nnx.Conv):
  """`nnx.Conv` whose 2-D convolutions run as im2col matmuls in training, and whose depthwise
  ones run as shifted multiply-adds.

  Under differentiation the forward pass is patches(x) @ kernel, and the backward pass two
  matmuls (patches^T @ dy for the kernel, dy @ kernel^T for the patches) and the transpose of
  the patch extraction back to the input: XLA:CPU runs these matmuls faster than its own
  convolutions and their gradients, strided ones most of all (a ResNet's stem, its strided 3x3
  and 1x1 shortcut convolutions, whose kernel gradients XLA computes by transposing the
  activations first). Without differentiation (eval, predict) it runs XLA's convolution, which
  needs no patches in memory, but for an output at most 2 pixels high or wide (`conv_patches`).
  The forward pass keeps only the input (as the stock layer does) and the backward pass
  rebuilds the patches, so one layer's patches are in memory at a time rather than every
  layer's from the forward pass to its gradient (at 224 px a ResNet's would be gigabytes). A
  patch matrix larger than `PATCHES_LIMIT_BYTES` (kh * kw / (sh * sw) times the input's size:
  large images, wide layers, large batches) is not built: that layer runs as the stock layer
  does.

  Depthwise convolutions (as many feature groups as input channels, one filter each: the
  output has as many channels) run as `conv_depthwise`, shifted multiply-adds, in training and
  in eval alike: XLA:CPU's own depthwise convolutions, and their gradients most of all, are
  several times slower (EfficientNet's 3x3 and 5x5, ConvNeXt's 7x7: docs/backbone_speed.md).

  Takes every `nnx.Conv` argument. The 2-D convolutions it computes its way are those with any
  strides and padding (flax's 'SAME', 'VALID' or explicit), no dilation, one feature group or
  depthwise ones, and no `precision` or preferred type; any other convolution (dilation, other
  feature groups or depth multipliers, 1-D or 3-D kernels, a `precision`) runs as the stock
  layer runs it, so a model may use any convolution. `dtype` works as in the stock layer, which
  casts the input and kernel to it before the convolution.
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

Pads = tuple[tuple[int, int], tuple[int, int]]  # (top, bottom), (left, right).


def output_pixels(input_shape: tuple[int, ...], kernel_shape: tuple[int, ...],
                  strides: tuple[int, int] = (1, 1), padding: str | Pads = 'SAME') -> int:
  """Height times width of the output of an NHWC x HWIO convolution."""
  pads = explicit_pads(input_shape, kernel_shape, strides, padding)
  return (_output_size(input_shape[1], kernel_shape[0], strides[0], pads[0])
          * _output_size(input_shape[2], kernel_shape[1], strides[1], pads[1]))


def patches_bytes(input_shape: tuple[int, ...], kernel_shape: tuple[int, ...], dtype,
                  strides: tuple[int, int] = (1, 1), padding: str | Pads = 'SAME') -> int:
  """The size of `conv_patches`' patch matrix for an NHWC input and an HWIO kernel."""
  kh, kw, c, _ = kernel_shape
  return (input_shape[0] * output_pixels(input_shape, kernel_shape, strides, padding)
          * kh * kw * c * jnp.dtype(dtype).itemsize)


def explicit_pads(input_shape, kernel_shape, strides, padding) -> Pads:
  """`padding` as lax reads it ('SAME': the extra row of an odd total at the bottom)."""
  if isinstance(padding, str):
    padding = lax.padtype_to_pads(input_shape[1:3], kernel_shape[:2], strides, padding)
  return tuple(tuple(int(p) for p in pair) for pair in padding)


def _output_size(size: int, kernel: int, stride: int, pad: tuple[int, int]) -> int:
  return (size + sum(pad) - kernel) // stride + 1


def _conv_general_dilated(lhs, rhs, window_strides, padding, **options):
  """`conv_patches` behind `nnx.Conv`'s `conv_general_dilated` hook where it computes the same
  convolution with patches of at most `PATCHES_LIMIT_BYTES`, `conv_depthwise` where the
  convolution is depthwise; `lax.conv_general_dilated` with the same arguments everywhere
  else."""
  if lhs.ndim == 4 and is_plain_2d(options):
    strides = tuple(int(s) for s in window_strides)
    pads = explicit_pads(lhs.shape, rhs.shape, strides, padding)
    groups = options.get('feature_group_count', 1)
    if min(min(pair) for pair in pads) >= 0:
      if (groups == 1 and patches_bytes(lhs.shape, rhs.shape, lhs.dtype, strides, pads)
          <= PATCHES_LIMIT_BYTES):
        return conv_patches(lhs, rhs, strides, pads)
      if groups == lhs.shape[3] == rhs.shape[3] and rhs.shape[2] == 1:  # One filter a channel.
        return conv_depthwise(lhs, rhs, strides, pads)
  return lax.conv_general_dilated(lhs, rhs, window_strides, padding, **options)


def is_plain_2d(options: dict) -> bool:
  """Whether these `lax.conv_general_dilated` options ask for `conv_patches`' convolution."""
  undilated = all(tuple(options.get(name) or (1, 1)) == (1, 1)
                  for name in ('lhs_dilation', 'rhs_dilation'))
  defaults = all(options.get(name) is None
                 for name in ('precision', 'preferred_element_type', 'out_sharding'))
  return undilated and defaults and options.get('dimension_numbers') == _NHWC


def _windows(x: jax.Array, kernel_shape: tuple[int, ...], strides: tuple[int, int],
             pads: Pads, pad_value: float = 0.0) -> list[jax.Array]:
  """The input under each of the kernel's kh * kw taps at every output pixel, padded (with
  `pad_value`) and strided as the convolution's: strided slices, each (N, H_out, W_out, C), in
  the kernel's (kh, kw) order."""
  (kh, kw), (sh, sw) = kernel_shape[:2], strides
  n, h, w, c = x.shape
  ho, wo = _output_size(h, kh, sh, pads[0]), _output_size(w, kw, sw, pads[1])
  padded = jnp.pad(x, ((0, 0), *pads, (0, 0)), constant_values=pad_value)
  return [lax.slice(padded, (0, i, j, 0), (n, i + sh * (ho - 1) + 1, j + sw * (wo - 1) + 1, c),
                    (1, sh, sw, 1)) for i in range(kh) for j in range(kw)]


def _patches(x: jax.Array, kernel_shape: tuple[int, ...], strides: tuple[int, int],
             pads: Pads) -> jax.Array:
  """The kh x kw window under every output pixel: (N, H_out, W_out, kh * kw * C), in the
  kernel's (kh, kw, C) order."""
  return jnp.concatenate(_windows(x, kernel_shape, strides, pads), axis=-1)


def _after(x: jax.Array, dy: jax.Array) -> jax.Array:
  """`x`, equal bit for bit, made to depend on `dy`: what a backward pass computes from it is
  then computed there, once `dy` is known.

  Without it, XLA merges what the backward pass rebuilds from an input (the im2col patches, the
  normalised input) with the forward pass's same arrays (common subexpressions), or its
  scheduler computes them as soon as the forward pass ends: either way every layer's copy is
  held from the forward pass to its gradient (ResNet-50's forward patches, at its peak:
  docs/backbone_speed.md). `lax.optimization_barrier` does not prevent this on XLA:CPU, which
  removes barriers before those passes. The dependency is a zero computed from `dy`'s first
  element (finite whatever that element is), subtracted: x - 0 is x, signed zeros included.
  The GELU's and the norms' backward passes keep their barriers, which still act in XLA's
  earlier passes: there, ViT-S/16's step measured smaller and faster with a barrier than with
  this, and largest with neither (docs/backbone_speed.md).
  """
  zero = (dy.reshape(-1)[0] > 0).astype(x.dtype) * 0
  return x - zero


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def conv_patches(x: jax.Array, kernel: jax.Array, strides: tuple[int, int],
                 pads: Pads) -> jax.Array:
  """An NHWC x HWIO convolution; under differentiation, one matmul over its windows, and so
  without it where the output is at most 2 pixels high or wide: there XLA:CPU's convolution
  runs tens of times slower than elsewhere (a ResNet's last stage in eval at 56 or 64 px), and
  the patches are small."""
  (h, w), (kh, kw) = x.shape[1:3], kernel.shape[:2]
  if min(_output_size(h, kh, strides[0], pads[0]),
         _output_size(w, kw, strides[1], pads[1])) <= 2:
    return _conv_patches_fwd(x, kernel, strides, pads)[0]
  return lax.conv_general_dilated(x, kernel, strides, pads,
                                  dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


def patches_matmul(x: jax.Array, kernel: jax.Array, strides: tuple[int, int],
                   pads: Pads) -> jax.Array:
  """An NHWC x HWIO convolution as one matmul of its windows (im2col) by the kernel."""
  patches = _patches(x, kernel.shape, strides, pads)
  y = patches.reshape(-1, patches.shape[-1]) @ kernel.reshape(-1, kernel.shape[-1])
  return y.reshape(*patches.shape[:3], -1)


def _conv_patches_fwd(x, kernel, strides, pads):
  return patches_matmul(x, kernel, strides, pads), (x, kernel)


def _conv_patches_bwd(strides, pads, residuals, dy):
  x, kernel = residuals
  if tuple(kernel.shape[:2]) == tuple(strides) != (1, 1):
    # A ViT's patch embedding (windows side by side, patches no larger than the input): its
    # peak RSS measured higher with `_after` (docs/backbone_speed.md).
    x, dy = lax.optimization_barrier((x, dy))
  else:  # Else XLA keeps the forward pass's patches until here (1x1 convolutions' included).
    x = _after(x, dy)
  patches = _patches(x, kernel.shape, strides, pads)
  dy = dy.reshape(-1, kernel.shape[-1])
  dkernel = (dy.T @ patches.reshape(dy.shape[0], -1)).T  # (out, in) order: the cheaper matmul.
  dpatches = (dy @ kernel.reshape(-1, kernel.shape[-1]).T).reshape(patches.shape)
  dx, = jax.linear_transpose(lambda x: _patches(x, kernel.shape, strides, pads),
                             jax.ShapeDtypeStruct(x.shape, x.dtype))(dpatches)
  return dx, dkernel.reshape(kernel.shape)


conv_patches.defvjp(_conv_patches_fwd, _conv_patches_bwd)


def _taps(x: jax.Array, kernel_shape: tuple[int, ...], strides: tuple[int, int],
          pads: Pads) -> list[jax.Array]:
  """`_windows` in float32 at least (a convolution's accumulator)."""
  accumulator = jnp.promote_types(x.dtype, jnp.float32)
  return [window.astype(accumulator) for window in _windows(x, kernel_shape, strides, pads)]


def _shifted_sum(x: jax.Array, kernel: jax.Array, strides: tuple[int, int],
                 pads: Pads) -> jax.Array:
  """A depthwise convolution as the sum of its taps times their per-channel weights: XLA fuses
  the pad, slices, products and sum into one elementwise loop over the output."""
  taps = _taps(x, kernel.shape, strides, pads)
  weights = kernel.reshape(-1, kernel.shape[-1]).astype(taps[0].dtype)
  return sum(tap * weight for tap, weight in zip(taps, weights)).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def conv_depthwise(x: jax.Array, kernel: jax.Array, strides: tuple[int, int],
                   pads: Pads) -> jax.Array:
  """A depthwise NHWC x HW1C convolution (one filter a channel: feature groups = channels) as
  shifted multiply-adds, in the forward pass and in both gradients.

  XLA:CPU's depthwise convolutions, and their gradients most of all, run far below its
  elementwise speed (jax-ml/jax#23713): EfficientNet's 3x3 and 5x5, ConvNeXt's 7x7.
  """
  return _shifted_sum(x, kernel, strides, pads)


def _conv_depthwise_fwd(x, kernel, strides, pads):
  return _shifted_sum(x, kernel, strides, pads), (x, kernel)  # Keeps the input, as XLA's.


def _conv_depthwise_bwd(strides, pads, residuals, dy):
  # Autodiff of `_shifted_sum` would be as fast for the input and 3-5x slower for the kernel,
  # and would hold every tap's slice (kh * kw times the input) in memory at once.
  x, kernel = residuals
  (kh, kw), (sh, sw) = kernel.shape[:2], strides
  (h, w), (ho, wo) = x.shape[1:3], dy.shape[1:3]
  # The input's gradient: the depthwise convolution of `dy`, spread out by the strides (zeros
  # between its pixels) and padded so that each pixel meets the inputs its window covered
  # (negative pads crop), with the flipped kernel: shifted multiply-adds again.
  spread = lax.pad(dy, jnp.zeros((), dy.dtype), (
      (0, 0, 0), (kh - 1 - pads[0][0], h - 1 + pads[0][0] - (ho - 1) * sh, sh - 1),
      (kw - 1 - pads[1][0], w - 1 + pads[1][0] - (wo - 1) * sw, sw - 1), (0, 0, 0)))
  dx = _shifted_sum(spread, kernel[::-1, ::-1], (1, 1), ((0, 0), (0, 0)))
  # The kernel's gradient: per tap, the sum over pixels of its slice times `dy`. One variadic
  # reduce, all taps at once: XLA runs it as one pass over the input and `dy`, with the slices
  # fused in (a reduce per tap would write each slice out first).
  taps = _taps(x, kernel.shape, strides, pads)
  dy = dy.astype(taps[0].dtype)
  zero = jnp.zeros((), dy.dtype)
  dkernel = lax.reduce([tap * dy for tap in taps], [zero] * len(taps),
                       lambda a, b: [u + v for u, v in zip(a, b)], (0, 1, 2))
  return dx, jnp.stack(dkernel).reshape(kernel.shape).astype(kernel.dtype)


conv_depthwise.defvjp(_conv_depthwise_fwd, _conv_depthwise_bwd)


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


def max_pool(inputs: jax.Array, window_shape: Sequence[int], strides: Sequence[int] | None = None,
             padding: str | Sequence[tuple[int, int]] = 'VALID') -> jax.Array:
  """`nnx.max_pool`, whose gradient over 2-D windows of NHWC floating-point inputs is computed
  from the windows rather than by XLA's select-and-scatter.

  XLA:CPU expands select-and-scatter into a scatter with integer indices of the padded input's
  size, several times this gradient's temporaries (tests/test_kernels.py) and slower, on a
  ResNet's stem most of all (a 112x112x64 input at 224 px). The forward pass is the stock
  function's; the gradient goes, in each window, to the first input (in the window's row-major
  order) equal to the maximum, as select-and-scatter's `>=` picks it. Any other pooling (1-D or
  3-D windows, integer inputs) runs as the stock function.
  """
  window_shape = tuple(window_shape)
  strides = tuple(strides) if strides is not None else (1,) * len(window_shape)
  if (len(window_shape) != 2 or inputs.ndim != 4
      or not jnp.issubdtype(inputs.dtype, jnp.floating)):
    return nnx.max_pool(inputs, window_shape, strides, padding)
  return _max_pool_2d(inputs, window_shape, strides,
                      explicit_pads(inputs.shape, window_shape, strides, padding))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _max_pool_2d(x: jax.Array, window_shape: tuple[int, int], strides: tuple[int, int],
                 pads: Pads) -> jax.Array:
  return nnx.max_pool(x, window_shape, strides, pads)


def _max_pool_2d_fwd(x, window_shape, strides, pads):
  y = _max_pool_2d(x, window_shape, strides, pads)
  return y, (x, y)


def _max_pool_2d_bwd(window_shape, strides, pads, residuals, dy):
  x, y = residuals
  x = _after(x, dy)
  taps = _windows(x, window_shape, strides, pads, pad_value=-jnp.inf)
  first = jnp.full(y.shape, len(taps), jnp.int8)  # The first tap equal to the maximum.
  for index in reversed(range(len(taps))):
    first = jnp.where(taps[index] == y, jnp.int8(index), first)
  zero = jnp.zeros((), dy.dtype)
  dtaps = [jnp.where(first == index, dy, zero) for index in range(len(taps))]
  dx, = jax.linear_transpose(lambda x: _windows(x, window_shape, strides, pads),
                             jax.ShapeDtypeStruct(x.shape, x.dtype))(dtaps)
  return (dx,)


_max_pool_2d.defvjp(_max_pool_2d_fwd, _max_pool_2d_bwd)


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
  """The exact GELU (torch's `nn.GELU()`), x * Phi(x), whose gradient keeps only its input.

  Autodiff of `jax.nn.gelu` keeps three intermediates of the input's size besides it (the erfc,
  the exp and a copy: on ViT-S/16 at batch 32, 116 MB a block, 1.4 GB a step) and XLA writes
  them all in the forward pass; here the backward pass computes Phi(x) + x * phi(x) from the
  input in the same loop as the product with the output's gradient, as torch does. The forward
  pass is the stock function's.
  """
  return jax.nn.gelu(x, approximate=False)


def _gelu_fwd(x):
  return gelu(x), x


def _gelu_bwd(x, dy):
  x, dy = lax.optimization_barrier((x, dy))  # See `_after`.
  wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  cdf = lax.erfc(-wide * 2**-0.5) / 2
  pdf = jnp.exp(-0.5 * wide * wide) * (2 * jnp.pi) ** -0.5
  return ((dy * (cdf + wide * pdf)).astype(x.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


class LayerNorm(nnx.LayerNorm):
  """`nnx.LayerNorm` over the last axis whose gradient keeps only its input and each row's mean
  and reciprocal standard deviation (`normalize`).

  Autodiff of the stock layer keeps four arrays of the input's size (its square, the centred
  input, its product with the scale and the output: on ViT-S/16 at batch 32, 39 MB a norm, 25
  norms a step). Takes every `nnx.LayerNorm` argument; a normalisation over other axes, across
  devices (`axis_name`), with a mask or without a scale or bias runs as the stock layer runs it.
  """

  def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    last = (x.ndim - 1,)
    if (mask is not None or self.axis_name is not None or self.scale is None
        or self.bias is None or _axes(self.reduction_axes, x.ndim) != last
        or _axes(self.feature_axes, x.ndim) != last):
      return super().__call__(x, mask=mask)
    x, scale, bias = self.promote_dtype((x, self.scale[...], self.bias[...]), dtype=self.dtype)
    y = normalize(x, scale, bias, self.epsilon, self.use_fast_variance, last)
    return y.astype(self.dtype or jnp.result_type(x, scale, bias))


class BatchNorm(nnx.BatchNorm):
  """`nnx.BatchNorm` over the channels of NHWC images (or the last axis of any input) whose
  gradient in training keeps only its input and each channel's mean and reciprocal standard
  deviation (`normalize`).

  Autodiff of the stock layer keeps the centred input as well as the input (ResNet-50 at 224 px
  and batch 32: 1.4 GB over its 53 norms). The running averages are updated as the stock layer
  updates them. Takes every `nnx.BatchNorm` argument; the running averages' normalisation (eval),
  a normalisation over other axes, across devices (`axis_name`), with a mask or without a
  scale or bias runs as the stock layer runs it.
  """

  def __call__(self, x: jax.Array, use_running_average: bool | None = None, *,
               mask: jax.Array | None = None) -> jax.Array:
    use_running_average = (self.use_running_average if use_running_average is None
                           else use_running_average)
    if (use_running_average is not False or mask is not None or self.axis_name is not None
        or self.scale is None or self.bias is None or _axes(self.axis, x.ndim) != (x.ndim - 1,)):
      return super().__call__(x, use_running_average, mask=mask)
    x, scale, bias = self.promote_dtype((x, self.scale[...], self.bias[...]), dtype=self.dtype)
    axes = tuple(range(x.ndim - 1))
    # The running averages' statistics are the normalisation's (XLA computes them once).
    mean, var = _statistics(lax.stop_gradient(x), axes, self.use_fast_variance)
    self.mean[...] = lax.stop_gradient(
        self.momentum * self.mean[...] + (1 - self.momentum) * mean.reshape(-1))
    self.var[...] = lax.stop_gradient(
        self.momentum * self.var[...] + (1 - self.momentum) * var.reshape(-1))
    y = normalize(x, scale, bias, self.epsilon, self.use_fast_variance, axes)
    return y.astype(self.dtype or jnp.result_type(x, scale, bias))


def _axes(axes: int | Sequence[int], ndim: int) -> tuple[int, ...]:
  return tuple(axis % ndim for axis in ((axes,) if isinstance(axes, int) else axes))


def _statistics(x, axes, fast_variance):
  """The stock layers' mean and variance over `axes` (kept), in float32 at least."""
  wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  mean = wide.mean(axes, keepdims=True)
  if fast_variance:
    return mean, jnp.maximum(0.0, (wide * wide).mean(axes, keepdims=True) - mean * mean)
  return mean, jnp.square(wide - mean).mean(axes, keepdims=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def normalize(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float,
              fast_variance: bool, axes: tuple[int, ...]) -> jax.Array:
  """(x - mean) / sqrt(var + epsilon) * scale + bias, the statistics over `axes` and the scale
  and bias on the last axis, operation for operation as flax's layer and batch norms compute
  it; its backward pass computes the input's gradient in one pass over the input and the
  output's gradient, as torch's norms do, from the input and the statistics alone."""
  return _normalize_fwd(x, scale, bias, epsilon, fast_variance, axes)[0]


def _normalize_fwd(x, scale, bias, epsilon, fast_variance, axes):
  mean, var = _statistics(x, axes, fast_variance)
  rstd = lax.rsqrt(var + epsilon)
  return (x - mean) * (rstd * scale) + bias, (x, mean, rstd, scale, bias)


def _normalize_bwd(epsilon, fast_variance, axes, residuals, dy):
  del epsilon, fast_variance  # In the residuals' statistics.
  x, mean, rstd, scale, bias = residuals
  x, dy = lax.optimization_barrier((x, dy))  # See `_after`.
  wide, dy = x.astype(mean.dtype), dy.astype(mean.dtype)
  count = math.prod(x.shape[axis] for axis in axes)
  parameter_axes = tuple(range(x.ndim - 1))
  if axes == parameter_axes:  # Batch norm: one mean per channel, as one scale.
    # Sums of products of `dy` with the input, not with the normalised input: that would be
    # an array of the input's size, which XLA computes from the forward pass's values as soon
    # as it ends and holds until here (ResNet-50 at 224 px and batch 32: 1.4 GB).
    dbias = dy.sum(axes)
    dscale = rstd.reshape(-1) * ((dy * wide).sum(axes) - mean.reshape(-1) * dbias)
    dx = rstd * scale * (dy - (dbias + (wide - mean) * rstd * dscale) / count)
  else:  # Layer norm: one mean per row, a scale per feature (rows are short: no such array).
    normalized = (wide - mean) * rstd
    dnormalized = dy * scale
    dx = rstd * (dnormalized - dnormalized.mean(axes, keepdims=True)
                 - normalized * (dnormalized * normalized).mean(axes, keepdims=True))
    dscale, dbias = (dy * normalized).sum(parameter_axes), dy.sum(parameter_axes)
  return dx.astype(x.dtype), dscale.astype(scale.dtype), dbias.astype(bias.dtype)


normalize.defvjp(_normalize_fwd, _normalize_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
  """`jax.nn.softmax` whose gradient keeps only its output (autodiff of the stock function
  keeps its exp as well: attention's largest array, 30 MB a ViT-S/16 block at batch 32)."""
  return jax.nn.softmax(x, axis=axis)


def _softmax_fwd(x, axis):
  y = softmax(x, axis)
  return y, y


def _softmax_bwd(axis, y, dy):
  return (y * (dy - (dy * y).sum(axis, keepdims=True)),)


softmax.defvjp(_softmax_fwd, _softmax_bwd)


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                          bias: jax.Array | None = None, mask: jax.Array | None = None,
                          **options) -> jax.Array:
  """`jax.nn.dot_product_attention`, its float32 inputs (batch, tokens, heads, head features)
  with no bias, mask or other option computed with the heads moved before the tokens.

  The stock function contracts 'BTNH,BSNH->BNTS': each batched matmul has its batch dimensions
  apart (B first, N third), which XLA:CPU lays out by copies inside the forward and backward
  matmuls. With the inputs transposed to (B, N, T, H) once, both matmuls and their gradients
  are plain batched matmuls (measured on ViT-S/16: `python -m benchmarks.step_profile`).
  The arithmetic is the stock function's: float32 logits scaled by 1 / sqrt(H), a softmax over
  the keys. Any other case (bfloat16, a bias or mask, causal, lengths) runs as the stock
  function runs it.
  """
  if bias is not None or mask is not None or options or {
      query.dtype, key.dtype, value.dtype} != {jnp.dtype(jnp.float32)}:
    return jax.nn.dot_product_attention(query, key, value, bias, mask, **options)
  query, key, value = (jnp.swapaxes(x, -3, -2) for x in (query, key, value))
  logits = jnp.einsum('bnth,bnsh->bnts', query, key) * (query.shape[-1] ** -0.5)
  encoded = jnp.einsum('bnts,bnsh->bnth', softmax(logits, axis=-1), value)
  return jnp.swapaxes(encoded, -3, -2)
