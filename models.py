"""Flax NNX models, built from the config and the dataset's shape."""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections

# BatchNorm's defaults (momentum 0.99) follow the reference MNIST example.
_DROPOUT_RATE = 0.025


class Dropout(nnx.Dropout):
  """`nnx.Dropout` that draws its mask from 16 random bits per element.

  `jax.random.bernoulli` turns 32 random bits per element into a float; for the CNN's first
  dropout (3.2M activations at batch 128) that cost more CPU time than the forward convolutions.
  Splitting each 32-bit threefry word into two 16-bit draws makes the mask ~4x cheaper. The
  drop probability is rounded to a multiple of 2**-16 (0.025 -> 0.02499).
  """

  def __call__(self, inputs: jax.Array) -> jax.Array:
    if self.deterministic or self.rate == 0.0:
      return inputs
    words = jax.random.bits(self.rngs(), ((inputs.size + 1) // 2,), jnp.uint32)
    draws = jax.lax.bitcast_convert_type(words, jnp.uint16).reshape(-1)[:inputs.size]
    keep = draws.reshape(inputs.shape) >= round(self.rate * 2**16)
    # A multiply, not jnp.where: its gradient needs no materialised zeros.
    return inputs * (keep.astype(inputs.dtype) / (1.0 - self.rate))


_avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))


class CNN(nnx.Module):
  """The reference MNIST CNN: two conv blocks with BatchNorm, then two dense layers."""

  def __init__(self, image_shape: tuple[int, ...], num_classes: int, *, rngs: nnx.Rngs):
    height, width, channels = image_shape
    self.conv1 = nnx.Conv(channels, 32, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
    self.dropout1 = Dropout(rate=_DROPOUT_RATE, rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
    # Two 2x2 average pools with 'VALID' padding floor each spatial size twice.
    flat_features = (height // 2 // 2) * (width // 2 // 2) * 64
    self.linear1 = nnx.Linear(flat_features, 256, rngs=rngs)
    self.dropout2 = Dropout(rate=_DROPOUT_RATE, rngs=rngs)
    self.linear2 = nnx.Linear(256, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = _avg_pool(nnx.relu(self.dropout1(self.batch_norm1(self.conv1(x)))))
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
