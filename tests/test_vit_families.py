"""The ViT families after the original (backbones/vit.py): DINOv2's, with and without registers,
compute timm's logits from timm's weights, at their size and resampled to another; DeiT's with
its distillation token, its logits and pooled features; CLIP's image tower (a LayerNorm before
the blocks, no patch bias), with GELU or OpenAI's QuickGELU; SigLIP's (no class token, an attention-pool head)."""

from flax import nnx
import jax
import numpy as np
import pytest

from backbones import weights
from tests.helpers import timm_models as timm_helpers
from tests.helpers.build import create_backbone
from tests.helpers.optional import requires_extras
import kernels
import models

DINOV2 = ('vit_small_patch14_dinov2', 'vit_small_patch14_reg4_dinov2',
          'vit_base_patch14_dinov2', 'vit_base_patch14_reg4_dinov2')
FAMILIES = (*DINOV2, 'deit_small_distilled_patch16_224', 'vit_base_patch16_clip_224',
            'vit_base_patch16_clip_quickgelu_224', 'vit_base_patch16_siglip_224')
# Logits at 56 px (4x4 patches of 14) keep the CPU's work small.
SIZE = 56
# The logits are compared on both sides' models cut to 2 blocks (timm's `depth`): the blocks
# are one class repeated, so 12 would check the same code 6 times over, at 6 times the cost
# (a ViT-B's 86M random weights, built, saved and loaded twice). The registered depth is
# checked by `test_parameters_at_the_registered_depth_are_timms`.
DEPTH = 2


@pytest.mark.parametrize('name', FAMILIES)
def test_parameters_at_the_registered_depth_are_timms(name):
  """Every block of the registered model: as many parameters as timm's model of that name."""
  factory = models.MODELS.entry(name).factory
  model = nnx.eval_shape(lambda: factory((SIZE, SIZE, 3), timm_helpers.NUM_CLASSES,
                                         layers=kernels.STOCK_LAYERS, rngs=nnx.Rngs(0)))
  count = sum(np.size(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert count == timm_helpers.timm_parameter_count(name, img_size=SIZE)


@pytest.mark.parametrize('name', DINOV2)
def test_same_logits_and_parameters_as_timm(name, tmp_path):
  torch_model = timm_helpers.timm_model(name, img_size=SIZE, depth=DEPTH)
  path = timm_helpers.save_safetensors(torch_model, tmp_path / f'{name}.safetensors')
  model = create_backbone(name, image_shape=(SIZE, SIZE, 3), depth=DEPTH)
  loaded, fresh = weights.load_pretrained(model, name, path)
  assert not fresh
  assert len(loaded) == len(torch_model.state_dict())
  assert sum(np.size(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))) == sum(
      parameter.numel() for parameter in torch_model.parameters())
  timm_helpers.assert_same_logits(torch_model, model, timm_helpers.images(SIZE, SIZE))


@pytest.mark.parametrize('name,image_size', [('vit_small_patch14_dinov2', (SIZE, SIZE)),
                                             ('vit_small_patch14_reg4_dinov2', (42, 70))])
def test_518_px_weights_at_another_size_as_timm_resamples_them(name, image_size, tmp_path):
  """timm's weights are for 518 px (37x37 patches); fine-tuning at another size takes its
  position embedding resampled as timm resamples it for a model of that size (the class
  token's row kept, or no such row with registers)."""
  timm_helpers.assert_resampled_as_timm(name, image_size, tmp_path, depth=DEPTH)


@pytest.mark.parametrize('grid', [(4, 4), (16, 16), (3, 5)])
def test_resample_pos_embed_without_prefix_rows_matches_timm(grid):
  """DINOv2 with registers: the position embedding of 37x37 patches alone."""
  requires_extras('timm', 'torch')
  import torch  # pylint: disable=g-import-not-at-top
  from timm import layers  # pylint: disable=g-import-not-at-top
  pos_embed = np.random.default_rng(0).normal(size=(1, 37 * 37, 8)).astype(np.float32)
  expected = layers.resample_abs_pos_embed(torch.from_numpy(pos_embed), list(grid),
                                           num_prefix_tokens=0).numpy()
  target = nnx.Param(np.zeros((1, grid[0] * grid[1], 8), np.float32), grid_size=grid)
  np.testing.assert_allclose(weights.resample_pos_embed(pos_embed, target), expected,
                             atol=1e-5)


@pytest.mark.parametrize('name', FAMILIES)
def test_pretrained_cfg_is_timms_default(name):
  timm_helpers.assert_pretrained_cfg_is_timms(name)


def test_register_tokens_and_layer_scale_are_in_timms_layer_groups():
  """As timm's group_matcher: the register tokens with the stem (layer 0), each block's layer
  scale with its block."""
  name = 'vit_small_patch14_reg4_dinov2'
  factory = models.MODELS.entry(name).factory
  model = nnx.eval_shape(lambda: factory((SIZE, SIZE, 3), 7, layers=kernels.STOCK_LAYERS,
                                         rngs=nnx.Rngs(0)))
  numbers, _ = models.layer_numbers([name for name, _ in weights.model_variables(model)],
                                    models.MODELS.capability(name, 'layers'))
  assert numbers['reg_token'] == 0
  assert numbers['blocks.0.ls1.gamma'] == numbers['blocks.0.attn.qkv.kernel'] == 1
  assert numbers['blocks.11.ls2.gamma'] == 12


@pytest.mark.parametrize('name,stem', [('deit_small_distilled_patch16_224', 'dist_token'),
                                       ('vit_base_patch16_clip_224', 'norm_pre.scale')])
def test_distillation_token_and_pre_norm_are_in_timms_layer_groups(name, stem):
  """As timm's group_matcher: the distillation token and the LayerNorm before the blocks with
  the stem (layer 0), the distillation head with the head."""
  factory = models.MODELS.entry(name).factory
  model = nnx.eval_shape(lambda: factory((32, 32, 3), 7, layers=kernels.STOCK_LAYERS,
                                         rngs=nnx.Rngs(0)))
  numbers, last = models.layer_numbers([name for name, _ in weights.model_variables(model)],
                                       models.MODELS.capability(name, 'layers'))
  assert numbers[stem] == 0
  assert numbers.get('head_dist.kernel', last) == numbers['head.kernel'] == last


@pytest.mark.parametrize('name,size', [('deit_small_distilled_patch16_224', 64),
                                       ('vit_base_patch16_clip_224', 32),
                                       ('vit_base_patch16_clip_quickgelu_224', 32),
                                       ('vit_base_patch16_siglip_224', 32)])
def test_same_logits_pooled_features_and_parameters_as_timm(name, size, tmp_path):
  """DeiT's two heads averaged, as timm's at eval, its pooled features the two tokens' mean;
  CLIP's and SigLIP's image towers."""
  torch_model = timm_helpers.timm_model(name, img_size=size, depth=DEPTH)
  path = timm_helpers.save_safetensors(torch_model, tmp_path / f'{name}.safetensors')
  model = create_backbone(name, image_shape=(size, size, 3), depth=DEPTH)
  loaded, fresh = weights.load_pretrained(model, name, path)
  assert not fresh and len(loaded) == len(torch_model.state_dict())
  assert sum(np.size(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))) == sum(
      parameter.numel() for parameter in torch_model.parameters())
  images = timm_helpers.images(size, size)
  timm_helpers.assert_same_logits(torch_model, model, images)
  timm_helpers.assert_same_pooled_features(torch_model, model, images)

@pytest.mark.parametrize('name,size', [('vit_small_patch14_dinov2', 28),
                                       ('vit_base_patch16_siglip_224', 32)])
def test_headless_weights_load_as_a_backbone_with_a_new_head(name, size, tmp_path):
  """timm's DINOv2 and SigLIP weights have no classifier (num_classes=0): every other array
  loads, the head stays as initialised and is reported so, with no init_exclude needed."""
  requires_extras('timm', 'torch', 'safetensors')
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  torch_model = timm.create_model(name, pretrained=False, num_classes=0, img_size=size,
                                  depth=DEPTH)
  path = timm_helpers.save_safetensors(torch_model, tmp_path / f'{name}.safetensors')
  model = create_backbone(name, image_shape=(size, size, 3), depth=DEPTH)
  loaded, fresh = weights.load_pretrained(model, name, path)
  assert len(loaded) == len(torch_model.state_dict())
  assert sorted(fresh) == [f'head.bias (not in {path})', f'head.kernel (not in {path})']
