"""Flax NNX models, built from the config and the dataset's shape."""

from collections.abc import Callable
from typing import TypeVar

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
import ml_collections

T = TypeVar('T')

# BatchNorm's defaults (momentum 0.99) follow the reference MNIST example.
_DROPOUT_RATE = 0.025


def _mix(x: jax.Array) -> jax.Array:
  """Chris Wellons' `lowbias32`: a bijective 32-bit integer hash with strong avalanche."""
  x ^= x >> 16
  x *= jnp.uint32(0x7FEB352D)
  x ^= x >> 15
  x *= jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


class Dropout(nnx.Dropout):
  """`nnx.Dropout` whose mask is a keyed hash of each element's index.

  `jax.random.bernoulli` draws 32 threefry bits per element into a mask in memory; for the
  CNN's first dropout (3.2M activations at batch 128) that cost more CPU time than the forward
  convolutions. Here each call draws one 64-bit key from the module's RNG stream (threefry, as
  before) and an element is kept when a two-round keyed hash of its index is at least
  `rate * 2**32`: a few integer ops that XLA fuses into the multiply that applies the mask, in
  the forward pass and again in the backward pass, so the mask never goes through memory.
  """

  def __call__(self, inputs: jax.Array) -> jax.Array:
    if self.deterministic or self.rate == 0.0:
      return inputs
    key = jax.random.bits(self.rngs(), (2,), jnp.uint32)
    index = lax.iota(jnp.uint32, inputs.size).reshape(inputs.shape)
    bits = _mix(_mix(index ^ key[0]) ^ key[1])
    keep = bits >= jnp.uint32(round(self.rate * 2**32))
    # A multiply, not jnp.where: its gradient needs no materialised zeros.
    return inputs * (keep.astype(inputs.dtype) / (1.0 - self.rate))


def _avg_pool(x: jax.Array) -> jax.Array:
  """2x2 average pooling with stride 2 and 'VALID' padding, as a reshape and a mean.

  Same values as `nnx.avg_pool(x, (2, 2), (2, 2))`, but XLA:CPU runs a reduce-window (and its
  gradient) as separate passes over the activations, while a mean over reshaped axes fuses with
  the elementwise ops around it.
  """
  n, h, w, c = x.shape
  x = x[:, :h // 2 * 2, :w // 2 * 2]
  return x.reshape(n, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))


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
  """Stride-1 'SAME' NHWC convolution; in training, one matmul over pixel neighbourhoods.

  Under differentiation this runs as im2col: the forward pass is patches(x) @ kernel, and the
  backward pass two matmuls (patches^T @ dy for the kernel, dy @ kernel^T for the patches) and
  the transpose of `_patches` back to the input. XLA:CPU's own convolutions reach ~60 GFLOP/s
  forward and ~30 GFLOP/s for the kernel gradient on the CNN's second layer here, the matmuls
  ~110. Without differentiation (eval), XLA's convolution runs: it needs no patches in memory,
  which at eval batch sizes are hundreds of MB.
  """
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


def _nnx_conv_same(lhs, rhs, window_strides, padding, *, lhs_dilation, rhs_dilation,
                   dimension_numbers, feature_group_count, **unused):
  """`conv_same` behind `nnx.Conv`'s `conv_general_dilated` hook, for the only case it serves."""
  del unused  # precision and out_sharding: defaults only.
  nhwc = lax.ConvDimensionNumbers((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))
  if (tuple(window_strides), padding, tuple(lhs_dilation), tuple(rhs_dilation),
      dimension_numbers, feature_group_count) != ((1, 1), 'SAME', (1, 1), (1, 1), nhwc, 1):
    raise ValueError('conv_same supports 2-D stride-1 undilated ungrouped SAME convolutions '
                     f'only, got strides {window_strides}, padding {padding!r}.')
  return conv_same(lhs, rhs)


def _conv_batch_norm(conv: nnx.Conv, batch_norm: nnx.BatchNorm, x: jax.Array) -> jax.Array:
  """`batch_norm(conv(x))` for a 'SAME' stride-1 conv, as one conv with BatchNorm folded in.

  The same function, parameters and running statistics as the two layers, computed without
  passes over the conv's output: that output is linear in the patches of `x`, so in training
  its batch mean and variance per channel follow from the patches' mean (kh * kw * C numbers)
  and covariance (a small matrix), which for the CNN's first layer (1 input channel, 32 output
  channels) cost far less than two reductions over its 128x28x28x32 output. The normalisation
  then folds into the kernel and bias.
  """
  kernel = conv.kernel[...]
  if batch_norm.use_running_average:
    mean, var = batch_norm.mean[...], batch_norm.var[...]
  else:
    patches = _patches(x, kernel.shape).reshape(-1, kernel.size // kernel.shape[-1])
    patch_mean = patches.mean(axis=0)
    centered = patches - patch_mean
    patch_covariance = centered.T @ centered / patches.shape[0]
    flat_kernel = kernel.reshape(patches.shape[-1], -1)
    mean = patch_mean @ flat_kernel + conv.bias[...]
    # Biased, as BatchNorm's: the variance of each output channel, w^T covariance w.
    var = jnp.einsum('ij,ic,jc->c', patch_covariance, flat_kernel, flat_kernel)
    momentum = batch_norm.momentum
    batch_norm.mean[...] = momentum * batch_norm.mean[...] + (1 - momentum) * mean
    batch_norm.var[...] = momentum * batch_norm.var[...] + (1 - momentum) * var
  scale = batch_norm.scale[...] * lax.rsqrt(var + batch_norm.epsilon)
  return conv_same(x, kernel * scale) + ((conv.bias[...] - mean) * scale + batch_norm.bias[...])


class CNN(nnx.Module):
  """The reference MNIST CNN: two conv blocks with BatchNorm, then two dense layers."""

  def __init__(self, image_shape: tuple[int, ...], num_classes: int, *, rngs: nnx.Rngs):
    height, width, channels = image_shape
    # Applied together, by `_conv_batch_norm`.
    self.conv1 = nnx.Conv(channels, 32, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
    self.dropout1 = Dropout(rate=_DROPOUT_RATE, rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), conv_general_dilated=_nnx_conv_same,
                          rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
    # Two 2x2 average pools with 'VALID' padding floor each spatial size twice.
    flat_features = (height // 2 // 2) * (width // 2 // 2) * 64
    self.linear1 = nnx.Linear(flat_features, 256, rngs=rngs)
    self.dropout2 = Dropout(rate=_DROPOUT_RATE, rngs=rngs)
    self.linear2 = nnx.Linear(256, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = _conv_batch_norm(self.conv1, self.batch_norm1, x)
    x = _avg_pool(nnx.relu(self.dropout1(x)))
    x = _avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)
    x = nnx.relu(self.dropout2(self.linear1(x)))
    return self.linear2(x)


class MLP(nnx.Module):
  """The classic 784-512-512-10 multilayer perceptron on flattened images."""

  def __init__(self, image_shape: tuple[int, ...], num_classes: int, *, rngs: nnx.Rngs):
    in_features = 1
    for size in image_shape:
      in_features *= size
    self.linear1 = nnx.Linear(in_features, 512, rngs=rngs)
    self.linear2 = nnx.Linear(512, 512, rngs=rngs)
    self.linear3 = nnx.Linear(512, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.reshape(x.shape[0], -1)
    x = nnx.relu(self.linear1(x))
    x = nnx.relu(self.linear2(x))
    return self.linear3(x)


MODELS = {'cnn': CNN, 'mlp': MLP}


def create_compiled(create: Callable[[], T]) -> T:
  """Calls `create`, which builds NNX modules, as one XLA program at the lowest optimisation level.

  Run eagerly, XLA:CPU compiles every initialiser op on its own at its full optimisation level
  (~4 s for the CNN and its optimizer on 2 cores); as one program, which runs once, ~1 s.
  """
  return nnx.jit(create).lower().compile({'xla_backend_optimization_level': 0})()


def create_model(
    config: ml_collections.ConfigDict,
    image_shape: tuple[int, ...],
    num_classes: int,
    rngs: nnx.Rngs,
) -> nnx.Module:
  """Builds the model named by `config.model` for images of `image_shape`."""
  if config.model not in MODELS:
    raise ValueError(
        f'Unknown model {config.model!r}: config.model must be one of {sorted(MODELS)}.')
  return MODELS[config.model](tuple(image_shape), num_classes, rngs=rngs)
