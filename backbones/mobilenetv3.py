"""MobileNetV3-Large (Howard et al. 2019) in timm's layout (`mobilenetv3_large_100`: torch's
symmetric padding): a 3x3 stride-2 stem, stages of mobile inverted bottlenecks with ReLU or
hard-swish and, in some, squeeze-and-excitation with a hard-sigmoid gate, a 1x1 convolution to
960 features, average pooling, a 1x1 head convolution to 1,280 features (with a bias and no
norm, after the pooling) and the classifier."""

from collections.abc import Callable
from typing import NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp

from backbones import common
from backbones import efficientnet
from backbones import weights
import kernels
import models


def hard_sigmoid(x: jax.Array) -> jax.Array:
  """torch's `Hardsigmoid`, relu6(x + 3) / 6, as one clip (which the ONNX and TFLite
  converters take)."""
  return jnp.clip(x + 3.0, 0.0, 6.0) / 6.0


def hard_swish(x: jax.Array) -> jax.Array:
  """torch's `Hardswish`: x * relu6(x + 3) / 6."""
  return x * hard_sigmoid(x)


class Blocks(NamedTuple):
  """Consecutive blocks alike, as one entry of timm's arch_def (`ir_r3_k5_s2_e3_c40_se0.25_nre`:
  3 blocks, 5x5 depthwise, stride 2 in the first, expansion 3, 40 features, SE, ReLU)."""
  repeats: int
  kernel_size: int
  stride: int  # Of the first block; the others have stride 1.
  expand_ratio: float  # 1: no expansion (timm's depthwise-separable block).
  out_features: int
  squeeze_excite: bool
  activation: Callable[[jax.Array], jax.Array]


# timm's arch_def of mobilenetv3_large_100, stage by stage, without its last (`cn_r1_k1_s1_c960`,
# `MobileNetV3.conv_features` here).
_LARGE_STAGES = (
    (Blocks(1, 3, 1, 1, 16, False, nnx.relu),),
    (Blocks(1, 3, 2, 4, 24, False, nnx.relu), Blocks(1, 3, 1, 3, 24, False, nnx.relu)),
    (Blocks(3, 5, 2, 3, 40, True, nnx.relu),),
    (Blocks(1, 3, 2, 6, 80, False, hard_swish), Blocks(1, 3, 1, 2.5, 80, False, hard_swish),
     Blocks(2, 3, 1, 2.3, 80, False, hard_swish)),
    (Blocks(2, 3, 1, 6, 112, True, hard_swish),),
    (Blocks(3, 5, 2, 6, 160, True, hard_swish),),
)
# Squeeze-and-excitation to a quarter of the block's expanded features (timm's se_from_exp).
_SE_RATIO = 0.25

# timm's arch_def of mobilenetv3_small_100 the same way (`ds_r1_k3_s2_e1_c16_se0.25_nre`, ...),
# without its last stage (`cn_r1_k1_s1_c576`).
_SMALL_STAGES = (
    (Blocks(1, 3, 2, 1, 16, True, nnx.relu),),
    (Blocks(1, 3, 2, 4.5, 24, False, nnx.relu), Blocks(1, 3, 1, 3.67, 24, False, nnx.relu)),
    (Blocks(1, 5, 2, 4, 40, True, hard_swish), Blocks(2, 5, 1, 6, 40, True, hard_swish)),
    (Blocks(2, 5, 1, 3, 48, True, hard_swish),),
    (Blocks(3, 5, 2, 6, 96, True, hard_swish),),
)


def timm_key_map(stages: tuple[tuple[Blocks, ...], ...]) -> tuple:
  """timm's keys -> the paths of a model of `stages`. timm's first stage has a
  depthwise-separable block (conv_dw, bn1, [se,] conv_pw, bn2), the next ones inverted
  residuals (conv_pw, bn1, conv_dw, bn2, [se,] conv_pwl, bn3): both are `MBConv` here, with
  names that say each layer's role; the last stage is one 1x1 convolution (conv, bn1),
  `ConvBnAct` here."""
  last = len(stages)
  inverted = '|'.join(map(str, range(1, last)))  # The stages between the first and the last.
  return (
      *weights.conv_rules(r'conv_stem', 'conv_stem'),
      *weights.norm_rules(r'bn1', 'bn1'),
      *efficientnet.block_rules(separable=r'(blocks\.0\.\d+)',
                                inverted=rf'(blocks\.(?:{inverted})\.\d+)'),
      *weights.conv_rules(rf'(blocks\.{last}\.0)\.conv', r'\1.conv'),
      *weights.norm_rules(rf'(blocks\.{last}\.0)\.bn1', r'\1.bn'),
      *weights.conv_rules(r'(blocks\.\d+\.\d+\.se\.conv_(?:reduce|expand))', r'\1'),
      *weights.conv_rules(r'conv_head', 'conv_head'),
      *weights.linear_rules(r'classifier', 'classifier'),
  )


KEY_MAP = timm_key_map(_LARGE_STAGES)


def torchvision_key_map(stages: tuple[tuple[Blocks, ...], ...]) -> tuple:
  """torchvision's keys (its `MobileNetV3`: mobilenet_v3_large) -> the paths of a model of
  `stages`. `features.0` is the stem; `features.1` on are the blocks, numbered through the
  stages, each a `block` of its layers in order (a convolution `.0` and its BatchNorm `.1`
  each; the squeeze-and-excitation's `fc1`/`fc2`); the next and last is the 1x1 convolution to
  the pooled features; `classifier.0` is the Linear that timm's 1x1 head convolution computes,
  `classifier.3` the classifier."""
  rules = [*weights.conv_rules(r'features\.0\.0', 'conv_stem'),
           *weights.norm_rules(r'features\.0\.1', 'bn1')]
  index = 1
  for stage_index, stage in enumerate(stages):
    block_index = 0
    for spec in stage:
      for repeat in range(spec.repeats):
        block, target = rf'features\.{index}\.block', f'blocks.{stage_index}.{block_index}'
        roles = (('expansion',) if spec.expand_ratio != 1 else ()) + ('dw',)
        roles += ('se',) * spec.squeeze_excite + ('projection',)
        for position, role in enumerate(roles):
          rules += ((*weights.conv_rules(rf'{block}\.{position}\.fc1', f'{target}.se.conv_reduce'),
                     *weights.conv_rules(rf'{block}\.{position}\.fc2', f'{target}.se.conv_expand'))
                    if role == 'se' else
                    (*weights.conv_rules(rf'{block}\.{position}\.0', f'{target}.conv_{role}'),
                     *weights.norm_rules(rf'{block}\.{position}\.1', f'{target}.bn_{role}')))
        index, block_index = index + 1, block_index + 1
  last = f'blocks.{len(stages)}.0'
  return (*rules, *weights.conv_rules(rf'features\.{index}\.0', f'{last}.conv'),
          *weights.norm_rules(rf'features\.{index}\.1', f'{last}.bn'),
          (r'classifier\.0\.weight', 'conv_head.kernel', 'linear_as_conv'),
          (r'classifier\.0\.bias', 'conv_head.bias', 'copy'),
          *weights.linear_rules(r'classifier\.3', 'classifier'))


class MBConv(nnx.Module):
  """A mobile inverted bottleneck: a 1x1 expansion by `expand_ratio` (none when 1) and a
  depthwise convolution with the stride, each batch-normalised and activated, optional
  squeeze-and-excitation, a linear batch-normalised 1x1 projection; plus the input (under
  stochastic depth) where the shapes allow."""

  def __init__(self, in_features: int, stride: int, spec: Blocks, drop_path_rate: float, *,
               layers: kernels.Layers, rngs: nnx.Rngs, epsilon: float = 1e-5):
    if spec.expand_ratio != 1:
      hidden = common.make_divisible(in_features * spec.expand_ratio)
      self.conv_expansion = common.conv(layers, in_features, hidden, 1, rngs=rngs)
      self.bn_expansion = common.batch_norm(layers, hidden, rngs=rngs, epsilon=epsilon)
    else:
      hidden = in_features
      self.conv_expansion = self.bn_expansion = None
    self.conv_dw = common.conv(layers, hidden, hidden, spec.kernel_size, stride=stride,
                               groups=hidden, rngs=rngs)
    self.bn_dw = common.batch_norm(layers, hidden, rngs=rngs, epsilon=epsilon)
    # MobileNetV3's squeeze-and-excitation: ReLU inside, a hard-sigmoid gate.
    self.se = (efficientnet.SqueezeExcite(hidden, common.make_divisible(hidden * _SE_RATIO),
                                          nnx.relu, gate=hard_sigmoid, layers=layers, rngs=rngs)
               if spec.squeeze_excite else None)
    self.conv_projection = common.conv(layers, hidden, spec.out_features, 1, rngs=rngs)
    self.bn_projection = common.batch_norm(layers, spec.out_features, rngs=rngs,
                                           epsilon=epsilon)
    self.activation = spec.activation
    self.has_skip = stride == 1 and in_features == spec.out_features
    self.drop_path = common.DropPath(drop_path_rate, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    y = x
    if self.conv_expansion is not None:
      y = self.activation(self.bn_expansion(self.conv_expansion(y)))
    y = self.activation(self.bn_dw(self.conv_dw(y)))
    if self.se is not None:
      y = self.se(y)
    y = self.bn_projection(self.conv_projection(y))
    return x + self.drop_path(y) if self.has_skip else y


class ConvBnAct(nnx.Module):
  """timm's last stage: a batch-normalised 1x1 convolution and hard-swish (no skip: it widens
  the features)."""

  def __init__(self, in_features: int, out_features: int, *, layers: kernels.Layers,
               rngs: nnx.Rngs, epsilon: float = 1e-5):
    self.conv = common.conv(layers, in_features, out_features, 1, rngs=rngs)
    self.bn = common.batch_norm(layers, out_features, rngs=rngs, epsilon=epsilon)

  def __call__(self, x: jax.Array) -> jax.Array:
    return hard_swish(self.bn(self.conv(x)))


# Layers for layer-wise decay and linear probing, as timm's MobileNetV3.group_matcher.
LAYERS = models.LayerGroups(stem=r'^(conv_stem|bn1)\.', blocks=r'^blocks\.(\d+)\.(\d+)\.',
                            head=r'classifier\.')


class MobileNetV3(nnx.Module):
  """A hard-swish stem of `stem_features`, stages of `MBConv` blocks as `stages` lists them, a
  last stage of one `ConvBnAct` to `conv_features`, average pooling, a 1x1 head convolution to
  `head_features` with hard-swish, and the classifier. Subclasses set all four, and
  torchvision's layout its BatchNorms' epsilon."""
  stages: tuple[tuple[Blocks, ...], ...]  # As `_LARGE_STAGES`.
  stem_features: int
  conv_features: int
  head_features: int
  bn_epsilon: float = 1e-5  # timm's; torchvision's MobileNetV3 has 1e-3.

  def __init__(self, image_shape: tuple[int, int, int], num_classes: int, *,
               layers: kernels.Layers, rngs: nnx.Rngs, drop_path_rate: float = 0.0,
               dropout_rate: float = 0.0, remat: bool = False):
    """`drop_path_rate`: stochastic depth of the last block; `dropout_rate`: dropout before the
    classifier; `remat`: recompute each block's activations in the backward pass to save
    memory."""
    common.check_rate('drop_path_rate', drop_path_rate)
    common.check_rate('dropout_rate', dropout_rate)
    # timm counts the last stage's block too.
    num_blocks = sum(spec.repeats for stage in self.stages for spec in stage) + 1
    self.conv_stem = common.conv(layers, image_shape[-1], self.stem_features, 3, stride=2,
                                 rngs=rngs)
    self.bn1 = common.batch_norm(layers, self.stem_features, rngs=rngs,
                                 epsilon=self.bn_epsilon)
    stages, in_features, index = [], self.stem_features, 0
    for stage in self.stages:
      blocks = []
      for spec in stage:
        for repeat in range(spec.repeats):
          # timm's schedule here: rate * index / number of blocks (the last one stays below it).
          blocks.append(MBConv(in_features, spec.stride if repeat == 0 else 1, spec,
                               drop_path_rate * index / num_blocks, layers=layers, rngs=rngs,
                               epsilon=self.bn_epsilon))
          in_features, index = spec.out_features, index + 1
      stages.append(nnx.List(blocks))
    stages.append(nnx.List([ConvBnAct(in_features, self.conv_features, layers=layers,
                                      rngs=rngs, epsilon=self.bn_epsilon)]))
    self.blocks = nnx.List(stages)
    # After the pooling, on one pixel: a 1x1 convolution (timm's weights' layout) with a bias.
    self.conv_head = common.conv(layers, self.conv_features, self.head_features, 1,
                                 use_bias=True, rngs=rngs)
    self.dropout = layers.dropout(rate=dropout_rate, rngs=rngs)
    self.classifier = layers.linear(self.head_features, num_classes, rngs=rngs)
    self.remat = remat

  def pre_logits(self, x: jax.Array) -> jax.Array:
    """The pooled features the classifier takes (timm's `forward_head(forward_features(x),
    pre_logits=True)`): the embedding of `--mode=embed`."""
    x = hard_swish(self.bn1(self.conv_stem(x)))
    for stage in self.blocks:
      x = common.run_blocks(stage, x, self.remat)
    x = hard_swish(self.conv_head(x.mean(axis=(1, 2), keepdims=True)))
    return x.reshape(x.shape[0], -1)

  def logits(self, features: jax.Array) -> jax.Array:
    return common.head(features, self.dropout, self.classifier)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.logits(self.pre_logits(x))


@models.MODELS.register(
    'mobilenetv3_large_100', key_map=KEY_MAP, layers=LAYERS,
    # timm's default weights: trained with RandAugment (ra_in1k).
    pretrained=common.pretrained_cfg('timm/mobilenetv3_large_100.ra_in1k', crop_pct=0.875,
                                     interpolation='bicubic', mean=common.IMAGENET_MEAN,
                                     std=common.IMAGENET_STD))
class MobileNetV3Large(MobileNetV3):
  """MobileNetV3-Large 1.0 (5.5M parameters with 1,000 classes)."""
  stages, stem_features, conv_features, head_features = _LARGE_STAGES, 16, 960, 1280


@models.MODELS.register(
    'mobilenet_v3_large', key_map=torchvision_key_map(_LARGE_STAGES), layers=LAYERS,
    # torchvision's weights (MobileNet_V3_Large_Weights.IMAGENET1K_V1, not on the Hub): resized
    # to 256, centre-cropped to 224, bilinear.
    pretrained=common.pretrained_cfg(None, crop_pct=0.875, interpolation='bilinear',
                                     mean=common.IMAGENET_MEAN, std=common.IMAGENET_STD))
class MobileNetV3LargeTorchvision(MobileNetV3Large):
  """torchvision's `mobilenet_v3_large`: timm's MobileNetV3-Large with torchvision's BatchNorm
  epsilon (1e-3), in whose layout its weights import (`torchvision:MobileNet_V3_Large_Weights.
  IMAGENET1K_V1`)."""
  bn_epsilon = 1e-3


@models.MODELS.register(
    'mobilenetv3_small_100', key_map=timm_key_map(_SMALL_STAGES), layers=LAYERS,
    # timm's default weights: trained with the LAMB optimizer (lamb_in1k).
    pretrained=common.pretrained_cfg('timm/mobilenetv3_small_100.lamb_in1k', crop_pct=0.875,
                                     interpolation='bicubic', mean=common.IMAGENET_MEAN,
                                     std=common.IMAGENET_STD))
class MobileNetV3Small(MobileNetV3):
  """MobileNetV3-Small 1.0 (2.5M parameters with 1,000 classes)."""
  stages, stem_features, conv_features, head_features = _SMALL_STAGES, 16, 576, 1024
