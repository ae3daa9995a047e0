"""Flax NNX models, chosen by name (`config.model`) with their options from the config.

A model is an `nnx.Module` class whose constructor takes the image shape (height, width,
channels), the number of classes, `layers` (the convolution, dropout and pooling to build from,
see `kernels`), `rngs`, and its own options as keyword arguments, which come from
`config.model_options.<name>`. To add one: write the class, add it to `MODELS`, and (if it has
options) add them to `config.model_options` in your config. See README.md.
"""

from collections.abc import Callable
import functools
import math
from typing import TypeVar

from flax import nnx
import jax
import ml_collections

import kernels

T = TypeVar('T')


class CNN(nnx.Module):
  """The CNN of flax's MNIST example, layer for layer and in its order."""

  def __init__(self, image_shape: tuple[int, int, int], num_classes: int, *,
               layers: kernels.Layers, rngs: nnx.Rngs, conv1_features: int = 32,
               conv2_features: int = 64, hidden_features: int = 256,
               dropout_rate: float = 0.025):
    height, width, channels = image_shape
    self.conv1 = layers.conv(channels, conv1_features, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(conv1_features, rngs=rngs)
    self.dropout1 = layers.dropout(rate=dropout_rate, rngs=rngs)
    self.conv2 = layers.conv(conv1_features, conv2_features, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(conv2_features, rngs=rngs)
    self.avg_pool = functools.partial(layers.avg_pool, window_shape=(2, 2), strides=(2, 2))
    # Two 2x2 average pools with 'VALID' padding floor each spatial size twice.
    flat_features = (height // 2 // 2) * (width // 2 // 2) * conv2_features
    self.linear1 = nnx.Linear(flat_features, hidden_features, rngs=rngs)
    self.dropout2 = layers.dropout(rate=dropout_rate, rngs=rngs)
    self.linear2 = nnx.Linear(hidden_features, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x)))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.dropout2(self.linear1(x)))
    return self.linear2(x)


class MLP(nnx.Module):
  """A multilayer perceptron on flattened images: 784-512-512-10 on MNIST by default."""

  def __init__(self, image_shape: tuple[int, int, int], num_classes: int, *,
               layers: kernels.Layers, rngs: nnx.Rngs,
               hidden_features: tuple[int, ...] = (512, 512)):
    del layers  # Dense layers only.
    sizes = (math.prod(image_shape), *hidden_features, num_classes)
    self.linears = nnx.List([nnx.Linear(size_in, size_out, rngs=rngs)
                             for size_in, size_out in zip(sizes[:-1], sizes[1:])])

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.reshape(x.shape[0], -1)
    for linear in self.linears[:-1]:
      x = nnx.relu(linear(x))
    return self.linears[-1](x)


MODELS: dict[str, type[nnx.Module]] = {'cnn': CNN, 'mlp': MLP}


def model_options(config: ml_collections.ConfigDict) -> dict:
  """The options of `config.model` from `config.model_options.<name>` ({} when it has none)."""
  options = config.model_options.get(config.model)
  return options.to_dict() if options is not None else {}


def create_model(config: ml_collections.ConfigDict, image_shape: tuple[int, int, int],
                 num_classes: int, rngs: nnx.Rngs) -> nnx.Module:
  """Builds `config.model` for `image_shape` from the layers `config.cpu_kernels` selects."""
  if config.model not in MODELS:
    raise ValueError(
        f'Unknown model {config.model!r}: config.model must be one of {sorted(MODELS)}.')
  return MODELS[config.model](tuple(image_shape), num_classes,
                              layers=kernels.select_layers(config.cpu_kernels), rngs=rngs,
                              **model_options(config))


def create_compiled(create: Callable[[], T]) -> T:
  """Calls `create`, which builds NNX modules, as one XLA program at the lowest optimisation level.

  Run eagerly, XLA compiles every initialiser op on its own at its full optimisation level; as
  one program, which runs once, it compiles and runs several times faster.
  """
  return nnx.jit(create).lower().compile({'xla_backend_optimization_level': 0})()
