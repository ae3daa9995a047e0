"""Input pipeline: batch layout, value range, shuffle order, resume, full eval coverage,
streaming, data errors."""

import logging
import os
import shutil
import time

import jax
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from configs import default
from tests.helpers.optional import requires_extras
from core import errors
from data_sources import base
from data_sources import tfds_source
import input_pipeline
from modes import evaluate
import preprocessing
import train
from training import run_spec
from tests.helpers import build
import image_folders


def _split(num_examples, image_shape=(6, 5, 1), seed=0):
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (num_examples, *image_shape), dtype=np.uint8)
  # Labels double as example ids so tests can tell which examples were seen.
  return input_pipeline.InMemory(images=images, labels=np.arange(num_examples, dtype=np.int32))


def _config(**overrides):
  config = default.get_config()
  config.update(dict(batch_size=8, num_epochs=2, shuffle_buffer_size=100))
  config.update(overrides)
  return config


def _with(config, **changes):
  """A copy of `config` with `changes`."""
  copy = config.copy_and_resolve_references()
  copy.update(changes)
  return copy


def _batches(split, config, start_epoch=0, start_step=0, augment=True):
  # Labels are example ids (below 2000 here): as many classes, for Mixup's targets.
  info = base.DatasetInfo('test', (), 2000, 0, 0)
  data = input_pipeline.Data(None, preprocessing.parse(config.preprocess), info)
  return list(input_pipeline.train_batches(split, data, run_spec.resolve(config).input, config.batch_size, start_epoch,
                                           start_step, augment))


def _epoch_orders(split, config):
  """Example ids per epoch, in the order the pipeline yields them."""
  ids = np.concatenate([batch['label'] for batch in _batches(split, config)])
  return ids.reshape(config.num_epochs, -1)


def test_train_batches_leave_the_host_as_batch_layout_says():
  """uint8 images (the source's pixels) unless a random op computes new pixel values or Mixup
  blends: then float32 in [0, 1]; `batch_layout` says which, and the scale stage (run by the
  compiled steps on JAX arrays) gives the model's values."""
  split = _split(100)
  info = base.DatasetInfo('test', (6, 5, 1), 2000, 100, 0)  # As `_batches` says.
  for spec, mixup, dtype in (('', 0.0, np.uint8), ('flip_lr|translate(1)', 0.0, np.uint8),
                             ('rotate(10)', 0.0, np.float32), ('flip_lr', 0.2, np.float32)):
    config = _config(preprocess=spec, mixup_alpha=mixup)
    inputs = run_spec.resolve(config).input
    layout = input_pipeline.batch_layout(info, 8, train=inputs)
    batches = _batches(split, config)
    assert len(batches) == 24  # 100 // 8 = 12 batches per epoch, 2 epochs.
    for batch in batches:
      assert {name: (array.shape, array.dtype) for name, array in batch.items()} == layout
      assert 0 <= batch['image'].min() and batch['image'].max() <= (1 if dtype == np.float32 else 255)
    assert batches[0]['image'].dtype == dtype
  plain = _batches(split, _config())
  for batch in plain:  # Each image is its uint8 source.
    np.testing.assert_array_equal(batch['image'], split.images[batch['label']])
  assert input_pipeline.batch_layout(info, 8, mask=True)['image'] == ((8, 6, 5, 1), np.uint8)
  normalize = preprocessing.parse('normalize(0.5, 0.25)')
  scaled = normalize.scale(jax.numpy.asarray(plain[0]['image']))
  np.testing.assert_allclose(scaled, (plain[0]['image'] / 255 - 0.5) / 0.25, atol=1e-5)


def test_same_seed_same_order_other_seed_other_order():
  split = _split(100)
  first = _epoch_orders(split, _config(seed=0))
  again = _epoch_orders(split, _config(seed=0))
  other = _epoch_orders(split, _config(seed=1))
  np.testing.assert_array_equal(first, again)
  assert not np.array_equal(first, other)
  # Reshuffled every epoch, and each epoch sees distinct examples.
  assert not np.array_equal(first[0], first[1])
  assert all(len(set(epoch)) == len(epoch) for epoch in first)


def test_in_memory_epochs_keep_the_order_of_a_shuffle_of_the_examples():
  """An in-memory split's epoch shuffles indices in config.shuffle_buffer_size slots and
  gathers the examples: the order tf.data gives by shuffling the examples themselves, with a
  buffer smaller than the split (a window) or holding it all (a perfect shuffle)."""
  split = _split(100)
  for buffer in (1, 10, 100):
    config = _config(num_epochs=1, shuffle_buffer_size=buffer, batch_size=10)
    seed = input_pipeline.epoch_seed(config.seed, 0)
    shuffled = tf.data.Dataset.from_tensor_slices(split.labels).shuffle(
        buffer, seed=seed, reshuffle_each_iteration=False)
    np.testing.assert_array_equal(_epoch_orders(split, config)[0],
                                  list(shuffled.as_numpy_iterator()))
  assert not np.array_equal(_epoch_orders(split, _config(num_epochs=1))[0], split.labels)


def test_read_ahead_reads_the_next_batches_before_they_are_asked_for():
  """Up to `size` batches are read while the consumer holds the last one given (an epoch's end,
  where the loop saves and evaluates), in order; the source's error reaches the consumer."""
  read = []

  def source():
    for index in range(5):
      read.append(index)
      yield index
  ahead = input_pipeline.read_ahead(source(), size=2)
  assert next(ahead) == 0
  deadline = time.time() + 10
  while len(read) < 3 and time.time() < deadline:  # 0 given; 1 and 2 read ahead, not 3.
    time.sleep(0.01)
  time.sleep(0.05)
  assert read == [0, 1, 2]
  assert list(ahead) == [1, 2, 3, 4]

  def failing():
    yield 0
    raise ValueError('damaged record')
  with pytest.raises(ValueError, match='damaged record'):
    list(input_pipeline.read_ahead(failing()))


def test_start_epoch_continues_the_same_order():
  split = _split(100)
  full = _epoch_orders(split, _config(num_epochs=3))
  resumed = np.concatenate([batch['label'] for batch in
                            _batches(split, _config(num_epochs=3), start_epoch=1)])
  np.testing.assert_array_equal(resumed, full[1:].reshape(-1))


@pytest.mark.parametrize('backend', input_pipeline.INPUT_BACKENDS)
def test_mid_epoch_start_step_gives_the_remaining_batches(backend):
  if backend == 'torch':
    requires_extras('torch')
  config = _config(num_epochs=3, input_backend=backend)
  split = input_pipeline.in_memory(_split(100), run_spec.resolve(config).input)
  full = _batches(split, config)  # 12 batches per epoch.
  resumed = _batches(split, config, start_epoch=1, start_step=6)
  assert len(resumed) == len(full) - 18
  for got, want in zip(resumed, full[18:]):
    np.testing.assert_array_equal(got['label'], want['label'])
    np.testing.assert_array_equal(got['image'], want['image'])


def test_eval_counts_every_example_exactly_once():
  split = _split(1003)
  batches = list(input_pipeline.eval_batches(split, batch_size=100))
  assert len(batches) == 11
  assert all(batch['image'].shape == (100, 6, 5, 1) for batch in batches)
  real = np.concatenate([batch['label'][batch['mask']] for batch in batches])
  np.testing.assert_array_equal(np.sort(real), np.arange(1003))
  assert sum(int(batch['mask'].sum()) for batch in batches) == 1003
  assert not batches[-1]['mask'][3:].any() and batches[-1]['mask'][:3].all()
  assert not batches[-1]['image'][3:].any()  # Zero images pad the last batch.
  # Full batches are views of the split's arrays: an in-memory eval split is held once.
  assert all(np.shares_memory(batch['image'], split.images) for batch in batches[:-1])


def test_real_mnist_info_and_splits(tfds_data_dir):
  data = build.open_data(_config(data_dir=tfds_data_dir))
  assert data.info == base.DatasetInfo(name='mnist', image_shape=(28, 28, 1), num_classes=10,
                                       num_train_examples=60_000, num_eval_examples=10_000,
                                       class_names=tuple('0123456789'))
  source = data.source
  test = source.load_split('test')
  assert test.images.shape == (10_000, 28, 28, 1) and test.images.dtype == np.uint8
  assert sorted(np.unique(test.labels)) == list(range(10))


@pytest.mark.parametrize('split', ['test', 'train[10:1234]', 'test[:10]+train[5:7]'])
def test_block_decoding_equals_tfds_reader(tfds_data_dir, split):
  source = tfds_source.TfdsSource('mnist', tfds_data_dir)
  loaded = source.load_split(split)
  # TFDS's own reader, example by example: the same pixels, labels and order.
  tfds_split = tfds.as_numpy(source.builder.as_dataset(split=split, batch_size=-1, shuffle_files=False))
  np.testing.assert_array_equal(loaded.images, tfds_split['image'])
  np.testing.assert_array_equal(loaded.labels, tfds_split['label'])
  assert loaded.images.dtype == np.uint8 and loaded.labels.dtype == np.int32


def test_unprepared_offline_dataset_names_the_manual_dir(tmp_path, monkeypatch):
  # Simulate a machine without internet, whatever this one has.
  monkeypatch.setattr(tfds_source, '_reachable', lambda host: False)
  with pytest.raises(errors.DataError) as error:
    tfds_source.TfdsSource('mnist', str(tmp_path))
  assert error.value.what == os.path.join(str(tmp_path), 'downloads', 'manual')
  message = str(error.value)
  assert os.path.join(str(tmp_path), 'downloads', 'manual') in message
  for name in ('train-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz'):
    assert name in message


@pytest.mark.parametrize('overrides,key', [
    (dict(in_memory='sometimes'), 'in_memory'),
    (dict(input_backend='jax'), 'input_backend'),
    (dict(preprocess='shear(10)'), 'preprocess'),
    (dict(preprocess='rotate(0)'), 'preprocess'),
    (dict(preprocess='flip_lr|random_crop(32, pad=-1)'), 'preprocess'),
    (dict(preprocess='random_crop(32, 4, 5)'), 'preprocess'),
    (dict(preprocess='random_crop(32'), 'preprocess'),
    (dict(preprocess='translate(size)'), 'preprocess'),
    (dict(preprocess='flip_lr|resize(32)'), 'preprocess'),  # Resize ops come first.
])
def test_bad_input_values_are_config_errors_naming_the_key(overrides, key):
  config = _config(**overrides)
  with pytest.raises(errors.ConfigError) as error:
    run_spec.resolve(config)
  assert (error.value.key, error.value.value) == (key, config[key])


@pytest.mark.parametrize('overrides,key,package', [
    (dict(input_backend='torch', preprocess='flip_lr'), 'input_backend', 'torch'),
    (dict(input_backend='torch', in_memory='never'), 'input_backend', 'torch'),
    (dict(data_source='torchvision', in_memory='never'), 'in_memory', 'torchvision'),
])
def test_sources_and_backends_that_cannot_serve_the_input(overrides, key, package):
  # Known before any data is touched, from the sources' registrations. Without the package,
  # the first problem reported is that it is missing (tests/test_data_sources.py).
  requires_extras(package)
  with pytest.raises(errors.ConfigError) as error:
    run_spec.resolve(_config(**overrides))
  assert error.value.key == key
  assert not isinstance(error.value, errors.MissingPackage)


def test_random_ops_must_keep_the_model_input_size(tfds_data_dir):
  with pytest.raises(errors.ConfigError) as error:  # A 32x32 crop of 28x28 images.
    build.open_data(_config(data_dir=tfds_data_dir,
                                     preprocess='random_crop(32, pad=4)|flip_lr'))
  assert error.value.key == 'preprocess'
  data = build.open_data(_config(data_dir=tfds_data_dir,
                                          preprocess='resize(32)|random_crop(32, pad=4)'))
  assert data.info.image_shape == (32, 32, 1)


def test_augmented_batches_are_seeded_and_resume_exactly():
  split = _split(100, image_shape=(6, 6, 1))
  config = _config(num_epochs=2, preprocess='translate(2)|flip_lr')
  full = _batches(split, config)
  again = _batches(split, config)
  plain = _batches(split, _config(num_epochs=2))
  other = _batches(split, _with(config, seed=1))
  for got, want in zip(again, full):
    np.testing.assert_array_equal(got['image'], want['image'])
  # Same example order as without augmentation; other pixels; another seed draws otherwise.
  assert all(np.array_equal(a['label'], p['label']) for a, p in zip(full, plain))
  assert not all(np.array_equal(a['image'], p['image']) for a, p in zip(full, plain))
  def by_id(batches):  # Epoch 0's augmented image of each example id.
    return {int(label): image for batch in batches[:12]
            for label, image in zip(batch['label'], batch['image'])}
  ours, theirs = by_id(full), by_id(other)
  assert not all(np.array_equal(ours[i], theirs[i]) for i in ours.keys() & theirs.keys())
  resumed = _batches(split, config, start_epoch=1, start_step=6)
  assert len(resumed) == len(full) - 18
  for got, want in zip(resumed, full[18:]):
    np.testing.assert_array_equal(got['image'], want['image'])
    np.testing.assert_array_equal(got['label'], want['label'])
  # Without augmentation (precise BatchNorm's batches): the same examples, as eval sees them.
  for got, want in zip(_batches(split, config, augment=False), plain):
    np.testing.assert_array_equal(got['image'], want['image'])
    np.testing.assert_array_equal(got['label'], want['label'])


def test_tfds_streaming_gives_the_in_memory_examples_and_resumes_exactly(tfds_data_dir):
  config = _config(data_dir=tfds_data_dir, train_split='train[:512]', batch_size=64,
                   shuffle_buffer_size=128)
  data = build.open_data(config)
  streamed = input_pipeline.open_split(data, config.train_split, run_spec.resolve(_with(config, in_memory='never')).input)
  in_memory = input_pipeline.open_split(data, config.train_split, run_spec.resolve(config).input)
  assert isinstance(streamed, input_pipeline.Streamed) and streamed.num_examples == 512
  full = _batches(streamed, config)  # 8 batches per epoch.
  epochs = [_batches(split, config) for split in (in_memory, streamed)]
  for in_memory_epoch, streamed_epoch in zip(*[[batches[:8], batches[8:]] for batches in epochs]):
    rows = [sorted(image.tobytes() for batch in batches for image in batch['image'])
            for batches in (in_memory_epoch, streamed_epoch)]
    assert len(rows[0]) == 512 and rows[0] == rows[1]
  resumed = _batches(streamed, config, start_epoch=1, start_step=2)
  assert len(resumed) == 6
  for got, want in zip(resumed, full[10:]):
    np.testing.assert_array_equal(got['image'], want['image'])


def test_a_streamed_run_trains_evaluates_and_draws_eval_images(tfds_data_dir, tmp_path):
  config = _config(data_dir=tfds_data_dir, in_memory='never', train_split='train[:256]',
                   eval_split='test[:200]', batch_size=32, num_epochs=1, eval_batch_size=64,
                   evaluators='loss|accuracy|misclassified(4)', log_every_steps=4)
  metrics = train.train_and_evaluate(run_spec.resolve(config), str(tmp_path))
  # The streamed eval scores what the in-memory eval scores.
  in_memory = evaluate.evaluate_checkpoint(run_spec.resolve(_with(config, in_memory='always')),
                                           str(tmp_path))
  assert in_memory['eval/accuracy'] == pytest.approx(metrics['eval/accuracy'], abs=1e-6)
  assert in_memory['eval/loss'] == pytest.approx(metrics['eval/loss'], rel=1e-5)


def test_decoded_cache_serves_later_epochs_and_resumes_exactly(tmp_path):
  """With a decoded cache, epochs after the first read no file (the folder is gone by then),
  and a run resumed in epoch 1 (its cache filled anew) gives the uninterrupted run's
  batches."""
  root = str(tmp_path / 'photos')
  image_folders.make_shapes_folder(root, {'train': 6}, image_sizes=(20, 40), corrupt=False)
  config = _config(data_source='folder', dataset=root, train_split='train', eval_split='train',
                   batch_size=4, num_epochs=2, shuffle_buffer_size=8,
                   preprocess='random_resized_crop(16)|flip_lr', decoded_cache='memory')
  run = run_spec.resolve(config)
  data = input_pipeline.open_data(run.input, {})
  split = input_pipeline.open_split(data, 'train', run.input)
  resumed = list(input_pipeline.train_batches(split, data, run.input, 4, 1, 2))
  batches = input_pipeline.train_batches(split, data, run.input, 4)
  first_epoch = [next(batches) for _ in range(4)]  # 18 images: 4 batches an epoch.
  shutil.rmtree(root)
  second_epoch = list(batches)
  assert len(second_epoch) == 4 and len(resumed) == 2
  for got, want in zip(resumed, second_epoch[2:]):
    np.testing.assert_array_equal(got['image'], want['image'])
    np.testing.assert_array_equal(got['label'], want['label'])
  assert not np.array_equal(first_epoch[0]['image'], second_epoch[0]['image'])
  assert all(batch['image'].dtype == np.uint8 for batch in first_epoch + second_epoch)


def test_streamed_shuffle_buffers_hold_what_fits_in_memory(tmp_path, monkeypatch, caplog):
  """A streamed split's shuffle buffer holds config.shuffle_buffer_size examples, or as many
  as fit MEMORY_SHARE of the memory, with a warning naming the setting; the run still
  trains."""
  root = str(tmp_path / 'photos')
  image_folders.make_shapes_folder(root, {'train': 6}, image_sizes=(20, 40), corrupt=False)
  config = _config(data_source='folder', dataset=root, train_split='train', eval_split='train',
                   batch_size=4, num_epochs=1, shuffle_buffer_size=12, in_memory='never',
                   preprocess='random_resized_crop(16)|flip_lr', decoded_cache='off')
  run = run_spec.resolve(config)
  data = input_pipeline.open_data(run.input, {})
  assert input_pipeline.open_split(data, 'train', run.input).shuffle_buffer() == 12
  # Room for 5 crops of 16x16x3 (768 bytes each).
  monkeypatch.setattr(input_pipeline, '_memory_budget', lambda: 5 * 768 + 100)
  warnings = lambda: [message for message in caplog.messages
                      if message.startswith('config.shuffle_buffer_size=12')]
  with caplog.at_level(logging.WARNING, logger='absl'):
    split = input_pipeline.open_split(data, 'train', run.input)
    assert not warnings()  # Worked out when first needed, once:
    assert split.shuffle_buffer() == split.shuffle_buffer() == 5
  assert len(warnings()) == 1 and '768-byte' in warnings()[0]
  batches = list(input_pipeline.train_batches(split, data, run.input, 4))
  assert len(batches) == 4 and batches[0]['image'].shape == (4, 16, 16, 3)
