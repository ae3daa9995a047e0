"""ResNet-18/34/50 (He et al. 2016) in the layout of torchvision and timm (v1.5: the stride on
the 3x3 convolution of the bottleneck), so that their ImageNet weights load as they are."""

from flax import nnx
import jax

from backbones import common
from backbones import weights
import kernels
import models

# torch keys (timm's and torchvision's are the same) -> this module's paths; attribute names
# mirror torch's, so the map mostly says which transform each kind of layer needs.
KEY_MAP = (
    *weights.conv_rules(r'((?:layer\d\.\d+\.)?conv\d)', r'\1'),
    *weights.norm_rules(r'((?:layer\d\.\d+\.)?bn\d)', r'\1'),
    *weights.conv_rules(r'(layer\d\.\d+)\.downsample\.0', r'\1.downsample_conv'),
    *weights.norm_rules(r'(layer\d\.\d+)\.downsample\.1', r'\1.downsample_bn'),
    *weights.linear_rules(r'fc', 'fc'),
)


class _ResidualBlock(nnx.Module):
  """What both blocks share: the shortcut, stochastic depth on the residual branch and the ReLU
  after the sum. Subclasses build `branch_out_features` and `_branch`."""

  def _init_shortcut(self, in_features: int, out_features: int, stride: int,
                     drop_path_rate: float, layers: kernels.Layers, rngs: nnx.Rngs) -> None:
    """A strided 1x1 convolution and BatchNorm fit the input to the branch where its size or
    width differ (torch's `downsample`), else the shortcut is the input."""
    if stride != 1 or in_features != out_features:
      self.downsample_conv = common.conv(layers, in_features, out_features, 1, stride=stride,
                                         rngs=rngs)
      self.downsample_bn = common.batch_norm(layers, out_features, rngs=rngs)
    else:
      self.downsample_conv = self.downsample_bn = None
    self.drop_path = common.DropPath(drop_path_rate, rngs=rngs)

  def _branch(self, x: jax.Array) -> jax.Array:
    raise NotImplementedError

  def __call__(self, x: jax.Array) -> jax.Array:
    shortcut = x if self.downsample_conv is None else self.downsample_bn(self.downsample_conv(x))
    return nnx.relu(self.drop_path(self._branch(x)) + shortcut)


class BasicBlock(_ResidualBlock):
  """Two 3x3 convolutions (ResNet-18/34); the first carries the stride."""
  expansion = 1

  def __init__(self, in_features: int, width: int, stride: int, drop_path_rate: float, *,
               layers: kernels.Layers, rngs: nnx.Rngs):
    self.conv1 = common.conv(layers, in_features, width, 3, stride=stride, rngs=rngs)
    self.bn1 = common.batch_norm(layers, width, rngs=rngs)
    self.conv2 = common.conv(layers, width, width, 3, rngs=rngs)
    self.bn2 = common.batch_norm(layers, width, zero_scale=True, rngs=rngs)
    self._init_shortcut(in_features, width, stride, drop_path_rate, layers, rngs)

  def _branch(self, x: jax.Array) -> jax.Array:
    return self.bn2(self.conv2(nnx.relu(self.bn1(self.conv1(x)))))


class Bottleneck(_ResidualBlock):
  """1x1 reduce, 3x3 (with the stride: ResNet v1.5), 1x1 expand to 4x `width` (ResNet-50)."""
  expansion = 4

  def __init__(self, in_features: int, width: int, stride: int, drop_path_rate: float, *,
               layers: kernels.Layers, rngs: nnx.Rngs):
    out_features = width * self.expansion
    self.conv1 = common.conv(layers, in_features, width, 1, rngs=rngs)
    self.bn1 = common.batch_norm(layers, width, rngs=rngs)
    self.conv2 = common.conv(layers, width, width, 3, stride=stride, rngs=rngs)
    self.bn2 = common.batch_norm(layers, width, rngs=rngs)
    self.conv3 = common.conv(layers, width, out_features, 1, rngs=rngs)
    self.bn3 = common.batch_norm(layers, out_features, zero_scale=True, rngs=rngs)
    self._init_shortcut(in_features, out_features, stride, drop_path_rate, layers, rngs)

  def _branch(self, x: jax.Array) -> jax.Array:
    x = nnx.relu(self.bn1(self.conv1(x)))
    x = nnx.relu(self.bn2(self.conv2(x)))
    return self.bn3(self.conv3(x))


class ResNet(nnx.Module):
  """A 7x7 stride-2 stem and 3x3 stride-2 max pool, four stages of `depths` blocks of `widths`
  (each stage after the first halving the resolution), global average pooling, dropout and the
  classifier `fc`. Subclasses set `block` and `depths`."""
  block: type[_ResidualBlock]
  depths: tuple[int, int, int, int]
  widths: tuple[int, int, int, int] = (64, 128, 256, 512)  # The stem's is the first stage's.

  def __init__(self, image_shape: tuple[int, int, int], num_classes: int, *,
               layers: kernels.Layers, rngs: nnx.Rngs, drop_path_rate: float = 0.0,
               dropout_rate: float = 0.0, remat: bool = False):
    """Options: see `common.drop_path_rates`."""
    rates = iter(common.drop_path_rates(drop_path_rate, sum(self.depths), dropout_rate))
    self.conv1 = common.conv(layers, image_shape[-1], self.widths[0], 7, stride=2, rngs=rngs)
    self.bn1 = common.batch_norm(layers, self.widths[0], rngs=rngs)
    stages, in_features = [], self.widths[0]
    for stage, (width, depth) in enumerate(zip(self.widths, self.depths)):
      blocks = []
      for index in range(depth):
        stride = 2 if stage > 0 and index == 0 else 1
        blocks.append(self.block(in_features, width, stride, next(rates), layers=layers,
                                 rngs=rngs))
        in_features = width * self.block.expansion
      stages.append(nnx.List(blocks))
    # torch's names, so that its keys map one to one.
    self.layer1, self.layer2, self.layer3, self.layer4 = stages
    self.dropout = layers.dropout(rate=dropout_rate, rngs=rngs)
    self.fc = layers.linear(in_features, num_classes, rngs=rngs)
    self.max_pool = layers.max_pool
    self.remat = remat

  def pre_logits(self, x: jax.Array) -> jax.Array:
    """The pooled features the classifier takes (timm's `forward_head(forward_features(x),
    pre_logits=True)`): the embedding of `--mode=embed`."""
    x = nnx.relu(self.bn1(self.conv1(x)))
    # torch's MaxPool2d(3, 2, padding=1) pads with -inf, as flax's max_pool does.
    x = self.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
      x = common.run_blocks(stage, x, self.remat)
    return x.mean(axis=(1, 2))

  def logits(self, features: jax.Array) -> jax.Array:
    return common.head(features, self.dropout, self.fc)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.logits(self.pre_logits(x))


# timm's default weights of each (its first tag): torch's ResNet recipe A1 (Wightman et al.
# 2021), evaluated at 224 px with a 0.95 crop and bicubic resizing.
_A1_IN1K = dict(crop_pct=0.95, interpolation='bicubic', mean=common.IMAGENET_MEAN,
                std=common.IMAGENET_STD)


# Layers for layer-wise decay and linear probing, as timm's ResNet.group_matcher (fine).
LAYERS = models.LayerGroups(stem=r'^(conv1|bn1)\.', blocks=r'^layer(\d+)\.(\d+)\.',
                                head=r'fc\.')


@models.MODELS.register('resnet18', key_map=KEY_MAP, layers=LAYERS,
                        pretrained=common.pretrained_cfg('timm/resnet18.a1_in1k', **_A1_IN1K))
class ResNet18(ResNet):
  """ResNet-18: basic blocks, 2-2-2-2 (11.7M parameters with 1,000 classes)."""
  block, depths = BasicBlock, (2, 2, 2, 2)


@models.MODELS.register('resnet34', key_map=KEY_MAP, layers=LAYERS,
                        pretrained=common.pretrained_cfg('timm/resnet34.a1_in1k', **_A1_IN1K))
class ResNet34(ResNet):
  """ResNet-34: basic blocks, 3-4-6-3 (21.8M parameters with 1,000 classes)."""
  block, depths = BasicBlock, (3, 4, 6, 3)


@models.MODELS.register('resnet50', key_map=KEY_MAP, layers=LAYERS,
                        pretrained=common.pretrained_cfg('timm/resnet50.a1_in1k', **_A1_IN1K))
class ResNet50(ResNet):
  """ResNet-50: bottleneck blocks, 3-4-6-3 (25.6M parameters with 1,000 classes)."""
  block, depths = Bottleneck, (3, 4, 6, 3)
