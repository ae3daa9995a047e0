"""MobileNetV3 (backbones/mobilenetv3.py): timm's mobilenetv3_large_100 logits and parameters
from timm's weights, with the stock and the CPU layers, and timm's default preprocessing."""

from flax import nnx
import jax
import numpy as np
import pytest

from backbones import mobilenetv3
from backbones import weights
from tests.helpers import timm_models as timm_helpers
from tests.helpers.build import create_backbone
from tests.helpers.optional import requires_extras
import kernels
import models

NAME = 'mobilenetv3_large_100'
# 64 px (2x2 pixels after its five stride-2 layers) keeps the CPU's work small.
SIZE = 64


@pytest.mark.parametrize('layers', [kernels.STOCK_LAYERS, kernels.CPU_LAYERS],
                         ids=['stock_layers', 'cpu_layers'])
def test_same_logits_and_parameters_as_timm(layers, tmp_path):
  torch_model = timm_helpers.timm_model(NAME)
  path = timm_helpers.save_safetensors(torch_model, tmp_path / f'{NAME}.safetensors')
  model = create_backbone(NAME, image_shape=(SIZE, SIZE, 3), layers=layers)
  loaded, fresh = weights.load_pretrained(model, NAME, path)
  assert not fresh
  # Every array but BatchNorm's step counters (num_batches_tracked) has a place here.
  assert len(loaded) == len([key for key in torch_model.state_dict()
                             if not key.endswith('num_batches_tracked')])
  assert sum(np.size(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))) == sum(
      parameter.numel() for parameter in torch_model.parameters())
  timm_helpers.assert_same_logits(torch_model, model, timm_helpers.images(SIZE, SIZE))


def test_pretrained_cfg_is_timms_default():
  requires_extras('timm')
  import timm  # pylint: disable=g-import-not-at-top
  declared = models.MODELS.capability(NAME, 'pretrained')
  timm_cfg = timm.models.get_pretrained_cfg(NAME).to_dict()
  assert declared == {key: timm_cfg[key] for key in declared}


@pytest.mark.parametrize('value', [8, 16, 18, 30, 120, 184, 2.5 * 80])
def test_make_divisible_matches_timm(value):
  requires_extras('timm')
  from timm.layers import make_divisible  # pylint: disable=g-import-not-at-top
  assert mobilenetv3.make_divisible(value) == make_divisible(value)
