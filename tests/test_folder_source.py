"""Image folders: layout, class names, formats, channels, sizes, skipped and messy files,
slicing, errors; in-memory vs streamed splits; resizing; the header index and the scan's
progress line."""

import logging
import os
import time

import numpy as np
from PIL import Image
import pytest
import tensorflow as tf

from configs import default
from core import errors
from data_sources import base
from data_sources import folder_source
from data_sources import image_files
import image_folders
import input_pipeline
from training import run_spec
import preprocessing
from preprocessing import resize as resize_ops
from tests.helpers import build

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
                     num_epochs=2, shuffle_buffer_size=16, preprocess='resize(16)'))
  config.update(overrides)
  return config


def _data(root, **overrides):
  return build.open_data(_config(root, **overrides))


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
  assert _data(shapes_root).info == base.DatasetInfo(
      name=shapes_root, image_shape=(16, 16, 3), num_classes=3, num_train_examples=72,
      num_eval_examples=24, class_names=('centre', 'left half', 'top'))


def test_varying_sizes_without_a_resize_are_refused(shapes_root):
  with pytest.raises(errors.DataError) as error:
    _data(shapes_root, preprocess='')
  assert error.value.what == shapes_root


def test_every_format_decodes_to_its_pixels(shapes_root):
  for path in sorted(os.listdir(os.path.join(shapes_root, 'test', 'top')))[:8]:
    path = os.path.join(shapes_root, 'test', 'top', path)
    with Image.open(path) as image:
      image_format, expected = image.format, np.asarray(image.convert('RGB')).astype(int)
    decoded = image_files.decode(tf.constant(path), 3).numpy().astype(int)
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
    gray = image_files.decode(tf.constant(path), 1).numpy()
    tolerance = _JPEG_TOLERANCE if image_format == 'JPEG' else 0  # Others decode exactly.
    assert np.abs(gray[..., 0] - expected).max() <= tolerance, (path, image_format)
    # In a colour dataset the same file becomes 3 channels equal to that gray.
    rgb = image_files.decode(tf.constant(path), 3).numpy()
    assert all(np.array_equal(rgb[..., channel], gray[..., 0]) for channel in range(3))


def test_one_size_needs_no_resize(tmp_path):
  root = str(tmp_path / 'fixed')
  image_folders.make_shapes_folder(root, {'train': 3, 'test': 2}, image_sizes=(10, 10),
                                   corrupt=False)
  data = _data(root, preprocess='')
  assert data.info.image_shape == (10, 10, 3)
  split = input_pipeline.open_split(data, 'train', run_spec.resolve(_config(root, preprocess='')).input)
  assert split.images.shape == (9, 10, 10, 3) and split.images.dtype == np.uint8


def test_resize_keeps_uint8_range_and_constant_images():
  constant = tf.fill((2, 13, 7, 3), tf.constant(200, tf.uint8))
  resized = resize_ops.resize_images(constant, (16, 16))
  assert resized.dtype == tf.uint8 and resized.shape == (2, 16, 16, 3)
  assert np.all(resized.numpy() == 200)
  noise = tf.constant(np.random.default_rng(0).integers(0, 256, (9, 9, 1)), tf.uint8)
  assert resize_ops.resize_images(noise, (9, 9)) is noise  # Already that size: untouched.
  shrunk = resize_ops.resize_images(noise, (4, 4)).numpy()
  assert shrunk.shape == (4, 4, 1) and shrunk.min() >= 0 and shrunk.max() <= 255


def _rows(images):
  """Images as sorted rows of bytes: the same multiset of images <=> equal results."""
  return sorted(image.tobytes() for image in images)


def test_slices_partition_a_split_and_mix_classes(shapes_root):
  config = _config(shapes_root, in_memory='always')
  data = build.open_data(config)
  halves = [input_pipeline.open_split(data, spec, run_spec.resolve(config).input)
            for spec in ('train[:50%]', 'train[50%:]')]
  whole = input_pipeline.open_split(data, 'train', run_spec.resolve(config).input)
  assert [len(half.labels) for half in halves] == [36, 36]
  assert all(len(set(half.labels)) == 3 for half in halves)  # Hash order mixes the classes.
  assert _rows(np.concatenate([half.images for half in halves])) == _rows(whole.images)


def _write(path, image, **save_args):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  image.save(path, **save_args)


def _one_image(path):
  _write(path, Image.fromarray(np.zeros((4, 4, 3), np.uint8)))


@pytest.mark.parametrize('make,what', [
    (lambda root: os.makedirs(root), ''),
    (lambda root: os.makedirs(os.path.join(root, 'train')), 'train'),
    # Nothing readable anywhere: one line for the whole dataset.
    (lambda root: os.makedirs(os.path.join(root, 'train', 'cat', 'nested')), ''),
    (lambda root: (os.makedirs(os.path.join(root, 'train', 'cat', 'nested')),
                   _one_image(os.path.join(root, 'train', 'dog', '1.png'))), 'train/cat'),
])
def test_bad_layouts_are_data_errors_naming_the_folder(tmp_path, make, what):
  root = str(tmp_path / 'data')
  make(root)
  with pytest.raises(errors.DataError) as error:
    build.open_source(_config(root))
  assert error.value.what == os.path.join(root, what).rstrip('/')


def test_missing_root_and_mistyped_split(shapes_root, tmp_path):
  missing = str(tmp_path / 'nowhere')
  with pytest.raises(errors.ConfigError) as error:
    build.open_source(_config(missing))
  assert (error.value.key, error.value.value) == ('dataset', missing)
  with pytest.raises(errors.ConfigError) as error:
    _data(shapes_root, train_split='trian')
  assert (error.value.key, error.value.value) == ('train_split', 'trian')


def _messy_folder(root):
  """A colour folder with every kind of messy file a user's photos have, and the good files'
  expected pixels as displayed (16x16 after the EXIF turn)."""
  rng = np.random.default_rng(0)
  expected = {}
  for name in ('circle', 'square'):
    for index in range(6):
      pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
      path = os.path.join(root, 'train', name, f'{index}.png')
      _write(path, Image.fromarray(pixels))
      expected[path] = pixels
  # A nested folder inside a class folder: its images belong to the class.
  nested = os.path.join(root, 'train', 'circle', 'more', 'deeper.png')
  pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
  _write(nested, Image.fromarray(pixels))
  expected[nested] = pixels
  # A JPEG stored 16 wide x 8 high, displayed turned a quarter (EXIF orientation 6: rotate 90
  # degrees clockwise to display).
  stored = np.zeros((8, 16, 3), np.uint8)
  stored[:, :8] = 255  # Left half white.
  exif = Image.Exif()
  exif[0x0112] = 6
  rotated = os.path.join(root, 'train', 'square', 'rotated.jpg')
  _write(rotated, Image.fromarray(stored), exif=exif, quality=100)
  expected[rotated] = np.rot90(stored, k=-1)  # Displayed: 8 wide x 16 high, top half white.
  # An RGBA PNG: a transparent left half over red, an opaque blue right half.
  rgba = np.zeros((16, 16, 4), np.uint8)
  rgba[:, :8] = (255, 0, 0, 0)
  rgba[:, 8:] = (0, 0, 255, 255)
  transparent = os.path.join(root, 'train', 'circle', 'transparent.png')
  _write(transparent, Image.fromarray(rgba, 'RGBA'))
  expected[transparent] = np.concatenate([np.full((16, 8, 3), 255, np.uint8),
                                          np.tile(np.uint8([0, 0, 255]), (16, 8, 1))], axis=1)
  # Damaged files, skipped by name: a truncated JPEG, an empty file, a Thumbs.db.
  good_jpeg = os.path.join(root, 'spare.jpg')
  Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(good_jpeg)
  with open(good_jpeg, 'rb') as file:
    data = file.read()
  os.remove(good_jpeg)
  with open(os.path.join(root, 'train', 'circle', 'truncated.jpg'), 'wb') as file:
    file.write(data[:len(data) // 2])
  open(os.path.join(root, 'train', 'square', 'empty.png'), 'wb').close()
  with open(os.path.join(root, 'train', 'circle', 'Thumbs.db'), 'wb') as file:
    file.write(b'\x00' * 100)
  # A class with a single image.
  _write(os.path.join(root, 'train', 'triangle', 'only.png'),
         Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)))
  return expected


def test_messy_files_are_skipped_by_name_or_read_as_displayed(tmp_path, caplog):
  root = str(tmp_path / 'messy')
  expected = _messy_folder(root)
  with caplog.at_level(logging.WARNING):
    source = folder_source.FolderSource(root)
  warnings = ' '.join(record.getMessage() for record in caplog.records
                      if record.levelno == logging.WARNING)
  for name in ('truncated.jpg', 'empty.png', 'Thumbs.db'):
    assert name in warnings
  assert 'transparent.png' in warnings and 'white' in warnings
  assert 'nested' not in warnings and 'deeper' not in warnings
  assert source.class_names == ('circle', 'square', 'triangle')
  assert source.num_examples('train') == 6 + 6 + 1 + 1 + 1 + 1
  decoded = [example['image'] for example in source.examples('train').as_numpy_iterator()]
  for path, pixels in expected.items():  # Each good file's pixels, as displayed, are there.
    tolerance = _JPEG_TOLERANCE if path.endswith('.jpg') else 0
    assert any(image.shape == pixels.shape
               and np.abs(image.astype(int) - pixels.astype(int)).max() <= tolerance
               for image in decoded), path
  header = image_files.read_header(os.path.join(root, 'train', 'square', 'rotated.jpg'))
  assert header.size == (16, 8) and header.orientation == 6


def test_rare_and_missing_classes_are_named_at_start(tmp_path, caplog):
  root = str(tmp_path / 'messy')
  _messy_folder(root)
  labels = np.array([0] * 12 + [1] * 20, np.int32)
  with caplog.at_level(logging.WARNING):
    input_pipeline.log_class_counts(labels, ('circle', 'square', 'triangle'), 'train')
  warnings = ' '.join(record.getMessage() for record in caplog.records
                      if record.levelno == logging.WARNING)
  assert 'triangle' in warnings  # No example in the split.
  labels = np.array([0] * 12 + [1] * 20 + [2], np.int32)
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    input_pipeline.log_class_counts(labels, ('circle', 'square', 'triangle'), 'train')
  assert 'triangle (1)' in caplog.text


def _epochs(split, config, start_epoch=0, start_step=0):
  data = input_pipeline.Data(None, preprocessing.parse(config.preprocess), None)
  batches = list(input_pipeline.train_batches(split, data, run_spec.resolve(config).input, config.batch_size,
                                              start_epoch, start_step))
  images = np.concatenate([batch['image'] for batch in batches])
  return images.reshape(config.num_epochs - start_epoch, -1, 16, 16, 3)


def test_streamed_and_in_memory_give_the_same_examples_per_epoch(shapes_root):
  data = _data(shapes_root)
  memory = input_pipeline.open_split(data, 'train', run_spec.resolve(_config(shapes_root, in_memory='always')).input)
  streamed = input_pipeline.open_split(data, 'train', run_spec.resolve(_config(shapes_root, in_memory='never')).input)
  assert isinstance(memory, base.Split) and isinstance(streamed, input_pipeline.Streamed)
  config = _config(shapes_root)
  in_memory_epochs, streamed_epochs = _epochs(memory, config), _epochs(streamed, config)
  for memory_epoch, streamed_epoch in zip(in_memory_epochs, streamed_epochs):
    assert len(memory_epoch) == 72  # 9 full batches of 8: every example once.
    assert _rows(memory_epoch) == _rows(streamed_epoch)
  assert not np.array_equal(streamed_epochs[0], streamed_epochs[1])  # Reshuffled per epoch.
  np.testing.assert_array_equal(_epochs(streamed, config), streamed_epochs)  # Deterministic.


def test_streamed_resume_gives_the_uninterrupted_batches(shapes_root):
  config = _config(shapes_root, in_memory='never', num_epochs=3,
                   preprocess='resize(16)|translate(2)|flip_lr')
  data = build.open_data(config)
  streamed = input_pipeline.open_split(data, 'train', run_spec.resolve(config).input)
  batches = lambda *start: list(input_pipeline.train_batches(streamed, data, run_spec.resolve(config).input, 8, *start))
  full, resumed = batches(), batches(1, 3)  # 9 batches per epoch.
  assert len(full) == 27 and len(resumed) == 15
  for got, want in zip(resumed, full[12:]):
    np.testing.assert_array_equal(got['image'], want['image'])
    np.testing.assert_array_equal(got['label'], want['label'])


def test_streamed_eval_batches_read_every_example_once_per_pass(shapes_root):
  data = _data(shapes_root)
  memory = input_pipeline.open_split(data, 'test', run_spec.resolve(_config(shapes_root, in_memory='always')).input)
  streamed = input_pipeline.open_split(data, 'test', run_spec.resolve(_config(shapes_root, in_memory='never')).input)
  expected = input_pipeline.eval_batches(memory, batch_size=10, num_batches=4)
  batches = input_pipeline.eval_batches(streamed, batch_size=10, num_batches=4)
  assert isinstance(batches, input_pipeline.EvalBatches)
  for _ in range(2):  # Every pass reads the split again, in the same order.
    got = list(batches)
    assert len(got) == 4 and sum(int(batch['mask'].sum()) for batch in got) == 24
    for got_batch, want_batch in zip(got, expected):
      for key in ('image', 'label', 'mask'):
        np.testing.assert_array_equal(got_batch[key], want_batch[key])


def _counted_reads(monkeypatch):
  """The paths whose headers are read from now on."""
  reads, read = [], image_files.read_header
  monkeypatch.setattr(image_files, 'read_header', lambda path: reads.append(path) or read(path))
  return reads


def _opened(root, caplog):
  """The folder source of `root`, and the warnings opening it logged."""
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    source = folder_source.FolderSource(root)
  return source, [record.getMessage() for record in caplog.records
                  if record.levelno == logging.WARNING]


def _indexed_folder(root):
  """A small folder with damaged files (broken.png, notes.txt) and a hidden one."""
  image_folders.make_shapes_folder(root, {'train': 3, 'test': 2}, image_sizes=(6, 9))
  open(os.path.join(root, 'train', 'top', '.DS_Store'), 'wb').close()


def _contents(source):
  return (source.class_names, source.image_shape, source._files, source._headers)  # pylint: disable=protected-access


def test_a_folder_opened_again_reads_no_header_and_gives_the_same_splits(tmp_path, monkeypatch,
                                                                         caplog):
  root = str(tmp_path / 'indexed')
  _indexed_folder(root)
  reads = _counted_reads(monkeypatch)
  first, first_warnings = _opened(root, caplog)
  assert len(reads) == 3 * 5 + 2  # Every visible file, damaged ones included; not .DS_Store.
  assert os.path.exists(os.path.join(root, image_files.INDEX_FILE))
  reads.clear()
  second, second_warnings = _opened(root, caplog)
  assert reads == []
  assert _contents(second) == _contents(first)  # Files, labels, order, headers.
  assert second_warnings == first_warnings  # The damaged files are still skipped by name.
  assert 'broken.png' in second_warnings[0] and 'notes.txt' in second_warnings[0]
  assert image_files.INDEX_FILE not in image_files.find_files(root)[0]


def test_files_added_removed_or_replaced_are_read_again(tmp_path, monkeypatch, caplog):
  root = str(tmp_path / 'changing')
  _indexed_folder(root)
  first, _ = _opened(root, caplog)
  folder = os.path.join(root, 'train', 'top')
  added, removed = os.path.join(folder, 'new.png'), os.path.join(folder, '000.png')
  replaced, damaged = os.path.join(folder, '001.jpg'), os.path.join(folder, '002.bmp')
  _write(added, Image.fromarray(np.zeros((5, 7, 3), np.uint8)))
  os.remove(removed)
  _write(replaced, Image.fromarray(np.zeros((30, 40, 3), np.uint8)))
  # Damaged in place, keeping its size and (as cp -p or rsync do) its mtime: its ctime changes.
  stat = os.stat(damaged)
  with open(damaged, 'r+b') as file:
    file.write(b'\0' * stat.st_size)
  os.utime(damaged, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  reads = _counted_reads(monkeypatch)
  second, warnings = _opened(root, caplog)
  assert sorted(reads) == sorted([added, replaced, damaged])
  assert second._headers[replaced].size == (30, 40)  # pylint: disable=protected-access
  assert removed not in second._headers and added in second._headers  # pylint: disable=protected-access
  assert 'broken.png' in warnings[0] and '002.bmp' in warnings[0]
  assert second.num_examples('train') == first.num_examples('train') - 1
  reads.clear()
  assert _contents(_opened(root, caplog)[0]) == _contents(second) and reads == []


@pytest.mark.parametrize('damage', [
    lambda index: index[:len(index) // 2],  # Cut short, as by a full disk.
    lambda index: index[:-200] + bytes(200),  # Zeroed at the end.
    lambda index: b'{"version": 1}',  # Not an index at all.
])
def test_a_damaged_index_is_rebuilt_with_one_warning(tmp_path, monkeypatch, caplog, damage):
  root = str(tmp_path / 'damaged')
  _indexed_folder(root)
  first, first_warnings = _opened(root, caplog)
  index = os.path.join(root, image_files.INDEX_FILE)
  entries = image_files._load_index(index)  # pylint: disable=protected-access
  with open(index, 'rb') as file:
    data = file.read()
  with open(index, 'wb') as file:
    file.write(damage(data))
  reads = _counted_reads(monkeypatch)
  second, warnings = _opened(root, caplog)
  assert len(reads) == 3 * 5 + 2
  assert warnings[1:] == first_warnings and index in warnings[0]
  assert _contents(second) == _contents(first)
  assert image_files._load_index(index) == entries  # Rebuilt whole.  # pylint: disable=protected-access


def test_a_read_only_folder_keeps_its_index_in_the_cache_dir(tmp_path, monkeypatch, caplog):
  root = str(tmp_path / 'shared')
  _indexed_folder(root)
  monkeypatch.setattr(image_files, '_writable', lambda folder: False)
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
  _opened(root, caplog)
  assert not os.path.exists(os.path.join(root, image_files.INDEX_FILE))
  assert image_files.index_path(root).startswith(str(tmp_path / 'cache'))
  assert os.path.exists(image_files.index_path(root))
  reads = _counted_reads(monkeypatch)
  _opened(root, caplog)
  assert reads == []


def test_a_long_header_scan_logs_its_progress(monkeypatch, caplog):
  monkeypatch.setattr(image_files, '_PROGRESS_SECONDS', 0.02)
  monkeypatch.setattr(image_files, 'read_header', lambda path: time.sleep(0.01))
  with caplog.at_level(logging.INFO, logger='absl'):  # absl's level may be set by now.
    image_files.read_headers([f'{index}.png' for index in range(200)])
  lines = [record.getMessage() for record in caplog.records
           if record.getMessage().startswith('Reading image headers:')]
  assert lines and all('/200 files' in line and 'files/s, ETA' in line for line in lines)
