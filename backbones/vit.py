"""Vision Transformers (Dosovitskiy et al. 2021) in timm's layout: a patch-embedding
convolution, a class token, a learned position embedding, pre-norm blocks with a fused qkv
projection, a final LayerNorm and the classifier on the class token."""

from flax import nnx
import jax
import jax.numpy as jnp

from backbones import common
from backbones import weights
import kernels
import models

# timm's keys -> this module's paths (its attribute names are timm's).
KEY_MAP = (
    (r'cls_token', 'cls_token', 'copy'),
    (r'pos_embed', 'pos_embed', 'pos_embed'),
    *weights.conv_rules(r'patch_embed\.proj', 'patch_embed'),
    *weights.norm_rules(r'(blocks\.\d+\.norm\d|norm)', r'\1'),
    *weights.linear_rules(r'(blocks\.\d+\.(?:attn\.qkv|attn\.proj|mlp\.fc\d))', r'\1'),
    *weights.linear_rules(r'head', 'head'),
)


class Attention(nnx.Module):
  """Multi-head self-attention with timm's fused qkv projection: one (features, 3 x features)
  matmul whose output splits into query, key and value, each head-major, as timm's `qkv`
  weights are laid out (so they load as one linear layer, in the app's compute dtype)."""

  def __init__(self, features: int, num_heads: int, *, layers: kernels.Layers, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.attend = layers.attention  # jax.nn.dot_product_attention or its XLA:CPU stand-in.
    self.qkv = layers.linear(features, 3 * features, kernel_init=common.TRUNC_NORMAL, rngs=rngs)
    self.proj = layers.linear(features, features, kernel_init=common.TRUNC_NORMAL, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, tokens, features = x.shape
    qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, features // self.num_heads)
    # Slices, not indexing: with a symbolic batch size (export), jnp's `qkv[:, :, 0]` is a
    # gather, which TFLite's converter cannot translate.
    query, key, value = (jax.lax.index_in_dim(qkv, part, axis=2, keepdims=False)
                         for part in range(3))
    # Scaled by 1 / sqrt(head features), softmax over the keys, as torch's SDPA.
    x = self.attend(query, key, value)
    return self.proj(x.reshape(batch, tokens, features))


class Block(nnx.Module):
  """A pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x)), each residual
  branch under stochastic depth."""

  def __init__(self, features: int, num_heads: int, drop_path_rate: float, *,
               layers: kernels.Layers, rngs: nnx.Rngs):
    self.norm1 = common.layer_norm(features, rngs=rngs)
    self.attn = Attention(features, num_heads, layers=layers, rngs=rngs)
    self.norm2 = common.layer_norm(features, rngs=rngs)
    self.mlp = common.Mlp(features, 4 * features, layers=layers, rngs=rngs)
    self.drop_path = common.DropPath(drop_path_rate, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.drop_path(self.attn(self.norm1(x)))
    return x + self.drop_path(self.mlp(self.norm2(x)))


class VisionTransformer(nnx.Module):
  """ViT with 16x16 patches, `depth` blocks of `features` features and `num_heads` heads.

  The position embedding has one row per patch of `image_shape` (whose height and width are
  cut into whole patches, a remainder dropped as torch's convolution does) plus one for the
  class token; weights for another grid are resampled on import (`weights.resample_pos_embed`).
  Subclasses set `features`, `depth` and `num_heads`.
  """
  patch_size = 16
  features: int
  depth: int
  num_heads: int

  def __init__(self, image_shape: tuple[int, int, int], num_classes: int, *,
               layers: kernels.Layers, rngs: nnx.Rngs, drop_path_rate: float = 0.0,
               dropout_rate: float = 0.0, remat: bool = False):
    """Options: see `common.drop_path_rates`."""
    rates = common.drop_path_rates(drop_path_rate, self.depth, dropout_rate)
    height, width, channels = image_shape
    grid_size = (height // self.patch_size, width // self.patch_size)
    if min(grid_size) < 1:
      raise ValueError(f'images of {height}x{width} are smaller than one {self.patch_size}x'
                       f'{self.patch_size} patch')
    self.patch_embed = common.conv(layers, channels, self.features, self.patch_size,
                                   stride=self.patch_size, padding=0, use_bias=True,
                                   kernel_init=common.TRUNC_NORMAL, rngs=rngs)
    self.cls_token = nnx.Param(1e-6 * jax.random.normal(rngs.params(), (1, 1, self.features)))
    # `grid_size` tells the weight import which grid to resample a checkpoint's rows to.
    self.pos_embed = nnx.Param(
        common.TRUNC_NORMAL(rngs.params(), (1, 1 + grid_size[0] * grid_size[1], self.features)),
        grid_size=grid_size)
    self.blocks = nnx.List([
        Block(self.features, self.num_heads, rate, layers=layers, rngs=rngs) for rate in rates])
    self.norm = common.layer_norm(self.features, rngs=rngs)
    self.dropout = layers.dropout(rate=dropout_rate, rngs=rngs)
    self.head = layers.linear(self.features, num_classes, kernel_init=common.TRUNC_NORMAL,
                              rngs=rngs)
    self.remat = remat

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.patch_embed(x)
    x = x.reshape(x.shape[0], -1, x.shape[-1])  # Row-major patches, as torch's flatten(2).
    cls_token = jnp.broadcast_to(self.cls_token[...], (x.shape[0], 1, x.shape[-1]))
    x = jnp.concatenate([cls_token.astype(x.dtype), x], axis=1)
    x = x + self.pos_embed[...].astype(x.dtype)
    x = self.norm(common.run_blocks(self.blocks, x, self.remat))
    # The class token, sliced: see `Attention` for why not `x[:, 0]`.
    return common.head(jax.lax.index_in_dim(x, 0, axis=1, keepdims=False), self.dropout,
                       self.head)


# timm's default weights of each: AugReg's ImageNet-21k pre-training fine-tuned on ImageNet-1k
# (Steiner et al. 2021), inputs scaled to [-1, 1], a 0.9 crop and bicubic resizing.
_AUGREG = dict(crop_pct=0.9, interpolation='bicubic', mean=common.INCEPTION_MEAN,
               std=common.INCEPTION_STD)


# Layers for layer-wise decay and linear probing, as timm's VisionTransformer.group_matcher.
LAYERS = models.LayerGroups(stem=r'^(cls_token|pos_embed|patch_embed)',
                                blocks=r'^blocks\.(\d+)\.', head=r'head\.')


@models.MODELS.register(
    'vit_tiny_patch16_224', key_map=KEY_MAP, layers=LAYERS,
    pretrained=common.pretrained_cfg('timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k', **_AUGREG))
class ViTTiny(VisionTransformer):
  """ViT-Ti/16: 192 features, 12 blocks, 3 heads (5.7M parameters with 1,000 classes)."""
  features, depth, num_heads = 192, 12, 3


@models.MODELS.register(
    'vit_small_patch16_224', key_map=KEY_MAP, layers=LAYERS,
    pretrained=common.pretrained_cfg('timm/vit_small_patch16_224.augreg_in21k_ft_in1k',
                                     **_AUGREG))
class ViTSmall(VisionTransformer):
  """ViT-S/16: 384 features, 12 blocks, 6 heads (22.1M parameters with 1,000 classes)."""
  features, depth, num_heads = 384, 12, 6


@models.MODELS.register(
    'vit_base_patch16_224', key_map=KEY_MAP, layers=LAYERS,
    pretrained=common.pretrained_cfg('timm/vit_base_patch16_224.augreg2_in21k_ft_in1k',
                                     **_AUGREG))
class ViTBase(VisionTransformer):
  """ViT-B/16: 768 features, 12 blocks, 12 heads (86.6M parameters with 1,000 classes)."""
  features, depth, num_heads = 768, 12, 12
