"""EfficientNet (Tan & Le 2019) in timm's layout: B0-B3 (`efficientnet_b0`: torch's symmetric
padding), Lite0-4 (ReLU6, no squeeze-excite, the stem and head at any width: the variant for
phones and microcontrollers), TensorFlow's ports (`tf_efficientnet_b0`, `tf_efficientnet_lite0`:
'SAME' padding, BatchNorm epsilon 1e-3) and MobileNetV2 (Sandler et al. 2018), which timm builds
with the same class. Each: a 3x3 stride-2 stem, seven stages of mobile inverted bottlenecks, a
1x1 head convolution, average pooling and the classifier. The wider and deeper members scale
B0's stages as timm does (`round_channels`, `decode_arch_def`'s ceil of the depth).
"""

from collections.abc import Callable
import dataclasses
import functools
import math

from flax import nnx
import jax

from backbones import common
from backbones import weights
import kernels
import models

Stage = tuple[int, int, int, int, int]
# Each stage: (blocks, kernel size, stride of its first block, expansion ratio, out features);
# timm's arch_def of efficientnet_b0 (ds_r1_k3_s1_e1_c16, ir_r2_k3_s2_e6_c24, ...), and of
# mobilenetv2_100 (ds_r1_k3_s1_c16, ir_r2_k3_s2_e6_c24, ir_r3_k3_s2_e6_c32, ...).
_B0_STAGES = ((1, 3, 1, 1, 16), (2, 3, 2, 6, 24), (2, 5, 2, 6, 40), (3, 3, 2, 6, 80),
              (3, 5, 1, 6, 112), (4, 5, 2, 6, 192), (1, 3, 1, 6, 320))
_MOBILENET_V2_STAGES = ((1, 3, 1, 1, 16), (2, 3, 2, 6, 24), (3, 3, 2, 6, 32), (4, 3, 2, 6, 64),
                        (3, 3, 1, 6, 96), (3, 3, 2, 6, 160), (1, 3, 1, 6, 320))
# Squeeze-and-excitation to a quarter of the block's input features.
_SE_RATIO = 0.25


def scaled(stages: tuple[Stage, ...], width: float, depth: float,
           fix_first_last: bool = False) -> tuple[Stage, ...]:
  """`stages` `width` times as wide (timm's `round_channels`: to a multiple of 8) and `depth`
  times as deep (each stage's blocks rounded up, as timm's `decode_arch_def` with
  `depth_trunc='ceil'`); with `fix_first_last` (Lite) the first and last stages keep theirs."""
  last = len(stages) - 1
  return tuple((blocks if fix_first_last and index in (0, last) else math.ceil(blocks * depth),
                kernel_size, stride, expand_ratio, common.make_divisible(out_features * width))
               for index, (blocks, kernel_size, stride, expand_ratio, out_features)
               in enumerate(stages))


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
  `reduced` features, `activation` (EfficientNet's: the block's), a 1x1 convolution back and
  the `gate` (a sigmoid; MobileNetV3's: a hard sigmoid) scale the features."""

  def __init__(self, features: int, reduced: int, activation: Callable[[jax.Array], jax.Array],
               *, layers: kernels.Layers, rngs: nnx.Rngs,
               gate: Callable[[jax.Array], jax.Array] = nnx.sigmoid):
    self.conv_reduce = common.conv(layers, features, reduced, 1, use_bias=True, rngs=rngs)
    self.conv_expand = common.conv(layers, reduced, features, 1, use_bias=True, rngs=rngs)
    self.activation, self.gate = activation, gate

  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.conv_expand(self.activation(self.conv_reduce(x.mean(axis=(1, 2),
                                                                      keepdims=True))))
    return x * self.gate(scale)


@dataclasses.dataclass(frozen=True)
class BlockStyle:
  """What the blocks of one family member share: their activation, squeeze-and-excitation (or
  none), the convolutions' padding (None: torch's; 'SAME': TensorFlow's) and BatchNorm's
  epsilon."""
  activation: Callable[[jax.Array], jax.Array] = nnx.silu
  squeeze_excite: bool = True
  padding: str | None = None
  bn_epsilon: float = 1e-5


class MBConv(nnx.Module):
  """A mobile inverted bottleneck: a 1x1 expansion by `expand_ratio` (none when 1), a
  depthwise convolution with the stride, squeeze-and-excitation (as `style` says), a linear
  1x1 projection, each batch-normalised; plus the input (under stochastic depth) where the
  shapes allow."""

  def __init__(self, in_features: int, out_features: int, kernel_size: int, stride: int,
               expand_ratio: int, drop_path_rate: float, style: BlockStyle, *,
               layers: kernels.Layers, rngs: nnx.Rngs):
    hidden = in_features * expand_ratio
    conv = functools.partial(common.conv, layers, padding=style.padding, rngs=rngs)
    norm = functools.partial(common.batch_norm, layers, epsilon=style.bn_epsilon, rngs=rngs)
    if expand_ratio != 1:
      self.conv_expansion, self.bn_expansion = conv(in_features, hidden, 1), norm(hidden)
    else:
      self.conv_expansion = self.bn_expansion = None
    self.conv_dw = conv(hidden, hidden, kernel_size, stride=stride, groups=hidden)
    self.bn_dw = norm(hidden)
    self.se = (SqueezeExcite(hidden, round(in_features * _SE_RATIO), style.activation,
                             layers=layers, rngs=rngs) if style.squeeze_excite else None)
    self.conv_projection = conv(hidden, out_features, 1)
    self.bn_projection = norm(out_features)
    self.activation = style.activation
    self.has_skip = stride == 1 and in_features == out_features
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


# Layers for layer-wise decay and linear probing, as timm's EfficientNet.group_matcher.
LAYERS = models.LayerGroups(stem=r'^(conv_stem|bn1)\.', blocks=r'^blocks\.(\d+)\.(\d+)\.',
                                head=r'classifier\.')


class EfficientNet(nnx.Module):
  """A stem of `stem_features`, stages of `MBConv` blocks as `stages` lists them, a 1x1 head
  convolution to `head_features`, average pooling and the classifier, in the blocks' `style`
  (the stem and head take its activation, padding and epsilon too). Subclasses set the first
  three, and the style where it is not B0's."""
  stages: tuple[Stage, ...]  # As `_B0_STAGES`.
  stem_features: int
  head_features: int
  style = BlockStyle()

  def __init__(self, image_shape: tuple[int, int, int], num_classes: int, *,
               layers: kernels.Layers, rngs: nnx.Rngs, drop_path_rate: float = 0.0,
               dropout_rate: float = 0.0, remat: bool = False):
    """`drop_path_rate`: stochastic depth of the last block; `dropout_rate`: dropout before the
    classifier; `remat`: recompute each block's activations in the backward pass to save
    memory."""
    common.check_rate('drop_path_rate', drop_path_rate)
    common.check_rate('dropout_rate', dropout_rate)
    num_blocks = sum(stage[0] for stage in self.stages)
    style = self.style
    conv = functools.partial(common.conv, layers, padding=style.padding, rngs=rngs)
    norm = functools.partial(common.batch_norm, layers, epsilon=style.bn_epsilon, rngs=rngs)
    self.conv_stem = conv(image_shape[-1], self.stem_features, 3, stride=2)
    self.bn1 = norm(self.stem_features)
    stages, in_features, index = [], self.stem_features, 0
    for depth, kernel_size, stride, expand_ratio, out_features in self.stages:
      blocks = []
      for block in range(depth):
        # timm's schedule here: rate * index / number of blocks (the last one stays below it).
        blocks.append(MBConv(in_features, out_features, kernel_size, stride if block == 0 else 1,
                             expand_ratio, drop_path_rate * index / num_blocks, style,
                             layers=layers, rngs=rngs))
        in_features, index = out_features, index + 1
      stages.append(nnx.List(blocks))
    self.blocks = nnx.List(stages)
    self.conv_head = conv(in_features, self.head_features, 1)
    self.bn2 = norm(self.head_features)
    self.dropout = layers.dropout(rate=dropout_rate, rngs=rngs)
    self.classifier = layers.linear(self.head_features, num_classes, rngs=rngs)
    self.remat = remat

  def pre_logits(self, x: jax.Array) -> jax.Array:
    """The pooled features the classifier takes (timm's `forward_head(forward_features(x),
    pre_logits=True)`): the embedding of `--mode=embed`."""
    activation = self.style.activation
    x = activation(self.bn1(self.conv_stem(x)))
    for stage in self.blocks:
      x = common.run_blocks(stage, x, self.remat)
    return activation(self.bn2(self.conv_head(x))).mean(axis=(1, 2))

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


def _timm_cfg(tag: str | None, input_size: int = 224, crop_pct: float = 0.875,
              mean=common.IMAGENET_MEAN, std=common.IMAGENET_STD) -> dict:
  """timm's pretrained_cfg of these models' default weights (`tag` on the Hub; None where timm
  has no weights for the name), all bicubic."""
  return common.pretrained_cfg(tag, crop_pct=crop_pct, interpolation='bicubic', mean=mean,
                               std=std, input_size=(3, input_size, input_size))


@models.MODELS.register('efficientnet_b1', key_map=KEY_MAP, layers=LAYERS,
                        pretrained=_timm_cfg('timm/efficientnet_b1.ra4_e3600_r240_in1k', 240,
                                             0.9, common.INCEPTION_MEAN, common.INCEPTION_STD))
class EfficientNetB1(EfficientNet):
  """EfficientNet-B1 (7.8M parameters with 1,000 classes): B0 1.1 times as deep."""
  stages, stem_features, head_features = scaled(_B0_STAGES, 1.0, 1.1), 32, 1280


@models.MODELS.register('efficientnet_b2', key_map=KEY_MAP, layers=LAYERS,
                        pretrained=_timm_cfg('timm/efficientnet_b2.ra_in1k', 256))
class EfficientNetB2(EfficientNet):
  """EfficientNet-B2 (9.1M parameters with 1,000 classes): 1.1 times as wide, 1.2 as deep."""
  stages = scaled(_B0_STAGES, 1.1, 1.2)
  stem_features, head_features = common.make_divisible(32 * 1.1), common.make_divisible(1280 * 1.1)


@models.MODELS.register('efficientnet_b3', key_map=KEY_MAP, layers=LAYERS,
                        pretrained=_timm_cfg('timm/efficientnet_b3.ra2_in1k', 288))
class EfficientNetB3(EfficientNet):
  """EfficientNet-B3 (12.2M parameters with 1,000 classes): 1.2 times as wide, 1.4 as deep."""
  stages = scaled(_B0_STAGES, 1.2, 1.4)
  stem_features, head_features = common.make_divisible(32 * 1.2), common.make_divisible(1280 * 1.2)


# Lite: no squeeze-and-excitation and ReLU6 (both quantise well), the stem and head at B0's
# widths whatever the multiplier, the first and last stages at B0's depth.
_LITE = BlockStyle(activation=nnx.relu6, squeeze_excite=False)


def _lite(name: str, width: float, depth: float, cfg: dict):
  """Registers EfficientNet-Lite `name`, B0's stages scaled by `width` and `depth`."""
  @models.MODELS.register(name, key_map=KEY_MAP, layers=LAYERS, pretrained=cfg)
  class Lite(EfficientNet):
    stages = scaled(_B0_STAGES, width, depth, fix_first_last=True)
    stem_features, head_features, style = 32, 1280, _LITE
  Lite.__name__ = Lite.__qualname__ = f'EfficientNet{name.split("_")[-1].title()}'
  Lite.__doc__ = f'EfficientNet-{name.split("_")[-1].title()}: B0 x{width} wide, x{depth} deep.'
  return Lite


# timm has weights for lite0 only; its configs of lite1-4 say the resolution each was made for.
EfficientNetLite0 = _lite('efficientnet_lite0', 1.0, 1.0,
                          _timm_cfg('timm/efficientnet_lite0.ra_in1k'))
EfficientNetLite1 = _lite('efficientnet_lite1', 1.0, 1.1, _timm_cfg(None, 240, 0.882))
EfficientNetLite2 = _lite('efficientnet_lite2', 1.1, 1.2, _timm_cfg(None, 260, 0.89))
EfficientNetLite3 = _lite('efficientnet_lite3', 1.2, 1.4, _timm_cfg(None, 300, 0.904))
EfficientNetLite4 = _lite('efficientnet_lite4', 1.4, 1.8, _timm_cfg(None, 380, 0.922))


@models.MODELS.register('tf_efficientnet_b0', key_map=KEY_MAP, layers=LAYERS,
                        pretrained=_timm_cfg('timm/tf_efficientnet_b0.ns_jft_in1k'))
class TFEfficientNetB0(EfficientNetB0):
  """EfficientNet-B0 as ported from TensorFlow's weights: 'SAME' padding, epsilon 1e-3."""
  style = BlockStyle(padding='SAME', bn_epsilon=1e-3)


@models.MODELS.register('tf_efficientnet_lite0', key_map=KEY_MAP, layers=LAYERS,
                        pretrained=_timm_cfg('timm/tf_efficientnet_lite0.in1k',
                                             mean=common.INCEPTION_MEAN, std=common.INCEPTION_STD))
class TFEfficientNetLite0(EfficientNetLite0):
  """EfficientNet-Lite0 as ported from TensorFlow's weights: 'SAME' padding, epsilon 1e-3."""
  style = dataclasses.replace(_LITE, padding='SAME', bn_epsilon=1e-3)


@models.MODELS.register('mobilenetv2_100', key_map=KEY_MAP, layers=LAYERS,
                        pretrained=_timm_cfg('timm/mobilenetv2_100.ra_in1k'))
class MobileNetV2(EfficientNet):
  """MobileNetV2 1.0 (3.5M parameters with 1,000 classes): ReLU6 inverted residuals without
  squeeze-and-excitation, as timm builds it (its EfficientNet class, its layout)."""
  stages, stem_features, head_features = _MOBILENET_V2_STAGES, 32, 1280
  style = BlockStyle(activation=nnx.relu6, squeeze_excite=False)
