"""Vision Transformers (Dosovitskiy et al. 2021) in timm's layout: a patch-embedding
convolution, a class token, a learned position embedding, pre-norm blocks with a fused qkv
projection, a final LayerNorm and the classifier on the class token. DINOv2's (Oquab et al.
2023) are the same with 14x14 patches and layer scale, those with registers (Darcet et al. 2024)
with 4 more learned tokens."""

from collections.abc import Callable

from flax import nnx
import jax
import jax.numpy as jnp

from backbones import common
from backbones import weights
import kernels
import models

# timm's keys -> this module's paths (its attribute names are timm's); torchvision's after.
KEY_MAP = (
    (r'cls_token', 'cls_token', 'copy'),
    (r'reg_token', 'reg_token', 'copy'),
    (r'dist_token', 'dist_token', 'copy'),
    (r'attn_pool\.latent', 'attn_pool.latent', 'copy'),
    *weights.linear_rules(r'(attn_pool\.(?:q|kv|proj|mlp\.fc\d))', r'\1'),
    *weights.norm_rules(r'attn_pool\.norm', 'attn_pool.norm'),
    (r'pos_embed', 'pos_embed', 'pos_embed'),
    *weights.conv_rules(r'patch_embed\.proj', 'patch_embed'),
    *weights.norm_rules(r'(blocks\.\d+\.norm\d|norm|norm_pre)', r'\1'),
    *weights.linear_rules(r'(blocks\.\d+\.(?:attn\.qkv|attn\.proj|mlp\.fc\d))', r'\1'),
    (r'(blocks\.\d+\.ls\d\.gamma)', r'\1', 'copy'),
    *weights.linear_rules(r'head', 'head'),
    *weights.linear_rules(r'head_dist', 'head_dist'),
    # torchvision's keys (its VisionTransformer: vit_b_16 and kin), into the same paths.
    (r'class_token', 'cls_token', 'copy'),
    (r'encoder\.pos_embedding', 'pos_embed', 'pos_embed'),
    *weights.conv_rules(r'conv_proj', 'patch_embed'),
    *weights.norm_rules(r'encoder\.layers\.encoder_layer_(\d+)\.ln_(\d)', r'blocks.\1.norm\2'),
    (r'encoder\.layers\.encoder_layer_(\d+)\.self_attention\.in_proj_weight',
     r'blocks.\1.attn.qkv.kernel', 'linear'),
    (r'encoder\.layers\.encoder_layer_(\d+)\.self_attention\.in_proj_bias',
     r'blocks.\1.attn.qkv.bias', 'copy'),
    *weights.linear_rules(r'encoder\.layers\.encoder_layer_(\d+)\.self_attention\.out_proj',
                          r'blocks.\1.attn.proj'),
    *weights.linear_rules(r'encoder\.layers\.encoder_layer_(\d+)\.mlp\.0', r'blocks.\1.mlp.fc1'),
    *weights.linear_rules(r'encoder\.layers\.encoder_layer_(\d+)\.mlp\.3', r'blocks.\1.mlp.fc2'),
    *weights.norm_rules(r'encoder\.ln', 'norm'),
    *weights.linear_rules(r'heads\.head', 'head'),
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


class AttentionPool(nnx.Module):
  """timm's AttentionPoolLatent (SigLIP's 'map' head, Zhai et al. 2023): a learned query attends
  over the tokens (multi-head, keys and values from one projection), then a residual MLP; its
  one output token is the pooled features."""

  def __init__(self, features: int, num_heads: int, *, layers: kernels.Layers, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.attend = layers.attention
    self.latent = nnx.Param(1e-6 * jax.random.normal(rngs.params(), (1, 1, features)))
    self.q = layers.linear(features, features, kernel_init=common.TRUNC_NORMAL, rngs=rngs)
    self.kv = layers.linear(features, 2 * features, kernel_init=common.TRUNC_NORMAL, rngs=rngs)
    self.proj = layers.linear(features, features, kernel_init=common.TRUNC_NORMAL, rngs=rngs)
    self.norm = common.layer_norm(layers, features, rngs=rngs)
    self.mlp = common.Mlp(features, 4 * features, layers=layers, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, tokens, features = x.shape
    heads = (self.num_heads, features // self.num_heads)
    latent = jnp.broadcast_to(self.latent[...], (batch, 1, features)).astype(x.dtype)
    query = self.q(latent).reshape(batch, 1, *heads)
    kv = self.kv(x).reshape(batch, tokens, 2, *heads)
    key, value = (jax.lax.index_in_dim(kv, part, axis=2, keepdims=False) for part in range(2))
    x = self.proj(self.attend(query, key, value).reshape(batch, 1, features))
    x = x + self.mlp(self.norm(x))
    return _token(x, 0)


class LayerScale(nnx.Module):
  """timm's LayerScale (Touvron et al. 2021): a learned scale per feature of a residual branch,
  starting at `init_values` so that each block starts close to the identity."""

  def __init__(self, features: int, init_values: float):
    self.gamma = nnx.Param(jnp.full((features,), init_values))

  def __call__(self, x: jax.Array) -> jax.Array:
    return x * self.gamma[...].astype(x.dtype)


class Block(nnx.Module):
  """A pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x)), each residual
  branch under stochastic depth, and scaled by a `LayerScale` (`ls1`, `ls2`) if `init_values`
  is set (timm's Identity otherwise)."""

  def __init__(self, features: int, num_heads: int, drop_path_rate: float,
               init_values: float | None, *, layers: kernels.Layers, rngs: nnx.Rngs,
               epsilon: float = 1e-6,
               activation: Callable[[jax.Array], jax.Array] | None = None):
    self.norm1 = common.layer_norm(layers, features, rngs=rngs, epsilon=epsilon)
    self.attn = Attention(features, num_heads, layers=layers, rngs=rngs)
    self.ls1 = LayerScale(features, init_values) if init_values else None
    self.norm2 = common.layer_norm(layers, features, rngs=rngs, epsilon=epsilon)
    self.mlp = common.Mlp(features, 4 * features, layers=layers, rngs=rngs,
                          activation=activation)
    self.ls2 = LayerScale(features, init_values) if init_values else None
    self.drop_path = common.DropPath(drop_path_rate, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    branch = self.attn(self.norm1(x))
    x = x + self.drop_path(self.ls1(branch) if self.ls1 else branch)
    branch = self.mlp(self.norm2(x))
    return x + self.drop_path(self.ls2(branch) if self.ls2 else branch)


class VisionTransformer(nnx.Module):
  """ViT with `patch_size` square patches, `depth` blocks of `features` features and
  `num_heads` heads, layer scale from `init_values` (none if None), a distillation token after
  the class token when `distilled` (DeiT's; its own head, the two heads' logits averaged) and
  `reg_tokens` register tokens after those, a LayerNorm before the blocks when `pre_norm`
  (CLIP's), a bias in the patch embedding unless not `patch_bias`, no class token unless
  `class_token`, and the features pooled by the class token, or by attention from a learned
  query when `global_pool` is 'map' (SigLIP's) (the attributes are timm's arguments); the
  LayerNorms' `norm_epsilon` and the MLPs' `mlp_activation` (CLIP's differ).

  The position embedding has one row per patch of `image_shape` (whose height and width are
  cut into whole patches, a remainder dropped as torch's convolution does), after one per class
  and register token unless `no_embed_class` (then they are concatenated after it is added);
  weights for another grid are resampled on import (`weights.resample_pos_embed`). Subclasses
  set `features`, `depth` and `num_heads`.
  """
  patch_size = 16
  init_values: float | None = None
  distilled = False
  reg_tokens = 0
  no_embed_class = False
  pre_norm = False
  patch_bias = True
  class_token = True
  global_pool = 'token'
  norm_epsilon = 1e-6
  mlp_activation = None  # The exact GELU of the model's layers.
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
                                   stride=self.patch_size, padding=0,
                                   use_bias=self.patch_bias, kernel_init=common.TRUNC_NORMAL,
                                   rngs=rngs)
    if self.class_token:
      self.cls_token = nnx.Param(
          1e-6 * jax.random.normal(rngs.params(), (1, 1, self.features)))
    if self.distilled:
      self.dist_token = nnx.Param(1e-6 * jax.random.normal(rngs.params(), (1, 1, self.features)))
    if self.reg_tokens:
      self.reg_token = nnx.Param(
          1e-6 * jax.random.normal(rngs.params(), (1, self.reg_tokens, self.features)))
    embedded_prefix = (0 if self.no_embed_class
                       else self.class_token + self.distilled + self.reg_tokens)
    # `grid_size` tells the weight import which grid to resample a checkpoint's rows to.
    self.pos_embed = nnx.Param(
        common.TRUNC_NORMAL(rngs.params(),
                            (1, embedded_prefix + grid_size[0] * grid_size[1], self.features)),
        grid_size=grid_size)
    if self.pre_norm:
      self.norm_pre = common.layer_norm(layers, self.features, rngs=rngs,
                                        epsilon=self.norm_epsilon)
    self.blocks = nnx.List([
        Block(self.features, self.num_heads, rate, self.init_values, layers=layers, rngs=rngs,
              epsilon=self.norm_epsilon, activation=self.mlp_activation)
        for rate in rates])
    self.norm = common.layer_norm(layers, self.features, rngs=rngs,
                                  epsilon=self.norm_epsilon)
    if self.global_pool == 'map':
      self.attn_pool = AttentionPool(self.features, self.num_heads, layers=layers, rngs=rngs)
    self.dropout = layers.dropout(rate=dropout_rate, rngs=rngs)
    self.head = layers.linear(self.features, num_classes, kernel_init=common.TRUNC_NORMAL,
                              rngs=rngs)
    if self.distilled:
      self.head_dist = layers.linear(self.features, num_classes,
                                     kernel_init=common.TRUNC_NORMAL, rngs=rngs)
    self.remat = remat

  def _encoded(self, x: jax.Array) -> jax.Array:
    """The normalised tokens after the blocks: the prefix tokens, then the patches."""
    x = self.patch_embed(x)
    x = x.reshape(x.shape[0], -1, x.shape[-1])  # Row-major patches, as torch's flatten(2).
    # The class token, the distillation token, then the registers (timm's order), one copy per
    # example.
    tokens = [*([self.cls_token] if self.class_token else []),
              *([self.dist_token] if self.distilled else []),
              *([self.reg_token] if self.reg_tokens else [])]
    prefix = [jnp.broadcast_to(token[...], (x.shape[0], *token.shape[1:])).astype(x.dtype)
              for token in tokens]
    pos_embed = self.pos_embed[...].astype(x.dtype)
    if self.no_embed_class:
      x = jnp.concatenate([*prefix, x + pos_embed], axis=1)
    else:
      x = jnp.concatenate([*prefix, x], axis=1) + pos_embed
    if self.pre_norm:
      x = self.norm_pre(x)
    return self.norm(common.run_blocks(self.blocks, x, self.remat))

  def pre_logits(self, x: jax.Array) -> jax.Array:
    """The pooled features the classifier takes (timm's `forward_head(forward_features(x),
    pre_logits=True)`): the embedding of `--mode=embed`. The class token; with distillation,
    its mean with the distillation token; or the attention pool's output."""
    x = self._encoded(x)
    if self.global_pool == 'map':
      return self.attn_pool(x)
    if self.distilled:
      return (_token(x, 0) + _token(x, 1)) / 2
    return _token(x, 0)

  def logits(self, features: jax.Array) -> jax.Array:
    return common.head(features, self.dropout, self.head)

  def __call__(self, x: jax.Array) -> jax.Array:
    if not self.distilled:
      return self.logits(self.pre_logits(x))
    x = self._encoded(x)  # Each token through its head, the logits averaged (as timm's eval).
    return (common.head(_token(x, 0), self.dropout, self.head)
            + common.head(_token(x, 1), self.dropout, self.head_dist)) / 2


def _token(x: jax.Array, index: int) -> jax.Array:
  """Token `index` of every example, sliced: see `Attention` for why not `x[:, index]`."""
  return jax.lax.index_in_dim(x, index, axis=1, keepdims=False)


# timm's default weights of each: AugReg's ImageNet-21k pre-training fine-tuned on ImageNet-1k
# (Steiner et al. 2021), inputs scaled to [-1, 1], a 0.9 crop and bicubic resizing.
_AUGREG = dict(crop_pct=0.9, interpolation='bicubic', mean=common.INCEPTION_MEAN,
               std=common.INCEPTION_STD)


# Layers for layer-wise decay and linear probing, as timm's VisionTransformer.group_matcher.
LAYERS = models.LayerGroups(
    stem=r'^(cls_token|dist_token|reg_token|pos_embed|patch_embed|norm_pre)',
    blocks=r'^blocks\.(\d+)\.', head=r'head(_dist)?\.')


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


@models.MODELS.register(
    'vit_large_patch16_224', key_map=KEY_MAP, layers=LAYERS,
    pretrained=common.pretrained_cfg('timm/vit_large_patch16_224.augreg_in21k_ft_in1k',
                                     **_AUGREG))
class ViTLarge(VisionTransformer):
  """ViT-L/16: 1024 features, 24 blocks, 16 heads (304M parameters with 1,000 classes)."""
  features, depth, num_heads = 1024, 24, 16


class Dinov2(VisionTransformer):
  """DINOv2's ViTs (Oquab et al. 2023), self-supervised on LVD-142M at 518x518: 14x14 patches
  and layer scale. Those with registers (Darcet et al. 2024) add 4 learned tokens after the class
  token, and their position embedding covers the patches alone (timm's `no_embed_class`, as the
  original's once the class token's row is folded into the token).

  timm's weights have no classifier (its `num_classes=0`): the head is new, for the dataset's
  classes. Fine-tuning below 518 px (224 is usual) resamples the position embedding.
  """
  patch_size, init_values = 14, 1e-5


# timm's default weights of each: DINOv2's, at 518x518 without a crop, ImageNet's statistics.
def _dinov2_cfg(name: str) -> dict:
  return common.pretrained_cfg(f'timm/{name}.lvd142m', crop_pct=1.0, interpolation='bicubic',
                               mean=common.IMAGENET_MEAN, std=common.IMAGENET_STD,
                               input_size=(3, 518, 518))


@models.MODELS.register('vit_small_patch14_dinov2', key_map=KEY_MAP, layers=LAYERS,
                        pretrained=_dinov2_cfg('vit_small_patch14_dinov2'))
class ViTSmallDinov2(Dinov2):
  """ViT-S/14 of DINOv2: 384 features, 12 blocks, 6 heads (22.1M parameters at 518 px,
  without a head)."""
  features, depth, num_heads = 384, 12, 6


@models.MODELS.register('vit_base_patch14_dinov2', key_map=KEY_MAP, layers=LAYERS,
                        pretrained=_dinov2_cfg('vit_base_patch14_dinov2'))
class ViTBaseDinov2(Dinov2):
  """ViT-B/14 of DINOv2: 768 features, 12 blocks, 12 heads (86.6M parameters at
  518 px, without a head)."""
  features, depth, num_heads = 768, 12, 12


@models.MODELS.register('vit_small_patch14_reg4_dinov2', key_map=KEY_MAP, layers=LAYERS,
                        pretrained=_dinov2_cfg('vit_small_patch14_reg4_dinov2'))
class ViTSmallReg4Dinov2(Dinov2):
  """ViT-S/14 of DINOv2 with 4 registers: 384 features, 12 blocks, 6 heads."""
  features, depth, num_heads = 384, 12, 6
  reg_tokens, no_embed_class = 4, True


@models.MODELS.register('vit_base_patch14_reg4_dinov2', key_map=KEY_MAP, layers=LAYERS,
                        pretrained=_dinov2_cfg('vit_base_patch14_reg4_dinov2'))
class ViTBaseReg4Dinov2(Dinov2):
  """ViT-B/14 of DINOv2 with 4 registers: 768 features, 12 blocks, 12 heads."""
  features, depth, num_heads = 768, 12, 12
  reg_tokens, no_embed_class = 4, True


@models.MODELS.register(
    'deit_small_distilled_patch16_224', key_map=KEY_MAP, layers=LAYERS,
    # Touvron et al. 2021: ImageNet-1k alone, distilled from a RegNetY-16GF teacher.
    pretrained=common.pretrained_cfg('timm/deit_small_distilled_patch16_224.fb_in1k',
                                     crop_pct=0.9, interpolation='bicubic',
                                     mean=common.IMAGENET_MEAN, std=common.IMAGENET_STD))
class DeiTSmallDistilled(VisionTransformer):
  """DeiT-S/16 with its distillation token (Touvron et al. 2021): ViT-S/16 with a second token
  and head, whose logits are averaged with the class token's, as timm's at eval and
  fine-tuning (22.4M parameters with 1,000 classes)."""
  features, depth, num_heads = 384, 12, 6
  distilled = True
  logits = None  # Its two heads take a token each, not the pooled features (their mean).


def _clip_cfg(hf_hub_id: str, crop_pct: float) -> dict:
  """timm's pretrained_cfg of CLIP weights: bicubic resizing, CLIP's statistics."""
  return common.pretrained_cfg(hf_hub_id, crop_pct=crop_pct, interpolation='bicubic',
                               mean=common.CLIP_MEAN, std=common.CLIP_STD)


@models.MODELS.register(
    'vit_base_patch16_clip_224', key_map=KEY_MAP, layers=LAYERS,
    # LAION-2B CLIP's image tower (Cherti et al. 2023), fine-tuned on ImageNet-12k then 1k.
    pretrained=_clip_cfg('timm/vit_base_patch16_clip_224.laion2b_ft_in12k_in1k', 0.95))
class ViTBaseClip(VisionTransformer):
  """CLIP's ViT-B/16 image tower (Radford et al. 2021) in timm's layout: ViT-B/16 with a
  LayerNorm before the blocks, torch's LayerNorm epsilon (1e-5) and no bias in the patch
  embedding (86.6M parameters with 1,000 classes). For weights trained with GELU, as its default
  ones; OpenAI's own and MetaCLIP's use QuickGELU: `vit_base_patch16_clip_quickgelu_224`."""
  features, depth, num_heads = 768, 12, 12
  pre_norm, patch_bias, norm_epsilon = True, False, 1e-5


@models.MODELS.register(
    'vit_base_patch16_clip_quickgelu_224', key_map=KEY_MAP, layers=LAYERS,
    # MetaCLIP's image tower (Xu et al. 2024; timm's default tag of this model), without a
    # classifier; OpenAI's is `timm/vit_base_patch16_clip_quickgelu_224.openai`.
    pretrained=_clip_cfg('timm/vit_base_patch16_clip_224.metaclip_2pt5b', 1.0))
class ViTBaseClipQuickGelu(ViTBaseClip):
  """CLIP's ViT-B/16 image tower with QuickGELU in its MLPs, x * sigmoid(1.702 x): the
  activation OpenAI's CLIP was trained with (86.6M parameters with 1,000 classes)."""
  mlp_activation = staticmethod(common.quick_gelu)


@models.MODELS.register(
    'vit_base_patch16_siglip_224', key_map=KEY_MAP, layers=LAYERS,
    # SigLIP 2's image tower (Tschannen et al. 2025) on WebLI, without a classifier.
    pretrained=common.pretrained_cfg('timm/vit_base_patch16_siglip_224.v2_webli', crop_pct=0.9,
                                     interpolation='bicubic', mean=common.INCEPTION_MEAN,
                                     std=common.INCEPTION_STD))
class ViTBaseSiglip(VisionTransformer):
  """SigLIP's ViT-B/16 image tower (Zhai et al. 2023) in timm's layout: no class token, the
  features pooled by attention from a learned query (timm's 'map' head) (86.6M parameters and
  the pool's 7.1M without a head). timm's weights have no classifier: the head is new, for the
  dataset's classes."""
  features, depth, num_heads = 768, 12, 12
  class_token, global_pool = False, 'map'
