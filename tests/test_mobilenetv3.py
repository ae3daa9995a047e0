"""MobileNetV3 (backbones/mobilenetv3.py): timm's mobilenetv3_large_100 logits and parameters
from timm's weights, with the stock and the CPU layers, and timm's default preprocessing."""

import re

from flax import nnx
import pytest

from backbones import common
from backbones import mobilenetv3
from backbones import weights
from tests.helpers import timm_models as timm_helpers
from tests.helpers.optional import requires_extras
import kernels
import models

NAME = 'mobilenetv3_large_100'
# 64 px (2x2 pixels after its five stride-2 layers) keeps the CPU's work small.
SIZE = 64


@pytest.mark.parametrize('layers,size', [
    pytest.param(kernels.STOCK_LAYERS, SIZE, id='stock_layers'),
    # The XLA:CPU layers' own depthwise convolutions (3x3 and 5x5, strided ones too).
    pytest.param(kernels.CPU_LAYERS, SIZE, id='cpu_layers'),
    # The size of timm's weights: a 7x7 last stage (at 64 px 2x2); ~20 s on 2 CPU cores.
    pytest.param(kernels.STOCK_LAYERS, 224, id='stock_layers-224px', marks=pytest.mark.slow)])
def test_same_logits_and_parameters_as_timm(layers, size, tmp_path):
  timm_helpers.assert_imports_as_timm(NAME, size, layers, tmp_path)


def test_pretrained_cfg_is_timms_default():
  timm_helpers.assert_pretrained_cfg_is_timms(NAME)


@pytest.mark.parametrize('value', [8, 16, 18, 30, 120, 184, 2.5 * 80])
def test_make_divisible_matches_timm(value):
  requires_extras('timm')
  from timm.layers import make_divisible  # pylint: disable=g-import-not-at-top
  assert common.make_divisible(value) == make_divisible(value)


def _model_shape(**options) -> nnx.Module:
  """Our mobilenetv3_large_100's structure, without computing its initial weights."""
  factory = models.MODELS.entry(NAME).factory
  return nnx.eval_shape(lambda: factory((SIZE, SIZE, 3), timm_helpers.NUM_CLASSES,
                                        layers=kernels.STOCK_LAYERS, rngs=nnx.Rngs(0),
                                        **options))


def _our_name(timm_key: str) -> str:
  """The variable that timm's `timm_key` loads into, by the first rule of KEY_MAP it matches."""
  for pattern, template, _ in mobilenetv3.KEY_MAP:
    if match := re.fullmatch(pattern, timm_key):
      return match.expand(template)
  raise KeyError(timm_key)


def test_layer_groups_are_timms():
  """Each parameter in the layer of timm's group_matcher (layer-wise decay, linear probing):
  the stem 0, each of the 16 blocks its own, the head convolution with the classifier."""
  requires_extras('timm', 'torch')
  from timm.models import _manipulate  # pylint: disable=g-import-not-at-top
  torch_model = timm_helpers.timm_model(NAME)
  numbers, last = models.layer_numbers(
      [name for name, _ in weights.model_variables(_model_shape())],
      models.MODELS.capability(NAME, 'layers'))
  expected = {_our_name(key): layer for layer, keys in _manipulate.group_parameters(
      torch_model, torch_model.group_matcher()).items() for key in keys}
  assert last == 17
  assert {name: numbers[name] for name in expected} == expected


def test_drop_paths_follow_timms_schedule():
  """timm's rate * block index / number of blocks (its last 1x1 stage counted, without a skip
  to drop), and eval mode turns them off."""
  requires_extras('timm', 'torch')
  torch_model = timm_helpers.timm_model(NAME, drop_path_rate=0.2)
  expected = [getattr(block.drop_path, 'drop_prob', 0.0)
              for stage in torch_model.blocks[:-1] for block in stage]
  model = _model_shape(drop_path_rate=0.2)
  drop_paths = [block.drop_path for stage in model.blocks[:-1] for block in stage]
  assert [drop_path.rate for drop_path in drop_paths] == pytest.approx(expected)
  model.eval()
  assert all(drop_path.deterministic for drop_path in drop_paths)


@pytest.mark.parametrize('option', ['drop_path_rate', 'dropout_rate'])
def test_invalid_rates_are_refused(option):
  with pytest.raises(ValueError, match=option):
    _model_shape(**{option: 1.5})
