"""EfficientNet-B0 (Tan & Le 2019) in timm's layout (`efficientnet_b0`: torch's symmetric
padding, not the TensorFlow port's 'SAME'): a 3x3 stride-2 stem, seven stages of mobile inverted
bottlenecks with squeeze-and-excitation and SiLU, a 1x1 head convolution to 1,280 features,
average pooling and the classifier."""

from flax import nnx
import jax

from backbones import common
from backbones import weights
import kernels
import models

# Each stage: (blocks, kernel size, stride of its first block, expansion ratio, out features);
# timm's arch_def of efficientnet_b0 (ds_r1_k3_s1_e1_c16, ir_r2_k3_s2_e6_c24, ...).
_B0_STAGES = ((1, 3, 1, 1, 16), (2, 3, 2, 6, 24), (2, 5, 2, 6, 40), (3, 3, 2, 6, 80),
              (3, 5, 1, 6, 112), (4, 5, 2, 6, 192), (1, 3, 1, 6, 320))
# Squeeze-and-excitation to a quarter of the block's input features.
_SE_RATIO = 0.25


def block_rules(separable: str, inverted: str) -> tuple:
  """Key-map rules of timm's two block kinds (`_efficientnet_blocks`, shared by its
  EfficientNets and MobileNetV3s), for the block paths that `separable` and `inverted` match
  (one group each): depthwise-separable blocks (no expansion: conv_dw, bn1, se, conv_pw, bn2)
  and inverted residuals (conv_pw, bn1, conv_dw, bn2, se, conv_pwl, bn3). Both kinds are
  `MBConv` here, with names that say each layer's role."""
  layers = ((separable, 'conv_dw', 'bn1', 'conv_dw', 'bn_dw'),
            (separable, 'conv_pw', 'bn2', 'conv_projection', 'bn_projection'),
            (inverted, 'conv_pw', 'bn1', 'conv_expansion', 'bn_expansion'),
            (inverted, 'conv_dw', 'bn2', 'conv_dw', 'bn_dw'),
            (inverted, 'conv_pwl', 'bn3', 'conv_projection', 'bn_projection'))
  return tuple(rule for block, conv, norm, conv_target, norm_target in layers
               for rule in (*weights.conv_rules(rf'{block}\.{conv}', rf'\1.{conv_target}'),
                            *weights.norm_rules(rf'{block}\.{norm}', rf'\1.{norm_target}')))


def _torchvision_rules() -> tuple:
  """Key-map rules of torchvision's EfficientNet (efficientnet_b0): `features.0` the stem,
  `features.N` stage N-1 (up to 9) and the last one the head convolution; each block's
  `block.K` are its layers in order, a convolution (`.0`) and its BatchNorm (`.1`) each, the
  squeeze-and-excitation's `fc1`/`fc2`. As in timm's layout, the first stage's blocks have no
  expansion."""
  rules = [*weights.conv_rules(r'features\.0\.0', 'conv_stem'),
           *weights.norm_rules(r'features\.0\.1', 'bn1')]
  for index in range(1, 10):
    block, target = rf'features\.{index}\.(\d+)\.block', rf'blocks.{index - 1}.\1'
    layers, se = ((('0', 'dw'), ('2', 'projection')), '1') if index == 1 else (
        (('0', 'expansion'), ('1', 'dw'), ('3', 'projection')), '2')
    for position, role in layers:
      rules += (*weights.conv_rules(rf'{block}\.{position}\.0', rf'{target}.conv_{role}'),
                *weights.norm_rules(rf'{block}\.{position}\.1', rf'{target}.bn_{role}'))
    rules += (*weights.conv_rules(rf'{block}\.{se}\.fc1', rf'{target}.se.conv_reduce'),
              *weights.conv_rules(rf'{block}\.{se}\.fc2', rf'{target}.se.conv_expand'))
  return (*rules, *weights.conv_rules(r'features\.[1-9]\d*\.0', 'conv_head'),
          *weights.norm_rules(r'features\.[1-9]\d*\.1', 'bn2'),
          *weights.linear_rules(r'classifier\.1', 'classifier'))


# timm's keys -> this module's paths: the first stage has depthwise-separable blocks, the others
# inverted residuals;
# torchvision's after.
KEY_MAP = (
    *weights.conv_rules(r'conv_stem', 'conv_stem'),
    *weights.norm_rules(r'bn1', 'bn1'),
    *block_rules(separable=r'(blocks\.0\.\d+)', inverted=r'(blocks\.[1-9]\d*\.\d+)'),
    *weights.conv_rules(r'(blocks\.\d+\.\d+\.se\.conv_(?:reduce|expand))', r'\1'),
    *weights.conv_rules(r'conv_head', 'conv_head'),
    *weights.norm_rules(r'bn2', 'bn2'),
    *weights.linear_rules(r'classifier', 'classifier'),
    *_torchvision_rules(),
)


class SqueezeExcite(nnx.Module):
  """Channel attention (Hu et al. 2018): the features' means through a 1x1 convolution to
  `reduced` features, SiLU, a 1x1 convolution back and a sigmoid gate scale the features."""

  def __init__(self, features: int, reduced: int, *, layers: kernels.Layers, rngs: nnx.Rngs):
    self.conv_reduce = common.conv(layers, features, reduced, 1, use_bias=True, rngs=rngs)
    self.conv_expand = common.conv(layers, reduced, features, 1, use_bias=True, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.conv_expand(nnx.silu(self.conv_reduce(x.mean(axis=(1, 2), keepdims=True))))
    return x * nnx.sigmoid(scale)


class MBConv(nnx.Module):
  """A mobile inverted bottleneck: a 1x1 expansion by `expand_ratio` (none when 1), a
  depthwise convolution with the stride, squeeze-and-excitation, a linear 1x1 projection, each
  batch-normalised; plus the input (under stochastic depth) where the shapes allow."""

  def __init__(self, in_features: int, out_features: int, kernel_size: int, stride: int,
               expand_ratio: int, drop_path_rate: float, *, layers: kernels.Layers,
               rngs: nnx.Rngs):
    hidden = in_features * expand_ratio
    if expand_ratio != 1:
      self.conv_expansion = common.conv(layers, in_features, hidden, 1, rngs=rngs)
      self.bn_expansion = common.batch_norm(layers, hidden, rngs=rngs)
    else:
      self.conv_expansion = self.bn_expansion = None
    self.conv_dw = common.conv(layers, hidden, hidden, kernel_size, stride=stride,
                               groups=hidden, rngs=rngs)
    self.bn_dw = common.batch_norm(layers, hidden, rngs=rngs)
    self.se = SqueezeExcite(hidden, round(in_features * _SE_RATIO), layers=layers, rngs=rngs)
    self.conv_projection = common.conv(layers, hidden, out_features, 1, rngs=rngs)
    self.bn_projection = common.batch_norm(layers, out_features, rngs=rngs)
    self.has_skip = stride == 1 and in_features == out_features
    self.drop_path = common.DropPath(drop_path_rate, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    y = x
    if self.conv_expansion is not None:
      y = nnx.silu(self.bn_expansion(self.conv_expansion(y)))
    y = self.se(nnx.silu(self.bn_dw(self.conv_dw(y))))
    y = self.bn_projection(self.conv_projection(y))
    return x + self.drop_path(y) if self.has_skip else y


# Layers for layer-wise decay and linear probing, as timm's EfficientNet.group_matcher.
LAYERS = models.LayerGroups(stem=r'^(conv_stem|bn1)\.', blocks=r'^blocks\.(\d+)\.(\d+)\.',
                                head=r'classifier\.')


class EfficientNet(nnx.Module):
  """A stem of `stem_features`, stages of `MBConv` blocks as `stages` lists them, a 1x1 head
  convolution to `head_features`, average pooling and the classifier. Subclasses set all three."""
  stages: tuple[tuple[int, int, int, int, int], ...]  # As `_B0_STAGES`.
  stem_features: int
  head_features: int

  def __init__(self, image_shape: tuple[int, int, int], num_classes: int, *,
               layers: kernels.Layers, rngs: nnx.Rngs, drop_path_rate: float = 0.0,
               dropout_rate: float = 0.0, remat: bool = False):
    """`drop_path_rate`: stochastic depth of the last block; `dropout_rate`: dropout before the
    classifier; `remat`: recompute each block's activations in the backward pass to save
    memory."""
    common.check_rate('drop_path_rate', drop_path_rate)
    common.check_rate('dropout_rate', dropout_rate)
    num_blocks = sum(stage[0] for stage in self.stages)
    self.conv_stem = common.conv(layers, image_shape[-1], self.stem_features, 3, stride=2,
                                 rngs=rngs)
    self.bn1 = common.batch_norm(layers, self.stem_features, rngs=rngs)
    stages, in_features, index = [], self.stem_features, 0
    for depth, kernel_size, stride, expand_ratio, out_features in self.stages:
      blocks = []
      for block in range(depth):
        # timm's schedule here: rate * index / number of blocks (the last one stays below it).
        blocks.append(MBConv(in_features, out_features, kernel_size, stride if block == 0 else 1,
                             expand_ratio, drop_path_rate * index / num_blocks, layers=layers,
                             rngs=rngs))
        in_features, index = out_features, index + 1
      stages.append(nnx.List(blocks))
    self.blocks = nnx.List(stages)
    self.conv_head = common.conv(layers, in_features, self.head_features, 1, rngs=rngs)
    self.bn2 = common.batch_norm(layers, self.head_features, rngs=rngs)
    self.dropout = layers.dropout(rate=dropout_rate, rngs=rngs)
    self.classifier = layers.linear(self.head_features, num_classes, rngs=rngs)
    self.remat = remat

  def pre_logits(self, x: jax.Array) -> jax.Array:
    """The pooled features the classifier takes (timm's `forward_head(forward_features(x),
    pre_logits=True)`): the embedding of `--mode=embed`."""
    x = nnx.silu(self.bn1(self.conv_stem(x)))
    for stage in self.blocks:
      x = common.run_blocks(stage, x, self.remat)
    return nnx.silu(self.bn2(self.conv_head(x))).mean(axis=(1, 2))

  def logits(self, features: jax.Array) -> jax.Array:
    return common.head(features, self.dropout, self.classifier)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.logits(self.pre_logits(x))


@models.MODELS.register(
    'efficientnet_b0', key_map=KEY_MAP, layers=LAYERS,
    # timm's default weights: trained with RandAugment (ra_in1k).
    pretrained=common.pretrained_cfg('timm/efficientnet_b0.ra_in1k', crop_pct=0.875,
                                     interpolation='bicubic', mean=common.IMAGENET_MEAN,
                                     std=common.IMAGENET_STD))
class EfficientNetB0(EfficientNet):
  """EfficientNet-B0 (5.3M parameters with 1,000 classes)."""
  stages, stem_features, head_features = _B0_STAGES, 32, 1280
