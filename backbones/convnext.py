"""ConvNeXt (Liu et al. 2022) in timm's layout: a 4x4 patchify stem, four stages of blocks
(7x7 depthwise convolution, LayerNorm, MLP, layer scale), LayerNorm + strided 2x2 convolution
between stages, then average pooling, LayerNorm and the classifier."""

from flax import nnx
import jax
import jax.numpy as jnp

from backbones import common
from backbones import weights
import kernels
import models

_BLOCK = r'stages\.\d+\.blocks\.\d+'
# timm's keys -> this module's paths; torchvision's after.
KEY_MAP = (
    *weights.conv_rules(r'stem\.0', 'stem_conv'),
    *weights.norm_rules(r'stem\.1', 'stem_norm'),
    *weights.norm_rules(r'(stages\.\d+)\.downsample\.0', r'\1.downsample_norm'),
    *weights.conv_rules(r'(stages\.\d+)\.downsample\.1', r'\1.downsample_conv'),
    *weights.conv_rules(rf'({_BLOCK}\.conv_dw)', r'\1'),
    *weights.norm_rules(rf'({_BLOCK}\.norm)', r'\1'),
    *weights.linear_rules(rf'({_BLOCK}\.mlp\.fc\d)', r'\1'),
    (rf'({_BLOCK}\.gamma)', r'\1', 'copy'),
    *weights.norm_rules(r'head\.norm', 'head_norm'),
    *weights.linear_rules(r'head\.fc', 'head'),
    # torchvision's keys (convnext_tiny and kin): `features` alternates the stem or a
    # downsampling (even indices) with a stage's blocks (odd), each block a `Sequential`.
    *weights.conv_rules(r'features\.0\.0', 'stem_conv'),
    *weights.norm_rules(r'features\.0\.1', 'stem_norm'),
    *(rule for stage in range(1, 4) for rule in (
        *weights.norm_rules(rf'features\.{2 * stage}\.0', f'stages.{stage}.downsample_norm'),
        *weights.conv_rules(rf'features\.{2 * stage}\.1', f'stages.{stage}.downsample_conv'))),
    *(rule for stage in range(4) for rule in (
        *weights.conv_rules(rf'features\.{2 * stage + 1}\.(\d+)\.block\.0',
                            rf'stages.{stage}.blocks.\1.conv_dw'),
        *weights.norm_rules(rf'features\.{2 * stage + 1}\.(\d+)\.block\.2',
                            rf'stages.{stage}.blocks.\1.norm'),
        *weights.linear_rules(rf'features\.{2 * stage + 1}\.(\d+)\.block\.3',
                              rf'stages.{stage}.blocks.\1.mlp.fc1'),
        *weights.linear_rules(rf'features\.{2 * stage + 1}\.(\d+)\.block\.5',
                              rf'stages.{stage}.blocks.\1.mlp.fc2'),
        (rf'features\.{2 * stage + 1}\.(\d+)\.layer_scale', rf'stages.{stage}.blocks.\1.gamma',
         'reshape'))),
    *weights.norm_rules(r'classifier\.0', 'head_norm'),
    *weights.linear_rules(r'classifier\.2', 'head'),
)


class Block(nnx.Module):
  """x + drop_path(gamma * mlp(norm(depthwise 7x7 conv(x)))), in NHWC throughout: timm's
  permutes to channels-last for the norm and MLP are no-ops here."""

  def __init__(self, features: int, drop_path_rate: float, *, layers: kernels.Layers,
               rngs: nnx.Rngs):
    self.conv_dw = common.conv(layers, features, features, 7, groups=features, use_bias=True,
                               kernel_init=common.TRUNC_NORMAL, rngs=rngs)
    self.norm = common.layer_norm(layers, features, rngs=rngs)
    self.mlp = common.Mlp(features, 4 * features, layers=layers, rngs=rngs)
    # Layer scale: each block starts close to the identity (timm's ls_init_value).
    self.gamma = nnx.Param(jnp.full((features,), 1e-6))
    self.drop_path = common.DropPath(drop_path_rate, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    branch = self.mlp(self.norm(self.conv_dw(x))) * self.gamma[...].astype(x.dtype)
    return x + self.drop_path(branch)


class Stage(nnx.Module):
  """Blocks of `out_features`; when the width changes, a LayerNorm and a 2x2 stride-2
  convolution first halve the resolution."""

  def __init__(self, in_features: int, out_features: int, drop_path_rates: list[float], *,
               layers: kernels.Layers, rngs: nnx.Rngs):
    if in_features != out_features:
      self.downsample_norm = common.layer_norm(layers, in_features, rngs=rngs)
      self.downsample_conv = common.conv(layers, in_features, out_features, 2, stride=2,
                                         padding=0, use_bias=True,
                                         kernel_init=common.TRUNC_NORMAL, rngs=rngs)
    else:
      self.downsample_norm = self.downsample_conv = None
    self.blocks = nnx.List([Block(out_features, rate, layers=layers, rngs=rngs)
                            for rate in drop_path_rates])

  def __call__(self, x: jax.Array, remat: bool) -> jax.Array:
    if self.downsample_conv is not None:
      x = self.downsample_conv(self.downsample_norm(x))
    return common.run_blocks(self.blocks, x, remat)


class ConvNeXt(nnx.Module):
  """ConvNeXt with `depths` blocks per stage of `widths` features. Subclasses set both."""
  depths: tuple[int, int, int, int]
  widths: tuple[int, int, int, int]

  def __init__(self, image_shape: tuple[int, int, int], num_classes: int, *,
               layers: kernels.Layers, rngs: nnx.Rngs, drop_path_rate: float = 0.0,
               dropout_rate: float = 0.0, remat: bool = False):
    """Options: see `common.drop_path_rates`."""
    rates = common.drop_path_rates(drop_path_rate, sum(self.depths), dropout_rate)
    self.stem_conv = common.conv(layers, image_shape[-1], self.widths[0], 4, stride=4,
                                 padding=0, use_bias=True, kernel_init=common.TRUNC_NORMAL,
                                 rngs=rngs)
    self.stem_norm = common.layer_norm(layers, self.widths[0], rngs=rngs)
    stages, in_features, first_block = [], self.widths[0], 0
    for width, depth in zip(self.widths, self.depths):
      stages.append(Stage(in_features, width, rates[first_block:first_block + depth],
                          layers=layers, rngs=rngs))
      in_features, first_block = width, first_block + depth
    self.stages = nnx.List(stages)
    self.head_norm = common.layer_norm(layers, in_features, rngs=rngs)
    self.dropout = layers.dropout(rate=dropout_rate, rngs=rngs)
    self.head = layers.linear(in_features, num_classes, kernel_init=common.TRUNC_NORMAL,
                              rngs=rngs)
    self.remat = remat

  def pre_logits(self, x: jax.Array) -> jax.Array:
    """The pooled features the classifier takes (timm's `forward_head(forward_features(x),
    pre_logits=True)`): the embedding of `--mode=embed`."""
    x = self.stem_norm(self.stem_conv(x))
    for stage in self.stages:
      x = stage(x, self.remat)
    return self.head_norm(x.mean(axis=(1, 2)))

  def logits(self, features: jax.Array) -> jax.Array:
    return common.head(features, self.dropout, self.head)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.logits(self.pre_logits(x))


# Layers for layer-wise decay and linear probing, as timm's ConvNeXt.group_matcher (fine): a
# stage's downsampling comes before its blocks.
LAYERS = models.LayerGroups(stem=r'^stem_', head=r'head\.',
                                blocks=r'^stages\.(\d+)\.(?:downsample_|blocks\.(\d+)\.)')


@models.MODELS.register(
    'convnext_tiny', key_map=KEY_MAP, layers=LAYERS,
    # timm's default weights: ImageNet-12k pre-training fine-tuned on ImageNet-1k.
    pretrained=common.pretrained_cfg('timm/convnext_tiny.in12k_ft_in1k', crop_pct=0.95,
                                     interpolation='bicubic', mean=common.IMAGENET_MEAN,
                                     std=common.IMAGENET_STD))
class ConvNeXtTiny(ConvNeXt):
  """ConvNeXt-T: 3-3-9-3 blocks of 96-768 features (28.6M parameters with 1,000 classes)."""
  depths, widths = (3, 3, 9, 3), (96, 192, 384, 768)
