"""The pretrained backbones (backbones/): with the same weights, timm's and torchvision's models
and ours give the same logits; the weight import loads what fits and refuses bad files in one
line, without running pickled code."""

import os
import pickle
import sys

from flax import nnx
import jax
import numpy as np
import pytest

from backbones import common
from backbones import weights
from tests.helpers import timm_models as timm_helpers
from tests.helpers.build import create_backbone
from tests.helpers.build import load_weights
from tests.helpers.optional import requires_extras
from core import errors
import kernels
import models
from training import init_from
from training import state as state_lib

NUM_CLASSES = timm_helpers.NUM_CLASSES
RESNETS = ('resnet18', 'resnet34', 'resnet50')
VITS = ('vit_tiny_patch16_224', 'vit_small_patch16_224', 'vit_base_patch16_224')
BACKBONES = (*RESNETS, *VITS, 'convnext_tiny', 'efficientnet_b0')
# Checked for timm's pretrained_cfg only: its logits are ViT-B/16's layout at twice the depth
# (ViTs' logits are compared above), and timm's copy alone takes ~5 GB on a CPU.
LARGE = ('vit_large_patch16_224',)
# Comparing these with timm's at 224 px takes over ~20 s on 2 CPU cores (mostly compilation).
SLOW = ('resnet50', 'vit_small_patch16_224', 'vit_base_patch16_224', 'convnext_tiny',
        'efficientnet_b0')


def _count(model: nnx.Module) -> int:
  """The number of parameters of `model`."""
  return sum(np.size(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _num_arrays(model: nnx.Module) -> int:
  """The number of parameter and BatchNorm statistic arrays of `model`."""
  return len(jax.tree.leaves(nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))))


@pytest.mark.parametrize('name,layers', [
    *[pytest.param(name, kernels.STOCK_LAYERS, marks=[pytest.mark.slow] if name in SLOW else [],
                   id=name) for name in BACKBONES],
    # The XLA:CPU layers take the same arguments (e.g. depthwise feature groups).
    pytest.param('resnet18', kernels.CPU_LAYERS, id='resnet18-cpu_layers'),
    pytest.param('vit_tiny_patch16_224', kernels.CPU_LAYERS, id='vit_tiny_patch16_224-cpu_layers'),
    pytest.param('efficientnet_b0', kernels.CPU_LAYERS, id='efficientnet_b0-cpu_layers',
                 marks=pytest.mark.slow)])
def test_same_logits_and_parameters_as_timm(name, layers, tmp_path):
  torch_model = timm_helpers.timm_model(name)
  path = timm_helpers.save_safetensors(torch_model, tmp_path / f'{name}.safetensors')
  model = create_backbone(name, layers=layers)
  loaded, fresh = weights.load_pretrained(model, name, path)
  assert not fresh
  assert len(loaded) == _num_arrays(model)
  assert _count(model) == sum(parameter.numel() for parameter in torch_model.parameters())
  timm_helpers.assert_same_logits(torch_model, model, timm_helpers.images(224, 224))


@pytest.mark.parametrize('image_size', [(160, 160), (160, 224)])
def test_vit_at_another_size_resamples_the_position_embedding(image_size, tmp_path):
  """A 224-px checkpoint into a ViT for another grid, as timm resamples it for its own."""
  timm_helpers.assert_resampled_as_timm('vit_tiny_patch16_224', image_size, tmp_path)


@pytest.mark.parametrize('grid', [(10, 10), (20, 12), (5, 9)])
def test_resample_pos_embed_matches_timm(grid):
  requires_extras('timm', 'torch')
  import torch  # pylint: disable=g-import-not-at-top
  from timm import layers  # pylint: disable=g-import-not-at-top
  pos_embed = np.random.default_rng(0).normal(size=(1, 1 + 14 * 14, 8)).astype(np.float32)
  expected = layers.resample_abs_pos_embed(torch.from_numpy(pos_embed), list(grid)).numpy()
  target = nnx.Param(np.zeros((1, 1 + grid[0] * grid[1], 8), np.float32), grid_size=grid)
  np.testing.assert_allclose(weights.resample_pos_embed(pos_embed, target), expected,
                             atol=1e-5)


@pytest.mark.parametrize('name', ['resnet18', pytest.param('resnet50', marks=pytest.mark.slow)])
def test_torchvision_resnet_state_dict(name, tmp_path):
  """torchvision's ResNets have timm's keys; their .pth state_dict loads through torch."""
  requires_extras('torchvision', 'timm', 'torch')
  import torch  # pylint: disable=g-import-not-at-top
  import torchvision  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  torch_model = getattr(torchvision.models, name)(num_classes=NUM_CLASSES)
  timm_helpers.randomise(torch_model)
  assert torch_model.state_dict().keys() == timm_helpers.timm_model(name).state_dict().keys()
  path = str(tmp_path / f'{name}.pth')
  torch.save(torch_model.state_dict(), path)
  model = create_backbone(name)
  assert weights.load_pretrained(model, name, path)[1] == []
  timm_helpers.assert_same_logits(torch_model, model, timm_helpers.images(224, 224))


@pytest.mark.parametrize('name', (*BACKBONES, *LARGE))
def test_pretrained_cfg_is_timms_default(name):
  timm_helpers.assert_pretrained_cfg_is_timms(name)


@pytest.fixture(name='resnet18_file', scope='module')
def fixture_resnet18_file(tmp_path_factory) -> str:
  """A .safetensors file of timm's resnet18 with 7 classes and random weights."""
  return timm_helpers.save_safetensors(timm_helpers.timm_model('resnet18'),
                           tmp_path_factory.mktemp('weights') / 'resnet18.safetensors')


@pytest.fixture(name='small_resnet18', scope='module')
def fixture_small_resnet18() -> nnx.Module:
  """Our resnet18 for 32x32 images, 7 classes (built once: building takes seconds)."""
  return create_backbone('resnet18', image_shape=(32, 32, 3))


def test_head_for_another_number_of_classes_stays_fresh(resnet18_file):
  model = create_backbone('resnet18', image_shape=(32, 32, 3), num_classes=3)
  initial_head = np.asarray(model.fc.kernel[...])
  loaded, fresh = weights.load_pretrained(model, 'resnet18', resnet18_file)
  assert fresh == ['fc.bias ((3,), (7,) there)', 'fc.kernel ((512, 3), (512, 7) there)']
  assert len(loaded) == _num_arrays(model) - 2
  np.testing.assert_array_equal(model.fc.kernel[...], initial_head)
  _, fresh = weights.load_pretrained(model, 'resnet18', resnet18_file, exclude=('^fc',))
  assert fresh == ['fc.bias (init_exclude)', 'fc.kernel (init_exclude)']


def test_checkpoint_dict_with_a_state_dict(small_resnet18, tmp_path):
  """A training script's checkpoint: the state_dict under 'state_dict', keys under DDP's
  'module.' prefix."""
  requires_extras('timm', 'torch')
  import torch  # pylint: disable=g-import-not-at-top
  torch_model = timm_helpers.timm_model('resnet18')
  path = str(tmp_path / 'checkpoint.pth')
  torch.save({'epoch': 3, 'state_dict': {f'module.{key}': value for key, value
                                         in torch_model.state_dict().items()}}, path)
  assert weights.load_pretrained(small_resnet18, 'resnet18', path)[1] == []
  timm_helpers.assert_same_logits(torch_model, small_resnet18, timm_helpers.images(32, 32))


def _assert_refused(model: nnx.Module, model_name: str, path: str) -> None:
  """Loading `path` ends in one ConfigError line naming config.init_from, leaving `model`
  as it was."""
  weights_only = nnx.Any(nnx.Param, nnx.BatchStat)
  before = jax.tree.map(np.asarray, nnx.state(model, weights_only))
  with pytest.raises(errors.ConfigError) as raised:
    load_weights(model, model_name, path)
  assert raised.value.key == 'init_from' and raised.value.value == path
  assert '\n' not in str(raised.value)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(model, weights_only), before)


def test_wrong_architecture_is_refused(resnet18_file):
  vit = create_backbone('vit_tiny_patch16_224', image_shape=(32, 32, 3))
  _assert_refused(vit, 'vit_tiny_patch16_224', resnet18_file)


def test_deeper_architecture_is_refused(small_resnet18, tmp_path):
  """resnet34's weights hold resnet18's names and shapes, and more blocks."""
  path = timm_helpers.save_safetensors(timm_helpers.timm_model('resnet34'), tmp_path / 'resnet34.safetensors')
  _assert_refused(small_resnet18, 'resnet18', path)


def test_missing_and_truncated_files_are_refused(small_resnet18, resnet18_file, tmp_path):
  _assert_refused(small_resnet18, 'resnet18', str(tmp_path / 'absent.safetensors'))
  truncated = tmp_path / 'truncated.safetensors'
  with open(resnet18_file, 'rb') as file:
    truncated.write_bytes(file.read()[:100_000])
  _assert_refused(small_resnet18, 'resnet18', str(truncated))
  truncated_pth = tmp_path / 'truncated.pth'
  truncated_pth.write_bytes(b'PK\x03\x04 not a whole zip')
  _assert_refused(small_resnet18, 'resnet18', str(truncated_pth))


def test_pickled_whole_model_is_refused(small_resnet18, tmp_path):
  requires_extras('torchvision', 'torch')
  import torch  # pylint: disable=g-import-not-at-top
  import torchvision  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / 'whole_model.pth')
  torch.save(torchvision.models.resnet18(), path)
  _assert_refused(small_resnet18, 'resnet18', path)


class _Malicious:
  """A pickle payload that, if unpickled, creates `marker`."""

  def __init__(self, marker: str):
    self.marker = marker

  def __reduce__(self):
    return (open, (self.marker, 'w'))


@pytest.mark.parametrize('writer', ['torch.save', 'pickle.dump'])
def test_malicious_pickle_runs_no_code(writer, small_resnet18, tmp_path):
  requires_extras('torch')
  import torch  # pylint: disable=g-import-not-at-top
  marker = str(tmp_path / 'marker')
  path = str(tmp_path / 'weights.pth')
  payload = {'conv1.weight': _Malicious(marker)}
  if writer == 'torch.save':
    torch.save(payload, path)
  else:
    with open(path, 'wb') as file:
      pickle.dump(payload, file, protocol=2)  # torch's own protocol: no warning.
  assert not os.path.exists(marker)
  _assert_refused(small_resnet18, 'resnet18', path)
  assert not os.path.exists(marker)


def _hub_snapshot(home, repo_id: str) -> str:
  """The folder of a Hub snapshot of `repo_id` in the cache of HF_HOME=`home`, laid out as
  huggingface_hub lays out a download (refs/main names the snapshot)."""
  revision = '0' * 40
  repo = home / 'hub' / f'models--{repo_id.replace("/", "--")}'
  (repo / 'refs').mkdir(parents=True)
  (repo / 'refs' / 'main').write_text(revision)
  snapshot = repo / 'snapshots' / revision
  snapshot.mkdir(parents=True)
  return snapshot


def test_hub_name_loads_from_the_local_cache_only(small_resnet18, resnet18_file, tmp_path,
                                                  monkeypatch):
  requires_extras('huggingface_hub', 'safetensors')
  monkeypatch.setenv('HF_HOME', str(tmp_path))
  monkeypatch.delenv('HF_HUB_CACHE', raising=False)
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')
  name = 'hf-hub:timm/resnet18.a1_in1k'
  _assert_refused(small_resnet18, 'resnet18', name)  # An empty cache.
  snapshot = _hub_snapshot(tmp_path, 'timm/resnet18.a1_in1k')
  with open(resnet18_file, 'rb') as file:
    (snapshot / 'model.safetensors').write_bytes(file.read())
  assert load_weights(small_resnet18, 'resnet18', name)[1] == []


def test_missing_reader_is_a_missing_package(small_resnet18, resnet18_file, monkeypatch):
  monkeypatch.setitem(sys.modules, 'safetensors.numpy', None)  # Its import fails.
  with pytest.raises(errors.MissingPackage) as raised:
    weights.load_pretrained(small_resnet18, 'resnet18', resnet18_file)
  assert (raised.value.key, raised.value.package) == ('init_from', 'safetensors')


def test_model_without_pretrained_weights_is_refused():
  model = nnx.eval_shape(lambda: models.MODELS.entry('cnn').factory(
      (28, 28, 1), 10, layers=kernels.STOCK_LAYERS, rngs=nnx.Rngs(0)))
  with pytest.raises(errors.ConfigError) as raised:
    weights.load_pretrained(model, 'cnn', 'resnet18.safetensors')
  assert raised.value.key == 'init_from'


@pytest.mark.parametrize('path,kind', [
    ('w/resnet50.safetensors', init_from.FileWeights), ('resnet50.PTH', init_from.FileWeights),
    ('a.pt', init_from.FileWeights), ('pytorch_model.bin', init_from.FileWeights),
    ('hf-hub:timm/resnet50.a1_in1k', init_from.HubWeights),
    ('timm/resnet50.a1_in1k', init_from.HubWeights),
    ('https://example.com/w/resnet50.pth', init_from.UrlWeights),
    ('runs/mnist', init_from.AppCheckpoint),
    ('runs/mnist/checkpoints/100', init_from.AppCheckpoint)])
def test_init_from_is_read_once_into_its_kind_of_source(path, kind, tmp_path, monkeypatch):
  """Each form of config.init_from is one kind of source, checked for its form alone."""
  if kind is init_from.HubWeights:
    requires_extras('huggingface_hub')
  monkeypatch.chdir(tmp_path)
  os.makedirs('runs/mnist/checkpoints/100/state')
  for name in ('w/resnet50.safetensors', 'resnet50.PTH', 'a.pt', 'pytorch_model.bin'):
    os.makedirs(os.path.dirname(name) or '.', exist_ok=True)
    open(name, 'wb').close()
  source = init_from.parse(path)
  assert type(source) is kind and source.path == path  # pylint: disable=unidiomatic-typecheck
  with pytest.raises(errors.ConfigError) as raised:  # A path that holds nothing of either.
    init_from.parse('runs/none')
  assert (raised.value.key, raised.value.value) == ('init_from', 'runs/none')


@pytest.mark.parametrize('name', BACKBONES)
@pytest.mark.parametrize('option', ['drop_path_rate', 'dropout_rate'])
def test_invalid_rates_are_refused(name, option):
  """A ValueError, which the registry turns into a ConfigError naming the option's section."""
  with pytest.raises(ValueError, match=option):
    models.MODELS.entry(name).factory((32, 32, 3), NUM_CLASSES, layers=kernels.STOCK_LAYERS,
                                      rngs=nnx.Rngs(0), **{option: 1.5})


def _loss_and_grads(model: nnx.Module, images: np.ndarray):
  """The loss and its gradients, compiled at XLA's lowest optimisation level: the program runs
  once, and compiling it optimised took most of these tests' time (the values are the same
  computation either way; remat and the layers are what the tests compare)."""
  def loss(model):
    return (model(images) ** 2).mean()
  return state_lib.run_once(nnx.value_and_grad(loss), model)


def _assert_trees_close(actual, expected, tolerance: float) -> None:
  """Each array within `tolerance` of its largest magnitude: summation orders differ."""
  def check(actual, expected):
    scale = max(float(np.abs(expected).max()), 1e-12)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tolerance * scale)
  jax.tree.map(check, actual, expected)


def _perturb(model: nnx.Module) -> None:
  """Adds noise to every parameter, so that no residual branch starts as zero (timm's
  zero-initialised last BatchNorm, ConvNeXt's 1e-6 layer scale) and none can hide. The noise
  comes from NumPy: a jitted jax.random program for every array took ~25 s of CPU to compile."""
  rng = np.random.default_rng(1)
  params = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(
      lambda leaf: leaf + (0.1 * rng.standard_normal(leaf.shape)).astype(leaf.dtype), params))


def test_drop_path_drops_whole_examples_in_training_only():
  drop_path = common.DropPath(0.5, rngs=nnx.Rngs(0))
  ones = np.ones((64, 3, 3, 2), np.float32)
  dropped = np.asarray(drop_path(ones))
  kept = dropped.reshape(64, -1).max(axis=1) > 0
  assert 10 < kept.sum() < 54  # About half the examples, each whole: 0 or 1 / (1 - 0.5).
  np.testing.assert_array_equal(dropped, kept[:, None, None, None] * 2.0 * ones)
  assert not np.array_equal(drop_path(ones), dropped)  # A new mask at each call.
  drop_path.eval()
  np.testing.assert_array_equal(drop_path(ones), ones)


@pytest.mark.parametrize('name', ['resnet18', 'vit_tiny_patch16_224'])
def test_drop_paths_grow_linearly_and_follow_eval(name):
  model = create_backbone(name, image_shape=(32, 32, 3), drop_path_rate=0.1)
  drop_paths = [module for _, module in nnx.iter_modules(model)
                if isinstance(module, common.DropPath)]
  rates = [drop_path.rate for drop_path in drop_paths]
  assert rates == sorted(rates) and rates[0] == 0 and rates[-1] == pytest.approx(0.1)
  model.eval()
  assert all(drop_path.deterministic for drop_path in drop_paths)


# Two compilations of a training step: 30-150 s on 2 busy cores. Every backbone remats its
# blocks through the one `common.run_blocks`: a convolutional and a transformer family show it.
@pytest.mark.slow
@pytest.mark.parametrize('name', ['resnet18', 'vit_tiny_patch16_224'])
def test_remat_keeps_the_gradients(name):
  images = timm_helpers.images(32, 32)
  model = create_backbone(name, image_shape=(32, 32, 3))
  _perturb(model)
  if name == 'vit_tiny_patch16_224':
    # One block shows it (remat wraps each alike) and compiles in a fraction of twelve's time.
    model.blocks = nnx.List(model.blocks[:1])
  loss, grads = _loss_and_grads(model, images)
  model.remat = True
  remat_loss, remat_grads = _loss_and_grads(model, images)
  np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
  _assert_trees_close(remat_grads, grads, 1e-5)


@pytest.mark.slow
def test_cpu_layers_train_as_the_stock_layers():
  """The XLA:CPU layers' own gradient (every convolution, strided ones included) gives the
  stock one. At 64 px: at 32 px the last stage is 1x1, so its BatchNorms normalise 2 numbers a
  channel and amplify rounding chaotically (there even the batch's order moved a gradient by
  0.7%); at 64 px the two layer sets' gradients agreed to 1.3e-6."""
  images = timm_helpers.images(64, 64)
  stock = _loss_and_grads(create_backbone('resnet18', (64, 64, 3)), images)
  cpu = _loss_and_grads(create_backbone('resnet18', (64, 64, 3), layers=kernels.CPU_LAYERS), images)
  _assert_trees_close(cpu, stock, 1e-4)
