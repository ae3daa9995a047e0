"""Input pipeline: batch layout, value range, shuffle order, full eval coverage, data errors."""

import os

import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from data_sources import tfds_source

from data_sources import augmentations
from data_sources import base
import tensorflow_datasets as tfds
from training import config_checks

import data_sources
import input_pipeline
from modes import evaluate
import train
from configs import default
from conftest import requires_extras


def _split(num_examples, image_shape=(6, 5, 1), seed=0):
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (num_examples, *image_shape), dtype=np.uint8)
  # Labels double as example ids so tests can tell which examples were seen.
  return base.Split(images=images, labels=np.arange(num_examples, dtype=np.int32))


def _config(**overrides):
  config = default.get_config()
  config.update(dict(batch_size=8, num_epochs=2, shuffle_buffer_size=100, steps_per_dispatch=1))
  config.update(overrides)
  return config


def _epoch_orders(split, config):
  """Example ids per epoch, in the order the pipeline yields them."""
  ids = np.concatenate([chunk['label'].reshape(-1)
                        for chunk in input_pipeline.train_batches(split, config)])
  return ids.reshape(config.num_epochs, -1)


def test_train_batch_layout_and_values():
  split = _split(100)
  chunks = list(input_pipeline.train_batches(split, _config(steps_per_dispatch=3)))
  # 100 // 8 = 12 batches per epoch: chunks of 3 steps, 4 chunks per epoch, 2 epochs.
  assert len(chunks) == 8
  for chunk in chunks:
    assert chunk['image'].shape == (3, 8, 6, 5, 1)
    assert chunk['image'].dtype == np.float32
    assert chunk['label'].shape == (3, 8)
    assert chunk['label'].dtype == np.int32
    assert 0.0 <= chunk['image'].min() and chunk['image'].max() <= 1.0
    # Each image is its uint8 source scaled to [0, 1].
    np.testing.assert_allclose(chunk['image'] * 255.0, split.images[chunk['label']], atol=1e-4)


def test_uneven_chunks_keep_remaining_steps():
  chunks = list(input_pipeline.train_batches(_split(100), _config(steps_per_dispatch=5,
                                                                  num_epochs=1)))
  assert [len(chunk['label']) for chunk in chunks] == [5, 5, 2]


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


def test_start_epoch_continues_the_same_order():
  split = _split(100)
  full = _epoch_orders(split, _config(num_epochs=3))
  resumed = np.concatenate([chunk['label'].reshape(-1) for chunk in
                            input_pipeline.train_batches(split, _config(num_epochs=3), 1)])
  np.testing.assert_array_equal(resumed, full[1:].reshape(-1))


@pytest.mark.parametrize('backend', data_sources.INPUT_BACKENDS)
def test_mid_epoch_start_step_gives_the_remaining_chunks(backend):
  if backend == 'torch':
    requires_extras('torch')
  split = _split(100)
  config = _config(num_epochs=3, steps_per_dispatch=3, input_backend=backend)
  full = list(input_pipeline.train_batches(split, config))  # 4 chunks of 3 steps per epoch.
  resumed = list(input_pipeline.train_batches(split, config, start_epoch=1, start_step=6))
  assert len(resumed) == len(full) - 6
  for got, want in zip(resumed, full[6:]):
    np.testing.assert_array_equal(got['label'], want['label'])
    np.testing.assert_array_equal(got['image'], want['image'])


def test_eval_counts_every_example_exactly_once():
  split = _split(1003)
  batches = input_pipeline.eval_batches(split, batch_size=100)
  assert len(batches) == 11
  assert all(batch['image'].shape == (100, 6, 5, 1) for batch in batches)
  real = np.concatenate([batch['label'][batch['mask']] for batch in batches])
  np.testing.assert_array_equal(np.sort(real), np.arange(1003))
  assert sum(int(batch['mask'].sum()) for batch in batches) == 1003
  assert not batches[-1]['mask'][3:].any() and batches[-1]['mask'][:3].all()


def test_real_mnist_info_and_splits(tfds_data_dir):
  config = _config(data_dir=tfds_data_dir)
  source = tfds_source.TfdsSource('mnist', config.data_dir)
  info = source.info(config)
  assert info == base.DatasetInfo(name='mnist', image_shape=(28, 28, 1),
                                            num_classes=10, num_train_examples=60_000,
                                            num_eval_examples=10_000,
                                            class_names=tuple('0123456789'))
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
  with pytest.raises(base.DataError) as error:
    tfds_source.TfdsSource('mnist', str(tmp_path))
  message = str(error.value)
  assert os.path.join(str(tmp_path), 'downloads', 'manual') in message
  for name in ('train-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz'):
    assert name in message


@pytest.mark.parametrize('overrides,message', [
    (dict(image_size=0), r'config.image_size=0 is invalid: it must be an integer >= 1'),
    (dict(image_size=-3), r'config.image_size=-3 is invalid'),
    (dict(in_memory='sometimes'), r"Unknown in_memory 'sometimes'.*\['auto', 'always', "
                                  r"'never'\]"),
    (dict(augment='shear(10)'), r"config.augment='shear\(10\)' is invalid: unknown op "
                                r"'shear' \(ops: flip_lr, random_crop\(size, pad=0\), "
                                r'translate\(pixels\), rotate\(degrees\)\)'),
    (dict(augment='rotate(0)'), r"bad arguments for .rotate\(0\).: degrees=0 must be a number "
                                r'in \(0, 180\]'),
    (dict(augment='flip_lr|random_crop(32, pad=-1)'), r'bad arguments for .random_crop\(32, '
                                                      r'pad=-1\).: pad=-1 must be an integer >= 0'),
    (dict(augment='random_crop(32, 4, 5)'), r'bad arguments for .*takes from 1 to 2 positional'),
    (dict(augment='random_crop(32'), r"'random_crop\(32' is not an op with literal arguments"),
    (dict(augment='translate(size)'), r"'translate\(size\)' is not an op with literal arguments"),
    (dict(input_backend='torch', augment='flip_lr'), r"config.input_backend='torch' takes "
                                                     r'in-memory splits without augmentation'),
])
def test_bad_input_values_are_one_line_errors(overrides, message):
  if overrides.get('input_backend') == 'torch':
    requires_extras('torch')
  with pytest.raises(config_checks.ConfigError, match=message):
    config_checks.check_config(_config(**overrides))


def test_streaming_needs_a_source_that_streams():
  requires_extras('datasets')
  with pytest.raises(config_checks.ConfigError,
                     match=r"in_memory='never' streams .* data_source 'huggingface' cannot"):
    config_checks.check_config(_config(data_source='huggingface', in_memory='never'))


def test_a_crop_must_keep_the_model_input_size():
  config = _config(augment='random_crop(32, pad=4)|flip_lr')
  config_checks.check_augment(config, (32, 32, 3))
  with pytest.raises(config_checks.ConfigError, match=r"config.augment='random_crop\(32, pad=4\)"
                                                      r"\|flip_lr' does not fit the data: it "
                                                      r'turns 28x28 images into 32x32 ones'):
    config_checks.check_augment(config, (28, 28, 1))


def _windows(padded, size):
  """Every size x size window of a padded image (H, W, C)."""
  return [padded[row:row + size, column:column + size]
          for row in range(padded.shape[0] - size + 1)
          for column in range(padded.shape[1] - size + 1)]


def test_augmentation_ops_draw_per_image():
  rng = np.random.default_rng(0)
  images = rng.random((64, 6, 6, 2)).astype(np.float32)
  seed = tf.constant([3, 4], tf.int64)
  flipped = augmentations.apply(augmentations.parse('flip_lr'), images, seed).numpy()
  mirrored = [np.array_equal(out, image[:, ::-1]) for out, image in zip(flipped, images)]
  assert all(mirrored[i] or np.array_equal(flipped[i], images[i]) for i in range(64))
  assert 16 < sum(mirrored) < 48  # About half, drawn per image.
  for spec, pad in (('random_crop(6, pad=2)', 2), ('translate(1)', 1)):
    out = augmentations.apply(augmentations.parse(spec), images, seed).numpy()
    assert out.shape == images.shape
    offsets = set()
    for crop, image in zip(out, images):
      windows = _windows(np.pad(image, ((pad, pad), (pad, pad), (0, 0))), 6)
      matches = [index for index, window in enumerate(windows) if np.array_equal(window, crop)]
      assert matches, spec  # Each output is one window of its zero-padded image...
      offsets.add(matches[0])
    assert len(offsets) > 1, spec  # ...at offsets that differ between images.
  cropped = augmentations.apply(augmentations.parse('random_crop(4)'), images, seed)
  assert cropped.shape == (64, 4, 4, 2)


def test_rotate_turns_each_image_by_its_own_angle_within_the_limit():
  rng = np.random.default_rng(0)
  images = rng.random((64, 6, 6, 2)).astype(np.float32)
  # A quarter turn is exact on a square grid: counter-clockwise, about the centre.
  quarter = augmentations.rotate_by(images, tf.fill([64], np.pi / 2)).numpy()
  np.testing.assert_allclose(quarter, np.rot90(images, axes=(1, 2)), atol=1e-5)
  # A single bright pixel at radius 10 from the centre of a 21x21 image: where it lands gives
  # the angle each image was turned by.
  dot = np.zeros((256, 21, 21, 1), np.float32)
  dot[:, 10, 20] = 1  # Right of the centre (10, 10).
  out = augmentations.apply(augmentations.parse('rotate(15)'), dot, tf.constant([1, 2])).numpy()
  rows, columns = np.unravel_index(out[..., 0].reshape(256, -1).argmax(axis=1), (21, 21))
  angles = np.degrees(np.arctan2(10 - rows, columns - 10))  # Counter-clockwise, rows grow down.
  assert np.all(np.abs(angles) <= 15 + 3)  # Within the limit (plus a pixel's rounding)...
  assert angles.min() < -10 and angles.max() > 10  # ...spread over it, drawn per image.


def test_augmented_batches_are_seeded_and_resume_exactly():
  split = _split(100, image_shape=(6, 6, 1))
  config = _config(num_epochs=2, steps_per_dispatch=3, augment='translate(2)|flip_lr')
  full = list(input_pipeline.train_batches(split, config))
  again = list(input_pipeline.train_batches(split, config))
  plain = list(input_pipeline.train_batches(split, _config(num_epochs=2, steps_per_dispatch=3)))
  other = list(input_pipeline.train_batches(split, _config(**{**config, 'seed': 1})))
  for got, want in zip(again, full):
    np.testing.assert_array_equal(got['image'], want['image'])
  # Same example order as without augmentation; other pixels; another seed draws otherwise.
  assert all(np.array_equal(a['label'], p['label']) for a, p in zip(full, plain))
  assert not all(np.array_equal(a['image'], p['image']) for a, p in zip(full, plain))
  def by_id(chunks):  # Epoch 0's augmented image of each example id.
    return {int(label): image for chunk in chunks[:4]
            for label, image in zip(chunk['label'].ravel(), chunk['image'].reshape(-1, 6, 6, 1))}
  ours, theirs = by_id(full), by_id(other)
  assert not all(np.array_equal(ours[i], theirs[i]) for i in ours.keys() & theirs.keys())
  resumed = list(input_pipeline.train_batches(split, config, start_epoch=1, start_step=6))
  assert len(resumed) == len(full) - 6
  for got, want in zip(resumed, full[6:]):
    np.testing.assert_array_equal(got['image'], want['image'])
    np.testing.assert_array_equal(got['label'], want['label'])


def test_tfds_streaming_gives_the_in_memory_examples_and_resumes_exactly(tfds_data_dir):
  config = _config(data_dir=tfds_data_dir, train_split='train[:512]', batch_size=64,
                   steps_per_dispatch=2, shuffle_buffer_size=128)
  source = tfds_source.TfdsSource('mnist', tfds_data_dir)
  streamed = input_pipeline.open_split(source, config.train_split,
                                       _config(**{**config, 'in_memory': 'never'}))
  in_memory = input_pipeline.open_split(source, config.train_split, config)
  assert isinstance(streamed, input_pipeline.Streamed) and streamed.num_examples == 512
  full = list(input_pipeline.train_batches(streamed, config))  # 4 chunks of 2 per epoch.
  epochs = [list(input_pipeline.train_batches(split, config)) for split in (in_memory, streamed)]
  for in_memory_epoch, streamed_epoch in zip(*[[chunks[:4], chunks[4:]] for chunks in epochs]):
    rows = [sorted(image.tobytes() for chunk in chunks for image in chunk['image'].reshape(-1, 784))
            for chunks in (in_memory_epoch, streamed_epoch)]
    assert len(rows[0]) == 512 and rows[0] == rows[1]
  resumed = list(input_pipeline.train_batches(streamed, config, start_epoch=1, start_step=2))
  assert len(resumed) == 3
  for got, want in zip(resumed, full[5:]):
    np.testing.assert_array_equal(got['image'], want['image'])


def test_a_streamed_run_trains_evaluates_and_draws_eval_images(tfds_data_dir, tmp_path):
  config = _config(data_dir=tfds_data_dir, in_memory='never', train_split='train[:256]',
                   eval_split='test[:200]', batch_size=32, num_epochs=1, eval_batch_size=64,
                   num_misclassified_images=4, log_every_steps=4)
  metrics = train.train_and_evaluate(config, str(tmp_path))
  assert metrics['eval_num_examples'] == 200 and metrics['train_num_examples'] == 256
  # The streamed eval scores what the in-memory eval scores.
  in_memory = evaluate.evaluate_checkpoint(_config(**{**config, 'in_memory': 'always'}),
                                           str(tmp_path))
  assert in_memory['eval_num_examples'] == 200
  assert in_memory['eval_accuracy'] == pytest.approx(metrics['eval_accuracy'], abs=1e-6)
  assert in_memory['eval_loss'] == pytest.approx(metrics['eval_loss'], rel=1e-5)
