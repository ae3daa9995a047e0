"""torchvision's layouts of the backbone families: a torchvision model of a family's smallest
member, with seeded random weights, gives the same logits once its state_dict is imported
(`weights.load_pretrained`) as torchvision gives. The ResNets, whose keys are timm's, are
checked at full size in tests/test_backbones.py."""

import pytest

from backbones import weights
from tests.helpers import small_backbones  # pylint: disable=unused-import  (registers them)
from tests.helpers import timm_models
from tests.helpers.build import create_backbone
from tests.helpers.optional import requires_extras

NUM_CLASSES = 5


def _import(torch_model, name: str, tmp_path, image_size: int):
  """Our `name` with `torch_model`'s state_dict imported, every variable loaded."""
  import torch  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / 'weights.pth')
  torch.save(torch_model.state_dict(), path)
  model = create_backbone(name, image_shape=(image_size, image_size, 3), num_classes=NUM_CLASSES)
  assert weights.load_pretrained(model, name, path)[1] == []
  return model


def test_vision_transformer(tmp_path):
  """torchvision's VisionTransformer (vit_b_16's class) at the smallest ViT's size."""
  requires_extras('torchvision', 'torch')
  import torch  # pylint: disable=g-import-not-at-top
  from torchvision.models import vision_transformer  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  torch_model = vision_transformer.VisionTransformer(
      image_size=224, patch_size=16, num_layers=2, num_heads=2, hidden_dim=24, mlp_dim=96,
      num_classes=NUM_CLASSES)
  timm_models.randomise(torch_model)
  model = _import(torch_model, 'small_vit_for_test', tmp_path, 224)
  timm_models.assert_same_logits(torch_model.eval(), model, timm_models.images(224, 224))


def test_convnext(tmp_path):
  """torchvision's ConvNeXt (convnext_tiny's class) at the smallest ConvNeXt's size."""
  requires_extras('torchvision', 'torch')
  import torch  # pylint: disable=g-import-not-at-top
  from torchvision.models import convnext  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  torch_model = convnext.ConvNeXt(
      [convnext.CNBlockConfig(8, 16, 1), convnext.CNBlockConfig(16, 24, 1),
       convnext.CNBlockConfig(24, 32, 1), convnext.CNBlockConfig(32, None, 1)],
      num_classes=NUM_CLASSES)
  timm_models.randomise(torch_model)
  model = _import(torch_model, 'small_convnext_for_test', tmp_path, 64)
  timm_models.assert_same_logits(torch_model.eval(), model, timm_models.images(64, 64))


def test_efficientnet(tmp_path):
  """torchvision's EfficientNet (efficientnet_b0's class) at the smallest EfficientNet's size:
  both block kinds, squeeze-and-excitation, the head convolution."""
  requires_extras('torchvision', 'torch')
  import torch  # pylint: disable=g-import-not-at-top
  from torchvision.models import efficientnet  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  stages = [efficientnet.MBConvConfig(1, 3, 1, 8, 8, 1),
            efficientnet.MBConvConfig(6, 3, 2, 8, 16, 2),
            efficientnet.MBConvConfig(6, 5, 2, 16, 24, 1)]
  torch_model = efficientnet.EfficientNet(stages, dropout=0.2, last_channel=32,
                                          num_classes=NUM_CLASSES)
  timm_models.randomise(torch_model)
  model = _import(torch_model, 'small_efficientnet_for_test', tmp_path, 64)
  timm_models.assert_same_logits(torch_model.eval(), model, timm_models.images(64, 64))


def test_mobilenet_v3(tmp_path):
  """torchvision's MobileNetV3 (mobilenet_v3_large's class) at a small size: a block without
  expansion, expansion with a stride-2 5x5 depthwise convolution, hard-swish with
  squeeze-and-excitation, the last convolution and the Linear head; torchvision's BatchNorm
  epsilon (1e-3)."""
  requires_extras('torchvision', 'torch')
  import torch  # pylint: disable=g-import-not-at-top
  from torchvision.models import mobilenetv3  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  config = mobilenetv3.InvertedResidualConfig
  stages = [config(8, 3, 8, 8, False, 'RE', 1, 1, 1.0),
            config(8, 5, 24, 16, False, 'RE', 2, 1, 1.0),
            config(16, 3, 40, 16, True, 'HS', 1, 1, 1.0)]
  torch_model = mobilenetv3.MobileNetV3(stages, last_channel=32, num_classes=NUM_CLASSES)
  timm_models.randomise(torch_model)
  with torch.no_grad():  # Variances near the epsilon, so that a wrong epsilon shows.
    for module in torch_model.modules():
      if isinstance(module, torch.nn.BatchNorm2d):
        module.running_var.mul_(0.004)
  model = _import(torch_model, 'small_mobilenet_v3_for_test', tmp_path, 64)
  timm_models.assert_same_logits(torch_model.eval(), model, timm_models.images(64, 64))


@pytest.mark.slow  # A full-size MobileNetV3-Large: ~20 s on 2 cores.
def test_mobilenet_v3_large_imports_torchvisions_model_whole(tmp_path):
  """`mobilenet_v3_large` takes every array of torchvision's mobilenet_v3_large and gives its
  logits: the stages, expansions and squeeze-and-excitation widths are torchvision's."""
  requires_extras('torchvision', 'torch')
  import torch  # pylint: disable=g-import-not-at-top
  import torchvision  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  torch_model = torchvision.models.mobilenet_v3_large(num_classes=NUM_CLASSES)
  timm_models.randomise(torch_model)
  model = _import(torch_model, 'mobilenet_v3_large', tmp_path, 96)
  timm_models.assert_same_logits(torch_model.eval(), model, timm_models.images(96, 96))
