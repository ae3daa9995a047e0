"""Data sources: TFDS, torchvision and Hugging Face give the same arrays, and train end to end."""

import gzip
import os
import re
import shutil
import subprocess
import sys

import numpy as np
from PIL import Image
import pytest

import tensorflow_datasets as tfds
from tensorflow_datasets.core import hashing

from configs import default
from tests.helpers.optional import SHARED_MNIST
from tests.helpers.optional import requires_extras
from core import errors
from data_sources import base
import image_folders
import input_pipeline
import preprocessing
import train
from training import run_spec
from tests.helpers import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**overrides):
  config = default.get_config()
  config.update(overrides)
  return config


@pytest.fixture(scope='module')
def torchvision_root(tmp_path_factory, tfds_data_dir):
  """A torchvision root with the original MNIST files gunzipped into ROOT/MNIST/raw/, from the
  repository's CI copy or the TFDS manual dir."""
  requires_extras('torchvision')
  folders = [SHARED_MNIST, tfds.core.Path(tfds_data_dir) / 'downloads' / 'manual']
  originals = next((folder for folder in folders if len(list(folder.glob('*.gz'))) == 4), None)
  if originals is None:
    pytest.skip(f'needs the 4 original MNIST .gz files in one of {list(map(str, folders))}')
  root = tmp_path_factory.mktemp('torchvision')
  raw = root / 'MNIST' / 'raw'
  raw.mkdir(parents=True)
  for path in originals.glob('*.gz'):
    with gzip.open(path) as packed, open(raw / path.stem, 'wb') as unpacked:
      shutil.copyfileobj(packed, unpacked)
  return str(root)


@pytest.fixture(scope='module')
def tfds_splits(tfds_data_dir):
  """TFDS's MNIST: the first 12,800 training images and the 10,000 test images."""
  source = build.open_source(_config(data_dir=tfds_data_dir))
  return {'train': source.load_split('train[:12800]'), 'test': source.load_split('test')}


@pytest.fixture(scope='module')
def huggingface_dir(tfds_splits, tmp_path_factory):
  """A local Hugging Face DatasetDict of those images as PIL images, as a user would save one."""
  requires_extras('datasets')
  import datasets  # pylint: disable=g-import-not-at-top  (optional)
  features = datasets.Features({'img': datasets.Image(),
                                'digit': datasets.ClassLabel(num_classes=10)})
  path = str(tmp_path_factory.mktemp('huggingface') / 'mnist')
  datasets.DatasetDict({
      name: datasets.Dataset.from_dict(
          {'img': [Image.fromarray(image[..., 0]) for image in split.images],
           'digit': split.labels.tolist()}, features=features)
      for name, split in tfds_splits.items()
  }).save_to_disk(path)
  return path


def _in_file_order(split, split_name):
  """A TFDS split in the order of the original files.

  TFDS stores the examples of a split sorted by the md5 hash of their key (the example's index
  in the original files for MNIST), salted with the split name; this undoes that permutation.
  """
  hasher = hashing.Hasher(split_name)
  stored_order = np.argsort([hasher.hash_key(index) for index in range(len(split.labels))])
  images, labels = np.empty_like(split.images), np.empty_like(split.labels)
  images[stored_order], labels[stored_order] = split.images, split.labels
  return base.Split(images=images, labels=labels)


def test_to_split_adds_the_channel_axis_and_casts_labels():
  gray = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
  split = base.to_split(gray, [3, 7])
  assert split.images.shape == (2, 3, 4, 1) and split.images.dtype == np.uint8
  assert split.labels.dtype == np.int32 and list(split.labels) == [3, 7]
  # PIL images: grayscale ones get the channel axis too, RGB ones keep their 3 channels.
  from_pil = base.to_split([Image.fromarray(image) for image in gray], np.array([3, 7]))
  np.testing.assert_array_equal(from_pil.images, split.images)
  rgb = base.to_split([Image.fromarray(image).convert('RGB') for image in gray], [0, 1])
  assert rgb.images.shape == (2, 3, 4, 3)
  with pytest.raises(ValueError, match='uint8.*float32'):
    base.to_split(gray.astype(np.float32), [3, 7])


def test_torchvision_mnist_equals_tfds(torchvision_root, tfds_data_dir, tfds_splits):
  data = build.open_data(
      _config(data_source='torchvision', dataset='MNIST', data_dir=torchvision_root))
  info, load_split = data.info, data.source.load_split
  tfds_info = build.open_data(_config(data_dir=tfds_data_dir)).info
  assert info == base.DatasetInfo(
      name='MNIST', image_shape=tfds_info.image_shape, num_classes=tfds_info.num_classes,
      num_train_examples=tfds_info.num_train_examples,
      num_eval_examples=tfds_info.num_eval_examples,
      class_names=('0 - zero', '1 - one', '2 - two', '3 - three', '4 - four', '5 - five',
                   '6 - six', '7 - seven', '8 - eight', '9 - nine'))  # torchvision's names.

  test = load_split('test')
  assert test.images.shape == (10_000, 28, 28, 1) == tfds_splits['test'].images.shape
  assert test.images.dtype == tfds_splits['test'].images.dtype == np.uint8
  assert test.labels.dtype == tfds_splits['test'].labels.dtype == np.int32
  tfds_test = _in_file_order(tfds_splits['test'], 'test')
  np.testing.assert_array_equal(test.images, tfds_test.images)
  np.testing.assert_array_equal(test.labels, tfds_test.labels)
  # TFDS split slicing works for torchvision too.
  np.testing.assert_array_equal(load_split('test[:10]+train[5:7]').labels,
                                np.concatenate([test.labels[:10], load_split('train').labels[5:7]]))


def test_huggingface_local_dataset(huggingface_dir, tfds_splits):
  data = build.open_data(_config(data_source='huggingface', dataset=huggingface_dir))
  info, load_split = data.info, data.source.load_split
  assert info == base.DatasetInfo(name=huggingface_dir, image_shape=(28, 28, 1),
                                  num_classes=10, num_train_examples=12_800,
                                  num_eval_examples=10_000, class_names=tuple('0123456789'))
  test = load_split('test')
  assert test.images.shape == (10_000, 28, 28, 1) and test.images.dtype == np.uint8
  assert test.labels.dtype == np.int32
  np.testing.assert_array_equal(test.images, tfds_splits['test'].images)
  np.testing.assert_array_equal(test.labels, tfds_splits['test'].labels)
  batches = input_pipeline.eval_batches(input_pipeline.InMemory(test.images, test.labels),
                                        batch_size=1000)
  assert min(batch['image'].min() for batch in batches) == 0  # uint8: scaled in the step.
  assert max(batch['image'].max() for batch in batches) == 255


def test_missing_data_says_where_it_looked(tmp_path):
  requires_extras('torchvision', 'datasets')
  config = _config(data_source='torchvision', dataset='MNIST', data_dir=str(tmp_path))
  with pytest.raises(errors.DataError) as error:
    build.open_source(config)
  assert error.value.what == str(tmp_path / 'MNIST')
  missing = str(tmp_path / 'no_such_dataset')
  with pytest.raises(errors.DataError) as error:
    build.open_source(_config(data_source='huggingface', dataset=missing))
  assert error.value.what == missing


@pytest.mark.parametrize('key,value,package', [
    ('data_source', 'torchvision', 'torchvision'),
    ('data_source', 'huggingface', 'datasets'),
    ('input_backend', 'torch', 'torch'),
])
def test_missing_optional_package_names_it(monkeypatch, tmp_path, key, value, package):
  monkeypatch.setitem(sys.modules, package, None)  # Makes `import <package>` fail.
  config = _config(**{key: value}, dataset='MNIST', data_dir=str(tmp_path / 'no_data_here'))
  with pytest.raises(errors.MissingPackage) as error:
    train.train_and_evaluate(run_spec.resolve(config), str(tmp_path / 'workdir'))
  assert (error.value.key, error.value.value, error.value.package) == (key, value, package)
  assert not (tmp_path / 'no_data_here').exists()


@pytest.mark.parametrize('overrides,key', [
    (dict(data_source='torchvision', dataset='mnist', data_dir='/tmp'), 'dataset'),
    (dict(data_source='torchvision', dataset='MNIST'), 'data_dir'),
])
def test_bad_torchvision_values(overrides, key):
  requires_extras('torchvision')
  with pytest.raises(errors.ConfigError) as error:
    build.open_source(_config(**overrides))
  assert (error.value.key, error.value.value) == (key, overrides.get(key))


def _split(num_examples):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (num_examples, 6, 5, 1), dtype=np.uint8)
  return input_pipeline.InMemory(images=images, labels=np.arange(num_examples, dtype=np.int32))


def _ids(batches):
  return np.concatenate([batch['label'] for batch in batches])


def test_torch_batches_match_the_tf_pipeline():
  requires_extras('torch')
  split = _split(100)
  data = input_pipeline.Data(None, preprocessing.parse(''), None)

  def batches(start_epoch=0, **overrides):
    config = _config(batch_size=8, num_epochs=2, **overrides)
    inputs = run_spec.resolve(config).input
    return list(input_pipeline.train_batches(input_pipeline.in_memory(split, inputs), data,
                                             inputs, 8, start_epoch))

  torch_batches, tf_batches = batches(input_backend='torch'), batches()
  layout = lambda batch: {key: (value.shape, value.dtype) for key, value in batch.items()}
  assert [layout(batch) for batch in torch_batches] == [layout(batch) for batch in tf_batches]
  for batch in torch_batches:
    # The same pixels as the tf.data path: each image is its uint8 source (scaled on the devices).
    np.testing.assert_array_equal(batch['image'], split.images[batch['label']])
  epochs = _ids(torch_batches).reshape(2, -1)
  assert all(len(set(epoch)) == 96 for epoch in epochs)  # 12 full batches, no repeats.
  assert not np.array_equal(epochs[0], epochs[1])  # Reshuffled every epoch...
  # ...from a per-epoch seed: the same order again, from any start epoch; another with seed 1.
  np.testing.assert_array_equal(_ids(batches(input_backend='torch')), epochs.ravel())
  np.testing.assert_array_equal(_ids(batches(1, input_backend='torch')), epochs[1])
  assert not np.array_equal(_ids(batches(input_backend='torch', seed=1)), epochs.ravel())


@pytest.mark.slow
def test_torchvision_cli_run_scores_97_percent(torchvision_root, tmp_path):
  # The command (one epoch of the default CNN on torchvision's MNIST through main.py),
  # on the first 32,000 training images (250 steps) for CPU time. The 98% was for all
  # 60,000. At 19,200 images (150 steps) seeds 0 / 1 / 2 read 97.34 / 98.06 / 97.45% at 18a3c04
  # and 96.97 / 97.82 / 97.79% at 2d45dd7 (the BatchNorm gradient's rounding), so the seed alone
  # moved 150 steps across 97%; at 32,000 seed 0 reads 98.01% (2d45dd7, 2-core Intel Xeon),
  # too near 98% to assert it, so 97% here; an untrained CNN reads about 10%.
  result = subprocess.run(
      [sys.executable, 'main.py', '--config=configs/default.py', f'--workdir={tmp_path}',
       '--config.data_source=torchvision', '--config.dataset=MNIST',
       f'--config.data_dir={torchvision_root}', '--config.num_epochs=1',
       '--config.train_split=train[:32000]'],
      cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  accuracy, num_examples = re.search(r'epoch 1/1: .* eval/accuracy=([\d.]+) \((\d+) examples\)',
                                     result.stderr).groups()
  assert int(num_examples) == 10_000
  assert float(accuracy) >= 0.97, accuracy


@pytest.mark.slow
def test_short_runs_through_huggingface_and_the_torch_backend(torchvision_root, huggingface_dir,
                                                             tmp_path):
  requires_extras('torch')
  # 50 steps each on real training images (94.6% through the torch backend), then scored on
  # the 10,000 real test images.
  runs = {
      'torch_backend': _config(data_source='torchvision', dataset='MNIST',
                               data_dir=torchvision_root, input_backend='torch',
                               train_split='train[:6400]'),
      'huggingface': _config(data_source='huggingface', dataset=huggingface_dir,
                             train_split='train[:6400]'),
  }
  for name, config in runs.items():
    config.num_epochs = 1
    metrics = train.train_and_evaluate(run_spec.resolve(config), str(tmp_path / name))
    assert metrics['eval/accuracy'] > 0.9, (name, metrics)


@pytest.fixture(scope='module')
def custom_tfds_dir(tmp_path_factory):
  """A dataset a user prepared with store_as_tfds_dataset: in data_dir, not in TFDS's registry.

  Colour images of varying sizes: 'shapes_custom' is not a registered name.
  """
  rng = np.random.default_rng(0)
  names = list(image_folders.SHAPES)

  def examples(count):
    return [(f'{index}', {'image': np.asarray(image_folders.shape_image(
        rng, names[index % 3], tuple(rng.integers(12, 21, 2)), colour=True)),
                          'label': index % 3}) for index in range(count)]

  data_dir = str(tmp_path_factory.mktemp('custom_tfds'))
  tfds.dataset_builders.store_as_tfds_dataset(
      name='shapes_custom', version='1.0.0', data_dir=data_dir,
      features=tfds.features.FeaturesDict({
          'image': tfds.features.Image(shape=(None, None, 3)),
          'label': tfds.features.ClassLabel(names=names)}),
      split_datasets={'train': examples(40), 'test': examples(12)})
  return data_dir


def test_a_prepared_tfds_dataset_loads_by_name_and_data_dir(custom_tfds_dir):
  overrides = dict(dataset='shapes_custom', data_dir=custom_tfds_dir, preprocess='resize(16)',
                   batch_size=8, num_epochs=1, shuffle_buffer_size=8)
  config = _config(**overrides)
  data = build.open_data(config)  # Not in tfds.list_builders(), but TFDS can load it.
  assert data.source.image_shape == (None, None, 3)
  with pytest.raises(errors.DataError):  # Varying sizes need a resize.
    build.open_data(_config(**{**overrides, 'preprocess': ''}))
  assert data.info == base.DatasetInfo(
      name='shapes_custom', image_shape=(16, 16, 3), num_classes=3, num_train_examples=40,
      num_eval_examples=12, class_names=tuple(image_folders.SHAPES))
  # Varying sizes, resized as decoded: in memory and streamed, the same examples in an epoch.
  in_memory = input_pipeline.open_split(data, 'train', run_spec.resolve(_config(**overrides, in_memory='always')).input)
  streamed = input_pipeline.open_split(data, 'train', run_spec.resolve(_config(**overrides, in_memory='never')).input)
  assert in_memory.images.shape == (40, 16, 16, 3)
  epochs = [sorted(image.tobytes() for batch in input_pipeline.train_batches(split, data, run_spec.resolve(config).input, 8)
                   for image in batch['image'])
            for split in (in_memory, streamed)]
  assert len(epochs[0]) == 40 and epochs[0] == epochs[1]
  # A name that is neither registered nor prepared there is still refused.
  with pytest.raises(errors.ConfigError) as error:
    build.open_source(_config(**{**overrides, 'dataset': 'shapes_kustom'}))
  assert (error.value.key, error.value.value) == ('dataset', 'shapes_kustom')
