"""Image folders: layout, class names, formats, channels, sizes, skipped files, slicing, errors;
in-memory vs streamed splits; resizing."""

import logging
import os

import numpy as np
from PIL import Image
import pytest
import tensorflow as tf

from configs import default
import data_sources
from data_sources import base
from data_sources import folder_source
import image_folders
import input_pipeline
from training import config_checks

# PIL's and TensorFlow's JPEG decoders differ in chroma upsampling and rounding.
_JPEG_TOLERANCE = 8

@pytest.fixture(scope='module')
def shapes_root(tmp_path_factory):
  root = str(tmp_path_factory.mktemp('folders') / 'shapes')
  image_folders.make_shapes_folder(root, {'train': 24, 'test': 8})
  return root


def _config(root, **overrides):
  config = default.get_config()
  config.update(dict(data_source='folder', dataset=root, eval_split='test', batch_size=8,
                     num_epochs=2, shuffle_buffer_size=16, image_size=16))
  config.update(overrides)
  return config


def test_classes_sizes_channels_and_skipped_files(shapes_root, caplog):
  with caplog.at_level(logging.WARNING):
    source = folder_source.FolderSource(shapes_root)
  assert source.class_names == ('centre', 'left half', 'top')  # Sorted folder names.
  assert source.image_shape == (None, None, 3)  # Sizes vary; some images are colour.
  assert source.num_examples('train') == 72 and source.num_examples('test') == 24
  warnings = [record.getMessage() for record in caplog.records
              if record.levelno == logging.WARNING]
  assert len(warnings) == 1
  assert 'Skipped 2 files' in warnings[0]
  assert 'broken.png' in warnings[0] and 'notes.txt' in warnings[0]
  info = source.info(_config(shapes_root))
  assert info == base.DatasetInfo(name=shapes_root, image_shape=(16, 16, 3), num_classes=3,
                                  num_train_examples=72, num_eval_examples=24,
                                  class_names=('centre', 'left half', 'top'))


def test_varying_sizes_without_image_size_are_refused(shapes_root):
  source = folder_source.FolderSource(shapes_root)
  with pytest.raises(base.DataError, match=r'vary in size: set --config.image_size=S'):
    source.info(_config(shapes_root, image_size=None))


def test_every_format_decodes_to_its_pixels(shapes_root):
  for path in sorted(os.listdir(os.path.join(shapes_root, 'test', 'top')))[:8]:
    path = os.path.join(shapes_root, 'test', 'top', path)
    with Image.open(path) as image:
      image_format, expected = image.format, np.asarray(image.convert('RGB')).astype(int)
    decoded = folder_source.decode(tf.constant(path), 3).numpy().astype(int)
    assert decoded.shape == expected.shape
    tolerance = _JPEG_TOLERANCE if image_format == 'JPEG' else 0  # Others decode exactly.
    assert np.abs(decoded - expected).max() <= tolerance, (path, image_format)


def test_grayscale_folders_have_one_channel_and_gray_files_convert_exactly(tmp_path):
  root = str(tmp_path / 'gray')
  files = image_folders.make_shapes_folder(root, {'train': 4}, colour=False, corrupt=False)
  source = folder_source.FolderSource(root)
  assert source.image_shape == (None, None, 1)
  for path, _ in files['train']:
    with Image.open(path) as image:
      image_format, expected = image.format, np.asarray(image.convert('L')).astype(int)
    gray = folder_source.decode(tf.constant(path), 1).numpy()
    tolerance = _JPEG_TOLERANCE if image_format == 'JPEG' else 0  # Others decode exactly.
    assert np.abs(gray[..., 0] - expected).max() <= tolerance, (path, image_format)
    # In a colour dataset the same file becomes 3 channels equal to that gray.
    rgb = folder_source.decode(tf.constant(path), 3).numpy()
    assert all(np.array_equal(rgb[..., channel], gray[..., 0]) for channel in range(3))


def test_one_size_needs_no_image_size(tmp_path):
  root = str(tmp_path / 'fixed')
  image_folders.make_shapes_folder(root, {'train': 3, 'test': 2}, image_sizes=(10, 10),
                                   corrupt=False)
  config = _config(root, image_size=None)
  source = folder_source.FolderSource(root)
  assert source.info(config).image_shape == (10, 10, 3)
  split = input_pipeline.open_split(source, 'train', config)
  assert split.images.shape == (9, 10, 10, 3) and split.images.dtype == np.uint8


def test_resize_keeps_uint8_range_and_constant_images():
  constant = tf.fill((2, 13, 7, 3), tf.constant(200, tf.uint8))
  resized = input_pipeline.resize(constant, (16, 16))
  assert resized.dtype == tf.uint8 and resized.shape == (2, 16, 16, 3)
  assert np.all(resized.numpy() == 200)
  noise = tf.constant(np.random.default_rng(0).integers(0, 256, (9, 9, 1)), tf.uint8)
  assert input_pipeline.resize(noise, (9, 9)) is noise  # Already that size: untouched.
  shrunk = input_pipeline.resize(noise, (4, 4)).numpy()
  assert shrunk.shape == (4, 4, 1) and shrunk.min() >= 0 and shrunk.max() <= 255


def _rows(images):
  """Images as sorted rows of bytes: the same multiset of images <=> equal results."""
  return sorted(image.tobytes() for image in images)


def test_slices_partition_a_split_and_mix_classes(shapes_root):
  config = _config(shapes_root, in_memory='always')
  source = folder_source.FolderSource(shapes_root)
  halves = [input_pipeline.open_split(source, spec, config)
            for spec in ('train[:50%]', 'train[50%:]')]
  whole = input_pipeline.open_split(source, 'train', config)
  assert [len(half.labels) for half in halves] == [36, 36]
  assert all(len(set(half.labels)) == 3 for half in halves)  # Hash order mixes the classes.
  assert _rows(np.concatenate([half.images for half in halves])) == _rows(whole.images)


@pytest.mark.parametrize('make,message', [
    (lambda root: os.makedirs(root), r'has no split folders: the layout is .*/<split>/<class '
                                     r'name>/<image file>'),
    (lambda root: os.makedirs(os.path.join(root, 'train')), r"Split folder '.*train' has no "
                                                            r'class folders'),
    (lambda root: os.makedirs(os.path.join(root, 'train', 'cat')),
     r"Class folder '.*train/cat' holds no readable JPEG/PNG/BMP/GIF image"),
])
def test_bad_layouts_are_one_clear_error(tmp_path, make, message):
  root = str(tmp_path / 'data')
  make(root)
  with pytest.raises(base.DataError, match=message):
    data_sources.open_source(_config(root))


def test_missing_root_and_mistyped_split(shapes_root, tmp_path):
  missing = str(tmp_path / 'nowhere')
  with pytest.raises(config_checks.ConfigError, match=rf"Image folder '{missing}' is not a "
                                                      r'directory'):
    config_checks.check_config(_config(missing))
  source = data_sources.open_source(_config(shapes_root))
  with pytest.raises(base.DataError, match=r"config.train_split='trian' is not a split of .*"
                                           r'test.*train'):
    source.info(_config(shapes_root, train_split='trian'))


def _epochs(split, config, **kwargs):
  chunks = list(input_pipeline.train_batches(split, config, **kwargs))
  images = np.concatenate([chunk['image'].reshape(-1, 16, 16, 3) for chunk in chunks])
  return images.reshape(config.num_epochs - kwargs.get('start_epoch', 0), -1, 16, 16, 3)


def test_streamed_and_in_memory_give_the_same_examples_per_epoch(shapes_root):
  source = folder_source.FolderSource(shapes_root)
  memory = input_pipeline.open_split(source, 'train', _config(shapes_root, in_memory='always'))
  streamed = input_pipeline.open_split(source, 'train', _config(shapes_root, in_memory='never'))
  assert isinstance(memory, base.Split) and isinstance(streamed, input_pipeline.Streamed)
  config = _config(shapes_root)
  in_memory_epochs, streamed_epochs = _epochs(memory, config), _epochs(streamed, config)
  for memory_epoch, streamed_epoch in zip(in_memory_epochs, streamed_epochs):
    assert len(memory_epoch) == 72  # 9 full batches of 8: every example once.
    assert _rows(memory_epoch) == _rows(streamed_epoch)
  assert not np.array_equal(streamed_epochs[0], streamed_epochs[1])  # Reshuffled per epoch.
  np.testing.assert_array_equal(_epochs(streamed, config), streamed_epochs)  # Deterministic.


def test_streamed_resume_gives_the_uninterrupted_batches(shapes_root):
  source = folder_source.FolderSource(shapes_root)
  config = _config(shapes_root, in_memory='never', num_epochs=3, steps_per_dispatch=3,
                   augment='translate(2)|flip_lr')
  streamed = input_pipeline.open_split(source, 'train', config)
  full = list(input_pipeline.train_batches(streamed, config))  # 3 chunks of 3 per epoch.
  resumed = list(input_pipeline.train_batches(streamed, config, start_epoch=1, start_step=3))
  assert len(full) == 9 and len(resumed) == 5
  for got, want in zip(resumed, full[4:]):
    np.testing.assert_array_equal(got['image'], want['image'])
    np.testing.assert_array_equal(got['label'], want['label'])


def test_streamed_eval_batches_read_every_example_once_per_pass(shapes_root):
  source = folder_source.FolderSource(shapes_root)
  memory = input_pipeline.open_split(source, 'test', _config(shapes_root, in_memory='always'))
  streamed = input_pipeline.open_split(source, 'test', _config(shapes_root, in_memory='never'))
  expected = input_pipeline.eval_batches(memory, batch_size=10, num_batches=4)
  batches = input_pipeline.eval_batches(streamed, batch_size=10, num_batches=4)
  assert isinstance(batches, input_pipeline.StreamedBatches)
  for _ in range(2):  # Every pass reads the split again, in the same order.
    got = list(batches)
    assert len(got) == 4 and sum(int(batch['mask'].sum()) for batch in got) == 24
    for got_batch, want_batch in zip(got, expected):
      for key in ('image', 'label', 'mask'):
        np.testing.assert_array_equal(got_batch[key], want_batch[key])
  images, labels = batches.real_examples(np.asarray)
  np.testing.assert_array_equal(labels, memory.labels)
  np.testing.assert_array_equal(images[np.array([23, 0, 11])],
                                memory.images[[23, 0, 11]].astype(np.float32) / 255.0)
