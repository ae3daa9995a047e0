"""What the backbones share: torch-equivalent convolutions and norms, stochastic depth, option
checks and the loop over blocks (with optional rematerialisation).

The backbones reproduce timm's models operation for operation so that timm's and torchvision's
weights give the same logits; the helpers here hold the few places where torch's and flax's
defaults differ (padding, epsilons).
"""

from collections.abc import Callable, Sequence

from flax import nnx
import jax
import jax.numpy as jnp

import kernels

# ImageNet statistics of timm's `IMAGENET_DEFAULT_MEAN/STD` and `IMAGENET_INCEPTION_MEAN/STD`.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
INCEPTION_MEAN = (0.5, 0.5, 0.5)
INCEPTION_STD = (0.5, 0.5, 0.5)
# OpenAI CLIP's image statistics (timm's `OPENAI_CLIP_MEAN/STD`).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# He et al.'s initialisation for convolutions followed by ReLU (torch's kaiming_normal_ fan_out).
HE_NORMAL = nnx.initializers.variance_scaling(2.0, 'fan_out', 'normal')
# timm's trunc_normal_(std=0.02) for transformer and ConvNeXt weights.
TRUNC_NORMAL = nnx.initializers.truncated_normal(stddev=0.02)


def pretrained_cfg(hf_hub_id: str | None, crop_pct: float, interpolation: str,
                   mean: tuple[float, ...], std: tuple[float, ...],
                   input_size: tuple[int, int, int] = (3, 224, 224)) -> dict:
  """timm's `pretrained_cfg` values of a model's default weights, which the app's preprocessing
  must reproduce (resize, crop, normalisation); `hf_hub_id` names those weights on the Hub
  (None for weights that are not there, such as torchvision's)."""
  return dict(**({'hf_hub_id': hf_hub_id} if hf_hub_id else {}), input_size=input_size,
              crop_pct=crop_pct, interpolation=interpolation, mean=mean, std=std)


def check_rate(name: str, value: float) -> None:
  """Raises ValueError unless `value`, the option `name`, is a probability in [0, 1)."""
  if not 0.0 <= value < 1.0:
    raise ValueError(f'{name} must be in [0, 1), not {value!r}')


def drop_path_rates(drop_path_rate: float, num_blocks: int,
                    dropout_rate: float = 0.0) -> list[float]:
  """Stochastic depth growing linearly from 0 at the first block to `drop_path_rate` at the
  last, as in timm (and Huang et al. 2016); `dropout_rate` (before the classifier) checked too.

  The backbones' options, the same for each: `drop_path_rate` (of the last block),
  `dropout_rate` (before the classifier) and `remat` (recompute each block's activations in the
  backward pass to save memory)."""
  check_rate('drop_path_rate', drop_path_rate)
  check_rate('dropout_rate', dropout_rate)
  return [drop_path_rate * index / max(num_blocks - 1, 1) for index in range(num_blocks)]


def make_divisible(value: float, divisor: int = 8) -> int:
  """timm's `make_divisible`: the multiple of `divisor` nearest `value` (at least `divisor`),
  one more when that loses over 10% of it. Widths scaled by a multiplier use it (timm's
  `round_channels`), and MobileNets' expanded and squeeze-excitation widths."""
  rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
  return rounded + divisor if rounded < 0.9 * value else rounded


def conv(layers: kernels.Layers, in_features: int, out_features: int, kernel_size: int, *,
         rngs: nnx.Rngs, stride: int = 1, padding: int | str | None = None, groups: int = 1,
         use_bias: bool = False, kernel_init=HE_NORMAL) -> nnx.Conv:
  """A torch `Conv2d` from `layers.conv`: square kernel, padded `padding` pixels on every side
  (default: (kernel_size - 1) // 2, torch's and timm's), `groups` feature groups; or 'SAME',
  TensorFlow's padding (more at the bottom and right when uneven: timm's `pad_type='same'`
  of its models ported from TensorFlow, the tf_ ones), which is flax's.

  torch pads symmetrically; flax's 'SAME' pads the extra row at the bottom, which differs for
  stride 2, so strided convolutions get explicit padding. Stride-1 ones whose symmetric padding
  is 'SAME' say 'SAME', which the XLA:CPU layers compute faster in training.
  """
  padding = (kernel_size - 1) // 2 if padding is None else padding
  if padding == 'SAME' or (stride == 1 and 2 * padding == kernel_size - 1):
    flax_padding = 'SAME'
  else:
    flax_padding = ((padding, padding), (padding, padding))
  return layers.conv(in_features, out_features, kernel_size=(kernel_size, kernel_size),
                     strides=(stride, stride), padding=flax_padding, feature_group_count=groups,
                     use_bias=use_bias, kernel_init=kernel_init, rngs=rngs)


def batch_norm(layers: kernels.Layers, features: int, *, rngs: nnx.Rngs,
               zero_scale: bool = False, epsilon: float = 1e-5) -> nnx.BatchNorm:
  """A torch `BatchNorm2d` (eps 1e-5 unless given, torch momentum 0.1 = flax's 0.9);
  `zero_scale` starts it at zero, so that a residual block starts as the identity (timm's
  `zero_init_last`)."""
  scale_init = nnx.initializers.zeros if zero_scale else nnx.initializers.ones
  return layers.batch_norm(features, epsilon=epsilon, momentum=0.9, scale_init=scale_init,
                           rngs=rngs)


def layer_norm(layers: kernels.Layers, features: int, *, rngs: nnx.Rngs,
               epsilon: float = 1e-6) -> nnx.LayerNorm:
  """timm's LayerNorm of ViT and ConvNeXt from `layers.layer_norm` (eps 1e-6 unless given:
  CLIP's is torch's 1e-5) over the last (channel) axis."""
  return layers.layer_norm(features, epsilon=epsilon, rngs=rngs)


def quick_gelu(x: jax.Array) -> jax.Array:
  """OpenAI CLIP's QuickGELU, x * sigmoid(1.702 x) (timm's `QuickGELU`)."""
  return x * jax.nn.sigmoid(1.702 * x)


class Mlp(nnx.Module):
  """The feed-forward block of transformers and ConvNeXt: `fc1` to `hidden` features, the
  `activation` (unless given, the exact GELU of `layers`: torch's `nn.GELU()`, not flax's
  default tanh approximation), `fc2` back, on the last axis."""

  def __init__(self, features: int, hidden: int, *, layers: kernels.Layers, rngs: nnx.Rngs,
               activation: Callable[[jax.Array], jax.Array] | None = None):
    self.fc1 = layers.linear(features, hidden, kernel_init=TRUNC_NORMAL, rngs=rngs)
    self.fc2 = layers.linear(hidden, features, kernel_init=TRUNC_NORMAL, rngs=rngs)
    self.activation = activation or layers.gelu

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(self.activation(self.fc1(x)))


class DropPath(nnx.Module):
  """Stochastic depth (Huang et al. 2016): drops a residual branch for whole examples in
  training, scaling the kept ones by 1 / (1 - rate); the identity in eval mode.

  Like `nnx.Dropout` it holds `deterministic`, which `model.eval()` and
  `model.set_attributes(deterministic=...)` set, and draws from the 'dropout' stream of `rngs`.
  """

  def __init__(self, rate: float, *, rngs: nnx.Rngs, deterministic: bool = False):
    self.rate = rate
    self.deterministic = deterministic
    # Only a branch that can be dropped keeps a stream: the RNG state stays out of the others.
    self.rngs = rngs['dropout'].fork() if rate > 0 else None

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.deterministic or self.rate == 0.0:
      return x
    keep = jax.random.bernoulli(self.rngs(), 1.0 - self.rate, (x.shape[0],) + (1,) * (x.ndim - 1))
    return x * (keep.astype(x.dtype) / (1.0 - self.rate))


def run_blocks(blocks: Sequence[nnx.Module], x: jax.Array, remat: bool) -> jax.Array:
  """`x` through `blocks` in order; with `remat`, each block's activations are recomputed in
  the backward pass instead of kept (less memory, about one more forward pass of compute)."""
  call: Callable[[nnx.Module, jax.Array], jax.Array] = lambda block, y: block(y)
  if remat:
    call = nnx.remat(call)
  for block in blocks:
    x = call(block, x)
  return x


def head(features: jax.Array, dropout: nnx.Dropout, linear: nnx.Linear) -> jax.Array:
  """The classifier on pooled `features`: dropout, then the linear layer, in float32 logits
  whatever the compute dtype (as the app's models)."""
  return linear(dropout(features)).astype(jnp.float32)

