"""timm's models with seeded random weights, and the check that a model of this app computes
the same logits (tests/test_backbones.py and the tests of other backbone families)."""

from flax import nnx
import jax
import numpy as np

from backbones import weights
from tests.helpers.build import create_backbone
from tests.helpers.optional import requires_extras
from training import state as state_lib

NUM_CLASSES = 7


def randomise(torch_model) -> None:
  """Random values where timm's (or torchvision's) initialisation would hide mistakes: BatchNorm
  statistics and BatchNorm's and LayerNorm's affine parameters (otherwise the identity),
  ConvNeXt's and DINOv2's layer scale (otherwise 1e-6 or 1e-5) and the ViT's class token,
  distillation and register tokens and position embedding (otherwise close to zero)."""
  import torch  # pylint: disable=g-import-not-at-top
  generator = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for module in torch_model.modules():
      if isinstance(module, torch.nn.BatchNorm2d):  # timm's BatchNormAct2d too.
        size = module.num_features
        module.running_mean.copy_(0.1 * torch.randn(size, generator=generator))
        module.running_var.copy_(0.5 + torch.rand(size, generator=generator))
        module.weight.copy_(0.5 + torch.rand(size, generator=generator))
        module.bias.copy_(0.1 * torch.randn(size, generator=generator))
      if isinstance(module, torch.nn.LayerNorm) and module.elementwise_affine:
        module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=generator))
        module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
    for name, parameter in torch_model.named_parameters():
      if name.endswith(('gamma', 'layer_scale')) or name in (
          'cls_token', 'reg_token', 'dist_token', 'pos_embed', 'class_token',
          'encoder.pos_embedding'):
        parameter.copy_(0.5 + torch.rand(parameter.shape, generator=generator))
  torch_model.eval()


def timm_model(name: str, **kwargs):
  """timm's `name` with seeded random weights (see `_randomise`), in eval mode."""
  requires_extras('timm', 'torch', 'safetensors')
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  model = timm.create_model(name, pretrained=False, num_classes=NUM_CLASSES, **kwargs)
  randomise(model)
  return model


def timm_parameter_count(name: str, **kwargs) -> int:
  """The number of parameters of timm's `name`, built on PyTorch's meta device (shapes, no
  values: a ViT-B in well under a second)."""
  requires_extras('timm', 'torch')
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  with torch.device('meta'):
    model = timm.create_model(name, pretrained=False, num_classes=NUM_CLASSES, **kwargs)
  return sum(parameter.numel() for parameter in model.parameters())


def save_safetensors(torch_model, path) -> str:
  import safetensors.torch  # pylint: disable=g-import-not-at-top
  safetensors.torch.save_file(torch_model.state_dict(), str(path))
  return str(path)


def images(height: int, width: int) -> np.ndarray:
  return np.random.default_rng(0).normal(size=(2, height, width, 3)).astype(np.float32)


def assert_same_logits(torch_model, model: nnx.Module, images: np.ndarray) -> float:
  """Both models' float32 logits on `images` (NHWC) agree within 1e-4 of the largest logit
  (at least 1e-4); returns the largest difference."""
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    expected = torch_model(torch.from_numpy(images).permute(0, 3, 1, 2)).numpy()
  model.eval()
  logits = state_lib.run_once(lambda model, images: model(images), model, images)
  assert logits.dtype == np.float32
  difference = float(np.abs(np.asarray(logits) - expected).max())
  assert difference <= 1e-4 * max(1.0, float(np.abs(expected).max()))
  return difference


def pooled_features(torch_model, images: np.ndarray) -> np.ndarray:
  """timm's pooled features of NHWC float `images`: `forward_head(forward_features(x),
  pre_logits=True)`."""
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    inputs = torch.from_numpy(images).permute(0, 3, 1, 2)
    return torch_model.forward_head(torch_model.forward_features(inputs),
                                    pre_logits=True).numpy()


def assert_same_pooled_features(torch_model, model: nnx.Module, images: np.ndarray) -> None:
  """Our `model.pre_logits` equals timm's pooled features within 1e-4 of their largest."""
  expected = pooled_features(torch_model, images)
  model.eval()
  features = np.asarray(state_lib.run_once(lambda model, images: model.pre_logits(images),
                                           model, images))
  assert features.shape == expected.shape
  np.testing.assert_allclose(features, expected, atol=1e-4 * max(1.0, np.abs(expected).max()))


def assert_resampled_as_timm(name: str, image_size: tuple[int, int], directory,
                             **options) -> None:
  """timm's weights of ViT `name` at its own size, imported into our `name` at `image_size`,
  give the logits of timm's model at that size with the weights resampled by timm's
  `checkpoint_filter_fn`: our position embedding is resampled as timm resamples it. `options`
  (e.g. `depth`) go to both models."""
  requires_extras('timm', 'torch', 'safetensors')
  from timm.models import vision_transformer  # pylint: disable=g-import-not-at-top
  checkpoint_model = timm_model(name, **options)
  path = save_safetensors(checkpoint_model, directory / f'{name}.safetensors')
  torch_model = timm_model(name, img_size=image_size, **options)
  torch_model.load_state_dict(
      vision_transformer.checkpoint_filter_fn(checkpoint_model.state_dict(), torch_model))
  model = create_backbone(name, image_shape=(*image_size, 3), **options)
  assert weights.load_pretrained(model, name, path)[1] == []
  assert_same_logits(torch_model, model, images(*image_size))


def assert_pretrained_cfg_is_timms(name: str) -> None:
  """The preprocessing that model `name` declares (its registration's `pretrained=`) is timm's
  pretrained_cfg of its default weights."""
  requires_extras('timm')
  import timm  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  declared = models.MODELS.capability(name, 'pretrained')
  timm_cfg = timm.models.get_pretrained_cfg(name).to_dict()
  assert declared == {key: timm_cfg[key] for key in declared}


def assert_imports_as_timm(name: str, size: int, layers, directory) -> None:
  """timm's `name` with seeded random weights, saved as safetensors in `directory`, loads whole
  into ours (every array but BatchNorm's step counters, every parameter) for `size` px images
  built with `layers`, and both give the same logits."""
  torch_model = timm_model(name)
  path = save_safetensors(torch_model, directory / f'{name}.safetensors')
  model = create_backbone(name, image_shape=(size, size, 3), layers=layers)
  loaded, fresh = weights.load_pretrained(model, name, path)
  assert not fresh
  assert len(loaded) == len([key for key in torch_model.state_dict()
                             if not key.endswith('num_batches_tracked')])
  assert sum(np.size(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))) == sum(
      parameter.numel() for parameter in torch_model.parameters())
  assert_same_logits(torch_model, model, images(size, size))
