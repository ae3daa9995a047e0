"""Flax NNX models, chosen by name (`config.model`) with their options from the config.

A model is an `nnx.Module` class registered with `@MODELS.register(name)`, whose constructor
takes the image shape (height, width, channels), the number of classes, `layers` (the
convolution, dense, batch-norm, dropout and pooling layers to build from, see `kernels`),
`rngs`, and its own options as keyword arguments, which come from
`config.model_options.<name>`. A backbone also has `pre_logits(x)`, its pooled features
(`--mode=embed`, the evaluators of features), and `logits(features)`, its classifier on them
(`model(x) == model.logits(model.pre_logits(x))`: a linear probe of cached features trains it).
To add one: write the class here (or in a module of your own that
your config file imports) with the decorator. See docs/plugins.md.
"""

from collections.abc import Callable, Iterable, Mapping
import dataclasses
import functools
import math
import re
from typing import Any, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp

from core import registry
import kernels

# (image_shape, num_classes); the modern backbones register from the modules of `backbones/`.
MODELS = registry.Registry('model', key='model', app_args=2, package='backbones')
# He et al.'s initialisation for convolutions followed by ReLU.
_HE_NORMAL = nnx.initializers.variance_scaling(2.0, 'fan_out', 'normal')


class LayerGroups(NamedTuple):
  """How a model's parameters form layers from input to output, as timm's `group_matcher`
  says for layer-wise learning-rate decay: regular expressions searched in parameter paths. A
  model declares them with `@MODELS.register(name, layers=LayerGroups(...))`."""
  stem: str  # Before the first block: layer 0.
  blocks: str  # A block; the numbers its groups capture order the blocks: layers 1..N.
  head: str  # The classifier (config.linear_probe trains it alone); it and the rest: N + 1.


def layer_numbers(names: Iterable[str], groups: LayerGroups) -> tuple[dict[str, int], int]:
  """{parameter path: its layer} and the number of the last layer (the head's)."""
  names = list(names)
  blocks = {}
  for name in names:
    if match := re.search(groups.blocks, name):
      # A group that did not take part (a stage's downsampling before its blocks) sorts first.
      blocks[name] = tuple(-1 if number is None else int(number) for number in match.groups())
  order = {key: index + 1 for index, key in enumerate(sorted(set(blocks.values())))}
  last = len(order) + 1
  return {name: (0 if name not in blocks and re.search(groups.stem, name)
                 else order[blocks[name]] if name in blocks else last)
          for name in names}, last


@MODELS.register('cnn')
class CNN(nnx.Module):
  """The CNN of flax's MNIST example, layer for layer and in its order."""

  def __init__(self, image_shape: tuple[int, int, int], num_classes: int, *,
               layers: kernels.Layers, rngs: nnx.Rngs, conv1_features: int = 32,
               conv2_features: int = 64, hidden_features: int = 256,
               dropout_rate: float = 0.025):
    height, width, channels = image_shape
    self.conv1 = layers.conv(channels, conv1_features, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = layers.batch_norm(conv1_features, rngs=rngs)
    self.dropout1 = layers.dropout(rate=dropout_rate, rngs=rngs)
    self.conv2 = layers.conv(conv1_features, conv2_features, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = layers.batch_norm(conv2_features, rngs=rngs)
    self.avg_pool = functools.partial(layers.avg_pool, window_shape=(2, 2), strides=(2, 2))
    # Two 2x2 average pools with 'VALID' padding floor each spatial size twice.
    flat_features = (height // 2 // 2) * (width // 2 // 2) * conv2_features
    self.linear1 = layers.linear(flat_features, hidden_features, rngs=rngs)
    self.dropout2 = layers.dropout(rate=dropout_rate, rngs=rngs)
    self.linear2 = layers.linear(hidden_features, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x)))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.dropout2(self.linear1(x)))
    return self.linear2(x).astype(jnp.float32)  # Logits in float32 whatever the compute dtype.


@MODELS.register('mlp')
class MLP(nnx.Module):
  """A multilayer perceptron on flattened images: 784-512-512-10 on MNIST by default."""

  def __init__(self, image_shape: tuple[int, int, int], num_classes: int, *,
               layers: kernels.Layers, rngs: nnx.Rngs,
               hidden_features: tuple[int, ...] = (512, 512), input_scale: float = 1.0,
               init_stddev: float = 0.0):
    """`input_scale` multiplies the input pixels (in [0, 1]): 255 gives the raw values 0-255.
    `init_stddev` draws every weight and bias from N(0, init_stddev^2); 0 = Flax's default
    (LeCun normal weights, zero biases)."""
    sizes = (math.prod(image_shape), *hidden_features, num_classes)
    init = ({} if not init_stddev else
            {'kernel_init': nnx.initializers.normal(init_stddev),
             'bias_init': nnx.initializers.normal(init_stddev)})
    self.input_scale = input_scale
    self.linears = nnx.List([layers.linear(size_in, size_out, rngs=rngs, **init)
                             for size_in, size_out in zip(sizes[:-1], sizes[1:])])

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.reshape(x.shape[0], -1) * self.input_scale
    for linear in self.linears[:-1]:
      x = nnx.relu(linear(x))
    return self.linears[-1](x).astype(jnp.float32)  # As CNN's.


class ResidualBlock(nnx.Module):
  """A basic residual block: two 3x3 convolutions, each batch-normalised, plus the input.

  With `downsample`, the first convolution has stride 2, halving the height and width, and a
  1x1 stride-2 convolution fits the shortcut to the new size and width.
  """

  def __init__(self, in_features: int, out_features: int, *, downsample: bool,
               layers: kernels.Layers, rngs: nnx.Rngs):
    conv = functools.partial(layers.conv, use_bias=False, kernel_init=_HE_NORMAL, rngs=rngs)
    strides = (2, 2) if downsample else (1, 1)
    self.conv1 = conv(in_features, out_features, kernel_size=(3, 3), strides=strides)
    self.batch_norm1 = layers.batch_norm(out_features, momentum=0.9, rngs=rngs)
    self.conv2 = conv(out_features, out_features, kernel_size=(3, 3))
    # Zero scale: every block starts as the identity, which trains deep stacks more easily.
    self.batch_norm2 = layers.batch_norm(out_features, momentum=0.9,
                                         scale_init=nnx.initializers.zeros, rngs=rngs)
    self.shortcut = (nnx.Sequential(conv(in_features, out_features, kernel_size=(1, 1),
                                         strides=strides),
                                    layers.batch_norm(out_features, momentum=0.9, rngs=rngs))
                     if in_features != out_features or downsample else None)

  def __call__(self, x: jax.Array) -> jax.Array:
    y = nnx.relu(self.batch_norm1(self.conv1(x)))
    y = self.batch_norm2(self.conv2(y))
    if self.shortcut is not None:
      x = self.shortcut(x)
    return nnx.relu(x + y)


@MODELS.register('cifar_resnet')
class CifarResNet(nnx.Module):
  """A small ResNet for 32x32 colour images (ResNet-20 of He et al. 2016 by default), not
  the ImageNet `resnet18/34/50` of `backbones/`.

  A 3x3 stem, then one stage of `blocks_per_stage` residual blocks per width in `widths`, each
  stage after the first halving the resolution with a stride-2 convolution, then global average
  pooling and a linear classifier.
  """

  def __init__(self, image_shape: tuple[int, int, int], num_classes: int, *,
               layers: kernels.Layers, rngs: nnx.Rngs, widths: tuple[int, ...] = (16, 32, 64),
               blocks_per_stage: int = 3):
    channels = image_shape[-1]
    self.stem = layers.conv(channels, widths[0], kernel_size=(3, 3), use_bias=False,
                            kernel_init=_HE_NORMAL, rngs=rngs)
    self.stem_norm = layers.batch_norm(widths[0], momentum=0.9, rngs=rngs)
    blocks, in_features = [], widths[0]
    for stage, width in enumerate(widths):
      for index in range(blocks_per_stage):
        blocks.append(ResidualBlock(in_features, width, downsample=stage > 0 and index == 0,
                                    layers=layers, rngs=rngs))
        in_features = width
    self.blocks = nnx.List(blocks)
    self.linear = layers.linear(in_features, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.relu(self.stem_norm(self.stem(x)))
    for block in self.blocks:
      x = block(x)
    # Global average pooling; logits in float32 as CNN's.
    return self.linear(x.mean(axis=(1, 2))).astype(jnp.float32)


# Its name until the ImageNet ResNets came: saved configs and workdirs with model='resnet' still
# build, resume and load (`resolve`).
MODELS.register('resnet', replaced_by='cifar_resnet')(CifarResNet)


def resolve(name: str, sections: Mapping[str, Any]) -> tuple[str, dict]:
  """The registered name that config.model `name` stands for and its options, from the
  config's `model_options` `sections`: a former name (registered with `replaced_by`) stands for
  its replacement, with its own section where the config has one (a saved config), else the
  replacement's."""
  replacement = MODELS.capability(name, 'replaced_by')
  section = sections.get(name) or (sections.get(replacement) if replacement else None) or {}
  options = section.to_dict() if hasattr(section, 'to_dict') else dict(section)
  return replacement or name, options


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The model a run trains: a registered model bound to its options (`MODELS.bind`), built
  from the layers of `kernels` computing in `compute_dtype` (see `kernels`)."""
  name: str
  factory: Callable[..., nnx.Module]  # (image_shape, num_classes, *, layers, rngs)
  kernels: str = 'auto'
  compute_dtype: str = 'float32'

  def build(self, image_shape: tuple[int, int, int], num_classes: int,
            rngs: nnx.Rngs) -> nnx.Module:
    """The model for `image_shape` and `num_classes`; its parameters are float32."""
    layers = kernels.select_layers(self.kernels, compute_dtype=self.compute_dtype)
    return self.factory(tuple(image_shape), num_classes, layers=layers, rngs=rngs)
