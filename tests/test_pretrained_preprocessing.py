"""The preprocessing of pretrained models: resize_small, central_crop, random_resized_crop from
the decoded image (seeded per image, resumed bit-exactly), and the default a run with a
backbone's pretrained weights gets (timm's eval transform, within a measured tolerance)."""

import numpy as np
from PIL import Image
from PIL import ImageOps
import pytest
import tensorflow as tf

from configs import default
from core import errors
from data_sources import image_files
import image_folders
import input_pipeline
import models
import preprocessing
from preprocessing import crop
from training import run_spec
from tests.helpers.optional import requires_extras


def _photo(height: int, width: int, seed: int = 0) -> np.ndarray:
  """A uint8 colour image with smooth structure and noise, as photos have both."""
  rows, columns = np.mgrid[0:height, 0:width]
  smooth = np.stack([128 + 100 * np.sin(columns / 23 + channel) * np.cos(rows / 17 - channel)
                     for channel in range(3)], axis=-1)
  noise = np.random.default_rng(seed).normal(0, 25, smooth.shape)
  return np.clip(smooth + noise, 0, 255).astype(np.uint8)


def _windows(spec: str, image_size, epoch_seed: int, indices) -> np.ndarray:
  crops = preprocessing.parse(spec).crops(epoch_seed)
  return np.stack([crops.window(tf.constant(image_size), index).numpy() for index in indices])


def test_random_resized_crop_is_seeded_per_image():
  spec = 'random_resized_crop(32)'
  first = _windows(spec, (300, 200), 7, range(40))
  np.testing.assert_array_equal(first, _windows(spec, (300, 200), 7, range(40)))
  assert len({tuple(window) for window in first}) == 40  # Every image its own window...
  other_epoch = _windows(spec, (300, 200), 8, range(40))
  assert not np.any(np.all(first == other_epoch, axis=1))  # ...and every epoch.


def test_random_resized_crop_windows_keep_to_scale_and_ratio():
  height, width = 300, 200
  tops, lefts, heights, widths = _windows(
      'random_resized_crop(32, scale=(0.25, 0.8), ratio=(0.5, 1.5))', (height, width), 0,
      range(400)).T
  assert np.all((tops >= 0) & (lefts >= 0) & (tops + heights <= height)
                & (lefts + widths <= width))
  areas = heights * widths / (height * width)
  ratios = widths / heights
  # Sides are rounded to whole pixels (>= 77 here): at most 1.5% off the drawn area and ratio.
  assert np.all((areas >= 0.25 * 0.985) & (areas <= 0.8 * 1.015))
  assert np.all((ratios >= 0.5 * 0.985) & (ratios <= 1.5 * 1.015))
  assert areas.min() < 0.3 and areas.max() > 0.75  # Spread over the range.
  assert ratios.min() < 0.6 and ratios.max() > 1.3


def test_random_resized_crop_cuts_the_original_pixels():
  """On a horizontal ramp (pixel = column), each crop's columns run from its window's left to
  its right edge: the window is cut from the image as given, then resized once."""
  ramp = np.broadcast_to(np.arange(240, dtype=np.uint8)[None, :, None], (100, 240, 1))
  preprocess = preprocessing.parse('random_resized_crop(16)')
  crops = preprocess.crops(3)
  for index in range(10):
    _, left, _, width = crops.window(tf.constant((100, 240)), index).numpy()
    cut = crops(tf.constant(ramp), index).numpy()
    assert cut.shape == (16, 16, 1)
    centres = left + (np.arange(16) + 0.5) * width / 16 - 0.5  # Where each column samples.
    # Inner columns (the outer ones blend with the window's edge) within rounding.
    np.testing.assert_allclose(cut[8, 2:-2, 0], centres[2:-2], atol=1.0)


def test_crop_windows_are_box_averaged_where_they_shrink():
  """The training crop's resize: enlarging, exactly tf.image.resize's bilinear pixels; where a
  window shrinks, averaged (close to the antialiased kernel, far from plain resampling, which
  aliases noise); one side shrinking and the other enlarging works too."""
  from preprocessing import resize  # pylint: disable=g-import-not-at-top
  image = _photo(96, 120)
  small = tf.constant(image[:20, :28])
  enlarged = resize.resize_window(small, 32).numpy()
  plain = tf.cast(tf.round(tf.image.resize(small, (32, 32))), tf.uint8).numpy()
  np.testing.assert_array_equal(enlarged, plain)
  shrunk = resize.resize_window(tf.constant(image), 32).numpy().astype(float)
  antialiased = tf.image.resize(image, (32, 32), antialias=True).numpy()
  aliased = tf.image.resize(image, (32, 32)).numpy()
  # The noise (sigma 25 levels) averages out over the 3-4 pixels each output pixel covers.
  assert np.abs(shrunk - antialiased).mean() < 0.4 * np.abs(aliased - antialiased).mean()
  mixed = resize.resize_window(tf.constant(image[:, :24]), 32)
  assert mixed.shape == (32, 32, 3) and mixed.dtype == tf.uint8


def test_resize_small_and_central_crop_against_pil_and_numpy():
  image = _photo(90, 131)
  small = preprocessing.parse("resize_small(40, interpolation='bicubic')").resize(
      tf.constant(image)).numpy()
  # torchvision's Resize(40): the shorter side 40, the longer int(40 * 131 / 90) = 58.
  assert small.shape == (40, 58, 3)
  reference = np.asarray(Image.fromarray(image).resize((58, 40), Image.BICUBIC))
  difference = np.abs(small.astype(int) - reference)
  assert difference.mean() < 1.0 and difference.max() <= 16  # PIL's and TF's cubic kernels.
  cut = preprocessing.parse('central_crop(20)').resize(tf.constant(image)).numpy()
  # torchvision's CenterCrop: offsets round((90 - 20) / 2) = 35 and round(111 / 2) = 56.
  np.testing.assert_array_equal(cut, image[35:55, 56:76])
  padded = preprocessing.parse('central_crop(96)').resize(tf.constant(image[:, :95])).numpy()
  assert padded.shape == (96, 96, 3)  # Smaller: black borders (3 rows, 0 + 1 columns).
  np.testing.assert_array_equal(padded[3:93, :95], image[:, :95])
  assert not padded[:3].any() and not padded[93:].any() and not padded[:, 95:].any()
  batch = preprocessing.parse('resize_small(40)|central_crop(32)').resize(
      tf.constant(np.stack([image, image])))
  assert batch.shape == (2, 32, 32, 3)  # Batches too, as export resizes them.


@pytest.mark.parametrize('spec, key', [
    ('resize_small(0)', 'size'), ('central_crop(2.5)', 'size'),
    ("resize_small(8, interpolation='area')", 'interpolation'),
    ('random_resized_crop(8, scale=(0.5, 0.1))', 'scale'),
    ('random_resized_crop(8, ratio=(0, 1))', 'ratio'),
    ('random_resized_crop(8, crop_pct=1.5)', 'crop_pct'),
    ('flip_lr|random_resized_crop(8)', 'too late'),
    ('random_resized_crop(8)|random_resized_crop(8)', 'too late')])
def test_bad_crop_arguments_are_config_errors(spec, key):
  with pytest.raises(errors.ConfigError) as raised:
    preprocessing.parse(spec)
  assert raised.value.key == 'preprocess' and raised.value.value == spec
  assert key in str(raised.value) and '\n' not in str(raised.value)


def test_eval_stands_in_a_centre_crop_for_the_random_one():
  preprocess = preprocessing.parse('random_resized_crop(32, crop_pct=0.8)|flip_lr')
  image = _photo(70, 50)
  expected = preprocessing.parse('resize_small(40)|central_crop(32)').resize(tf.constant(image))
  np.testing.assert_array_equal(preprocess.resize(tf.constant(image)), expected)
  assert preprocess.image_shape((None, None, 3), 'photos') == (32, 32, 3)


@pytest.mark.parametrize('name', ['resnet18', 'vit_tiny_patch16_224'])
def test_pretrained_eval_preprocessing_is_timms(name):
  """Our eval preprocessing of a backbone's pretrained_cfg against timm's own eval transform
  on the same PIL image. Both resize bicubically with antialiasing, PIL's and TF's kernels
  differing by rounding: on a noisy photo 0.2 levels (of 255) on average, at most 7 measured;
  asserted below 0.5 and 12. A crop one pixel off is far outside (checked)."""
  requires_extras('timm')
  from timm import data as timm_data  # pylint: disable=g-import-not-at-top
  import timm  # pylint: disable=g-import-not-at-top
  image = _photo(300, 410)
  model = timm.create_model(name, pretrained=False)
  config = timm_data.resolve_data_config({}, model=model)
  expected = timm_data.create_transform(**config)(Image.fromarray(image)).permute(1, 2, 0).numpy()
  preprocess = preprocessing.parse(crop.pretrained_spec(
      models.MODELS.capability(name, 'pretrained')))
  ours = preprocess.scale(preprocess.resize(tf.constant(image))[None])[0].numpy()
  levels = np.abs(ours - expected) * np.asarray(config['std']) * 255
  assert levels.mean() < 0.5 and levels.max() < 12
  shifted = np.abs(ours[:, 1:] - expected[:, :-1]) * np.asarray(config['std']) * 255
  assert shifted.mean() > 5


def _config(root, **overrides):
  config = default.get_config()
  config.update(dict(data_source='folder', dataset=root, train_split='train', eval_split='test',
                     batch_size=4, num_epochs=2, shuffle_buffer_size=8))
  config.update(overrides)
  return config


def test_pretrained_weights_without_preprocess_get_the_models_own(tmp_path):
  weights_file = tmp_path / 'resnet18.safetensors'
  weights_file.write_bytes(b'')  # Only its name is read when the run is resolved.
  config = _config(str(tmp_path), model='resnet18', init_from=str(weights_file))
  run = run_spec.resolve(config)
  expected = "random_resized_crop(224, crop_pct=0.95, interpolation='bicubic')|flip_lr|" \
             "normalize('imagenet')"
  assert run.input.preprocess.spec == expected
  assert {evaluation.preprocess.spec for evaluation in run.evaluations} == {expected}
  config.preprocess = 'resize(64)'  # Given: kept.
  assert run_spec.resolve(config).input.preprocess.spec == 'resize(64)'
  config.update(dict(preprocess='', model='cnn'))  # No pretrained_cfg: as given.
  assert run_spec.resolve(config).input.preprocess.spec == ''


@pytest.fixture(name='photo_folder', scope='module')
def fixture_photo_folder(tmp_path_factory) -> str:
  """3 classes of 6 training images (PNG, JPEG, BMP, GIF) of 20-40 px, and 3 test images."""
  root = str(tmp_path_factory.mktemp('photos'))
  image_folders.make_shapes_folder(root, {'train': 6, 'test': 1}, image_sizes=(20, 40),
                                   corrupt=False)
  return root


@pytest.mark.parametrize('spec, in_memory, held', [
    ('random_resized_crop(16)|flip_lr', 'always', input_pipeline.Streamed),
    ('resize(24)|random_resized_crop(16)', 'always', np.ndarray),
    ('resize(24)|random_resized_crop(16)', 'never', input_pipeline.Streamed)])
def test_random_resized_crop_resumes_bit_exactly(photo_folder, spec, in_memory, held):
  """Training batches resumed at epoch 1, step 2 are those of the uninterrupted run; the eval
  view of the training split is the deterministic centre crop. Images of varying sizes stream
  even in_memory='always' (no array holds them before their crop)."""
  config = _config(photo_folder, preprocess=spec, in_memory=in_memory)
  run = run_spec.resolve(config)
  data = input_pipeline.open_data(run.input, run.eval_splits())
  split = input_pipeline.open_split(data, 'train', run.input)
  assert isinstance(split if held is input_pipeline.Streamed else split.images, held)
  whole = list(input_pipeline.train_batches(split, data, run.input, 4))
  resumed = list(input_pipeline.train_batches(split, data, run.input, 4, 1, 2))
  assert len(whole) == 8 and len(resumed) == 2
  for expected, batch in zip(whole[6:], resumed):
    np.testing.assert_array_equal(batch['image'], expected['image'])
    np.testing.assert_array_equal(batch['label'], expected['label'])
  assert whole[0]['image'].shape == (4, 16, 16, 3)
  plain = list(input_pipeline.train_batches(split, data, run.input, 4, augment=False))
  again = list(input_pipeline.train_batches(split, data, run.input, 4, augment=False))
  np.testing.assert_array_equal(plain[0]['image'], again[0]['image'])


@pytest.mark.parametrize('orientation', range(1, 9))
def test_jpeg_window_is_decoded_alone_as_the_whole_image_gives_it(tmp_path, orientation):
  """decode_and_crop_jpeg of the window turned to the stored pixels by the EXIF orientation,
  against decoding whole (as PIL's exif_transpose shows it) and cutting: equal but for the
  window's edge (libjpeg upsamples the chroma at a window's right edge as at an image's)."""
  path = str(tmp_path / 'photo.jpg')
  exif = Image.Exif()
  exif[0x0112] = orientation
  Image.fromarray(_photo(120, 90)).save(path, quality=90, exif=exif)
  header = image_files.read_header(path)
  whole = image_files.decode(tf.constant(path), 3, header.orientation).numpy()
  with Image.open(path) as image:
    shown = np.asarray(ImageOps.exif_transpose(image))
  assert whole.shape == shown.shape == (*header.size, 3)
  # PIL decodes with other rounding (1 level on average here); a wrong turn is tens off.
  assert np.abs(whole.astype(int) - shown).mean() < 3
  height, width = header.size
  for window in ((0, 0, height, width), (13, 7, 41, 53), (height - 50, width - 40, 50, 40)):
    top, left, rows, columns = window
    cut = image_files.decode_window(tf.constant(path), 3, tf.constant(window),
                                      header.orientation).numpy()
    assert cut.shape == (rows, columns, 3)
    np.testing.assert_array_equal(cut[1:-1, 1:-1],
                                  whole[top + 1:top + rows - 1, left + 1:left + columns - 1])
