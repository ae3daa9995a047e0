"""Images labelled by a CSV file: Kaggle-style layouts, split columns, class order, skipped rows,
errors, slicing, streamed vs in-memory, and a short training run."""

import csv
import logging
import os

import numpy as np
from PIL import Image
import pytest

from configs import default
from core import errors
from data_sources import base
from data_sources import csv_source
import image_folders
import input_pipeline
import train
from training import run_spec
from tests.helpers import build

# Kaggle-style integer labels for the shapes: sorted numerically, '2' comes before '10'.
LABELS = {'top': '1', 'left half': '2', 'centre': '10'}
CLASS_NAMES = ('1', '2', '10')


def _write_csv(path, rows):
  with open(path, 'w', newline='', encoding='utf-8') as file:
    csv.writer(file).writerows(rows)
  return str(path)


def _kaggle(root, per_class, *, image_size=(12, 12), gray_every=3, seed=0):
  """root/train.csv (id,label) and root/images/<id>.png; returns {id: (pixels, label)}."""
  rng = np.random.default_rng(seed)
  os.makedirs(os.path.join(root, 'images'))
  rows, expected = [('id', 'label')], {}
  for index in range(per_class * len(LABELS)):
    name = list(LABELS)[index % len(LABELS)]
    image = image_folders.shape_image(rng, name, image_size, colour=index % gray_every != 0)
    image_id = f'{rng.integers(16**8):08x}'  # Ids without an extension, as Kaggle's are.
    image.save(os.path.join(root, 'images', f'{image_id}.png'))
    rows.append((image_id, LABELS[name]))
    expected[image_id] = (np.asarray(image.convert('RGB')), LABELS[name])
  return _write_csv(os.path.join(root, 'train.csv'), rows), expected


KAGGLE = {'images': 'images', 'file_column': 'id', 'extension': 'png'}  # The options _kaggle needs.


def _config(csv_path, options=None, **overrides):
  """A config for the CSV source with `options` (default: `KAGGLE`)."""
  config = default.get_config()
  config.update(dict(data_source='csv', dataset=csv_path, train_split='train[:75%]',
                     eval_split='train[75%:]', batch_size=8, num_epochs=2,
                     shuffle_buffer_size=16, preprocess=''))
  config.data_source_options.csv = KAGGLE if options is None else options
  config.update(overrides)
  return config


@pytest.fixture(scope='module')
def kaggle(tmp_path_factory):
  return _kaggle(str(tmp_path_factory.mktemp('kaggle')), per_class=8)


def test_kaggle_layout_gives_its_info_classes_and_pixels(kaggle):
  csv_path, expected = kaggle
  config = _config(csv_path, in_memory='always')
  data = build.open_data(config)
  assert data.info == base.DatasetInfo(
      name=csv_path, image_shape=(12, 12, 3), num_classes=3, num_train_examples=18,
      num_eval_examples=6, class_names=CLASS_NAMES)
  train_split = input_pipeline.open_split(data, 'train[:75%]', run_spec.resolve(config).input)
  eval_split = input_pipeline.open_split(data, 'train[75%:]', run_spec.resolve(config).input)
  assert train_split.images.shape == (18, 12, 12, 3) and train_split.images.dtype == np.uint8
  images = np.concatenate([train_split.images, eval_split.images])
  labels = np.concatenate([train_split.labels, eval_split.labels])
  for pixels, label in list(expected.values())[:6]:  # Each file's pixels, with its label.
    found = [index for index, image in enumerate(images) if np.array_equal(image, pixels)]
    assert len(found) == 1 and CLASS_NAMES[labels[found[0]]] == label


def test_split_column_paths_sizes_and_gray_images(tmp_path):
  """Paths relative to the CSV's folder (and one absolute), a split column, varying sizes, all
  gray; a label only in 'test' is still a class, the same in both splits."""
  rng = np.random.default_rng(1)
  rows = [('label', 'file', 'split')]  # Any column order.
  for index in range(12):
    split, name = ('train', 'test')[index % 4 == 0], list(LABELS)[index % 3]
    path = tmp_path / split / f'{index}.jpg'
    path.parent.mkdir(exist_ok=True)
    size = (10 + index % 3, 14)
    image_folders.shape_image(rng, name, size, colour=False).save(path, quality=95)
    rows.append((name, str(path) if index == 5 else f'{split}/{index}.jpg', split))
  path = tmp_path / 'extra' / 'only_in_test.png'
  path.parent.mkdir()
  image_folders.shape_image(rng, 'top', (12, 12), colour=False).save(path)
  rows.append(('star', 'extra/only_in_test.png', 'test'))
  csv_path = _write_csv(tmp_path / 'labels.csv', rows)
  config = _config(csv_path, {}, train_split='train', eval_split='test', preprocess='resize(16)')
  source = build.open_source(config)
  assert source.image_shape == (None, None, 1)  # Sizes vary; every image is gray.
  assert source.class_names == ('centre', 'left half', 'star', 'top')
  assert (source.num_examples('train'), source.num_examples('test')) == (9, 4)
  assert source.num_examples('train[:3]+test') == 7
  info = build.open_data(config).info
  assert info.image_shape == (16, 16, 1) and (info.num_train_examples, info.num_eval_examples) == (
      9, 4)
  labels = {example['label'] for example in source.examples('test').as_numpy_iterator()}
  assert labels == {0, 1, 2, 3}  # centre, left half, star and top all in 'test'.


def test_unknown_split_and_varying_sizes_without_resize_are_refused(tmp_path, kaggle):
  with pytest.raises(errors.ConfigError) as error:
    build.open_data(_config(kaggle[0], eval_split='test'))
  assert (error.value.key, error.value.value) == ('eval_split', 'test')  # No split column.
  csv_path = _write_csv(tmp_path / 'sized.csv', [('file', 'label'), ('a.png', 'x'),
                                                  ('b.png', 'y')])
  for name, size in (('a.png', (8, 8)), ('b.png', (8, 9))):
    Image.new('RGB', size[::-1]).save(tmp_path / name)
  config = _config(csv_path, {}, train_split='train', eval_split='train')
  with pytest.raises(errors.DataError):
    build.open_data(config)


def _bad_rows(root):
  """A CSV whose rows 2-4 are good and 5-10 are bad in every way a user's CSV can be."""
  rng = np.random.default_rng(2)
  for index in range(3):
    image_folders.shape_image(rng, 'top', (8, 8), colour=True).save(f'{root}/good{index}.png')
  jpeg = f'{root}/whole.jpg'
  Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(jpeg)
  with open(jpeg, 'rb') as file:
    data = file.read()
  with open(f'{root}/truncated.jpg', 'wb') as file:
    file.write(data[:len(data) // 2])
  with open(f'{root}/notes.png', 'w', encoding='utf-8') as file:
    file.write('not an image')
  return _write_csv(f'{root}/train.csv', [
      ('file', 'label'),
      ('good0.png', 'a'), ('good1.png', 'b'), ('good2.png', 'a'),  # Lines 2-4.
      ('missing.png', 'a'),  # 5: no such file.
      ('', 'b'),  # 6: no file name.
      ('whole.jpg', ' '),  # 7: an empty label.
      ('notes.png', 'a'),  # 8: not an image.
      ('truncated.jpg', 'b'),  # 9: cut short.
      ('./good1.png', 'b'),  # 10: the file of line 3 again.
  ])


def test_bad_rows_are_skipped_with_one_warning_naming_them(tmp_path, caplog):
  csv_path = _bad_rows(tmp_path)
  with caplog.at_level(logging.WARNING):
    source = csv_source.CsvSource(csv_path)
  warnings = [record.getMessage() for record in caplog.records
              if record.levelno == logging.WARNING]
  assert len(warnings) == 1, warnings
  assert 'Skipped 6 of 9 rows' in warnings[0]
  # The first five by line, each with its file where it has one; the sixth counted.
  for named in ('line 5 (missing.png', 'line 6 (', 'line 7 (', 'line 8 (notes.png',
                'line 9 (truncated.jpg', 'and 1 more'):
    assert named in warnings[0], named
  assert source.num_examples('train') == 3
  assert source.class_names == ('a', 'b')


@pytest.mark.parametrize('header,options,key,value', [
    (('id', 'label'), {}, 'file_column', 'file'),
    (('file', 'class'), {}, 'label_column', 'label'),
    (('file', 'label'), {'label_column': 'breed'}, 'label_column', 'breed'),
])
def test_missing_columns_are_config_errors_naming_them(tmp_path, header, options, key, value):
  Image.new('RGB', (4, 4)).save(tmp_path / 'a.png')
  csv_path = _write_csv(tmp_path / 'train.csv', [header, ('a.png', 'x')])
  with pytest.raises(errors.ConfigError) as error:
    csv_source.CsvSource(csv_path, **options)
  assert (error.value.key, error.value.value) == (f'data_source_options.csv.{key}', value)
  assert (error.value.what, error.value.columns) == (csv_path, header)


def test_unusable_csvs_are_typed_errors_naming_the_file(tmp_path):
  missing = str(tmp_path / 'nowhere.csv')
  with pytest.raises(errors.ConfigError) as error:
    build.open_source(_config(missing))
  assert (error.value.key, error.value.value) == ('dataset', missing)
  csv_path = _write_csv(tmp_path / 'train.csv', [('id', 'label'), ('a', 'x'), ('b', 'y')])
  with pytest.raises(errors.ConfigError) as error:  # The images folder does not exist.
    build.open_source(_config(csv_path))
  assert (error.value.key, error.value.value) == ('data_source_options.csv.images', 'images')
  os.makedirs(tmp_path / 'images')
  with pytest.raises(errors.DataError) as error:  # No row names an existing file.
    build.open_source(_config(csv_path))
  assert error.value.what == csv_path
  for name, content in (('empty.csv', b''), ('binary.csv', b'\xff\xfe\x00\x81id,label\n')):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(errors.DataError) as error:
      csv_source.CsvSource(str(tmp_path / name))
    assert error.value.what == str(tmp_path / name)


def _rows(images):
  """Images as sorted rows of bytes: the same multiset of images <=> equal results."""
  return sorted(image.tobytes() for image in images)


def test_slices_partition_the_split_in_a_stable_mixed_order(kaggle):
  csv_path, _ = kaggle
  config = _config(csv_path, in_memory='always')
  data = build.open_data(config)
  halves = [input_pipeline.open_split(data, spec, run_spec.resolve(config).input) for spec in ('train[:50%]',
                                                                        'train[50%:]')]
  whole = input_pipeline.open_split(data, 'train', run_spec.resolve(config).input)
  assert [len(half.labels) for half in halves] == [12, 12]
  assert all(len(set(half.labels)) == 3 for half in halves)  # Hash order mixes the classes.
  assert _rows(np.concatenate([half.images for half in halves])) == _rows(whole.images)
  again = input_pipeline.open_split(build.open_data(config), 'train', run_spec.resolve(config).input)
  np.testing.assert_array_equal(again.images, whole.images)  # The same order every time.


def test_streamed_and_in_memory_give_the_same_examples(kaggle):
  csv_path, _ = kaggle
  data = build.open_data(_config(csv_path))
  memory = input_pipeline.open_split(data, 'train[:75%]', run_spec.resolve(_config(csv_path, in_memory='always')).input)
  streamed = input_pipeline.open_split(data, 'train[:75%]', run_spec.resolve(_config(csv_path, in_memory='never')).input)
  assert isinstance(memory, base.Split) and isinstance(streamed, input_pipeline.Streamed)
  examples = list(streamed.examples(None).as_numpy_iterator())  # The source's order.
  np.testing.assert_array_equal(np.stack([example['image'] for example in examples]),
                                memory.images)
  np.testing.assert_array_equal([example['label'] for example in examples], memory.labels)


def test_exif_orientation_and_transparency_as_the_folder_source(tmp_path, caplog):
  stored = np.zeros((8, 16, 3), np.uint8)
  stored[:, :8] = 255  # Left half white; EXIF 6: displayed turned a quarter clockwise.
  exif = Image.Exif()
  exif[0x0112] = 6
  Image.fromarray(stored).save(tmp_path / 'turned.jpg', exif=exif, quality=100)
  rgba = np.zeros((16, 8, 4), np.uint8)
  rgba[:8] = (255, 0, 0, 0)  # Transparent top half; an opaque blue bottom half.
  rgba[8:] = (0, 0, 255, 255)
  Image.fromarray(rgba, 'RGBA').save(tmp_path / 'clear.png')
  csv_path = _write_csv(tmp_path / 'train.csv', [('file', 'label'), ('turned.jpg', 'a'),
                                                  ('clear.png', 'b')])
  with caplog.at_level(logging.WARNING):
    source = csv_source.CsvSource(csv_path)
  assert 'clear.png' in caplog.text and 'white' in caplog.text
  assert source.image_shape == (16, 8, 3)
  split = source.load_split('train')
  images = {int(label): image.astype(int) for image, label in zip(split.images, split.labels)}
  assert np.abs(images[0] - np.rot90(stored, k=-1)).max() <= 8  # JPEG: within rounding.
  np.testing.assert_array_equal(images[1][:8], np.full((8, 8, 3), 255))
  np.testing.assert_array_equal(images[1][8:], np.tile([0, 0, 255], (8, 8, 1)))


@pytest.mark.slow  # Compiles several training programs.
def test_a_short_training_run_learns_the_classes(tmp_path):
  csv_path, _ = _kaggle(str(tmp_path / 'data'), per_class=20, image_size=(14, 18), seed=3)
  config = _config(csv_path, train_split='train[:80%]', eval_split='train[80%:]',
                   preprocess='resize(16)', num_epochs=2, learning_rate=0.05,
                   eval_batch_size=12, log_every_steps=6, checkpoint_every_steps=1000)
  config.model_options.cnn.update(conv1_features=8, conv2_features=16, hidden_features=32)
  metrics = train.train_and_evaluate(run_spec.resolve(config), str(tmp_path / 'workdir'))
  assert metrics['eval/accuracy'] >= 0.8, metrics  # 3 classes: chance is 1/3.
