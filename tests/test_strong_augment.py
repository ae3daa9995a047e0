"""The strong augmentation ops: inception_crop, color_jitter, random_erasing and randaugment."""

import numpy as np
import pytest
import tensorflow as tf

from core import errors
import preprocessing
from preprocessing import strong_augment

SPECS = ('inception_crop(16)', 'inception_crop(16, scale=(0.2, 0.5), ratio=(0.5, 2))',
         'color_jitter(0.4, 0.4, 0.4, 0.1)', 'random_erasing(0.5)',
         "random_erasing(1, value='random')", 'randaugment(2, 9)', 'randaugment(3, 30)')


def _augment(spec, images, seed=(3, 4)):
  return preprocessing.parse(spec).augment(tf.constant(images), tf.constant(seed, tf.int64)).numpy()


def _images(channels, num=32, size=16, seed=0):
  return np.random.default_rng(seed).random((num, size, size, channels)).astype(np.float32)


@pytest.mark.parametrize('channels', [1, 3])
@pytest.mark.parametrize('spec', SPECS)
def test_ops_keep_the_batch_and_draw_per_image_from_the_seed(spec, channels):
  image = _images(channels, num=1)
  copies = np.repeat(image, 32, axis=0)
  out = _augment(spec, copies)
  assert out.shape == copies.shape and out.dtype == np.float32
  assert out.min() >= 0 and out.max() <= 1
  np.testing.assert_array_equal(out, _augment(spec, copies))  # The same seed, the same draws...
  assert not np.array_equal(out, _augment(spec, copies, seed=(3, 5)))  # ...another, others...
  assert len({image.tobytes() for image in out}) > 8  # ...and one for each image.
  mixed = _images(channels)
  np.testing.assert_array_equal(  # Per image: the same with other images beside it.
      _augment(spec, mixed)[:1], _augment(spec, np.concatenate([mixed[:1], copies[1:]]))[:1])


def test_graph_mode_as_the_input_pipeline_runs_it_gives_the_eager_draws():
  parsed = preprocessing.parse('inception_crop(16)|color_jitter(0.4, 0.4, 0.4, 0.1)|'
                               'randaugment(2, 9)|random_erasing(0.5)')
  images, seed = tf.constant(_images(3)), tf.constant([7, 8], tf.int64)

  def augment(batch):
    return parsed.augment(batch, seed)

  graph = next(iter(tf.data.Dataset.from_tensors(images).map(augment))).numpy()
  np.testing.assert_allclose(graph, parsed.augment(images, seed).numpy(), atol=1e-6)


def test_inception_crop_windows_follow_scale_and_ratio():
  images = _images(3, num=4)
  identity = _augment('inception_crop(16, scale=(1, 1), ratio=(1, 1))', images)
  np.testing.assert_allclose(identity, images, atol=1e-5)
  # Pixel values that are their own coordinates, so that each output shows its window: bilinear
  # resizing keeps a ramp a ramp, with a slope of window size / output size.
  size = 32
  ramp = np.linspace(0, size - 1, size, dtype=np.float32) / size
  coordinates = np.stack(np.broadcast_arrays(ramp[:, None], ramp[None, :]), axis=-1)
  images = np.repeat(np.concatenate([coordinates, coordinates[..., :1]], axis=-1)[None], 64, 0)
  out = _augment(f'inception_crop({size}, scale=(0.25, 0.5), ratio=(0.5, 2))', images) * size
  heights = np.median(np.diff(out[:, 2:-2, size // 2, 0], axis=1), axis=1) * size
  widths = np.median(np.diff(out[:, size // 2, 2:-2, 1], axis=1), axis=1) * size
  tops = out[:, 2, size // 2, 0] - (2.5 * heights / size - 0.5)  # Samples at half-pixel centres.
  assert np.all((0.25 * 0.85 < heights * widths / size**2) & (heights * widths / size**2 < 0.58))
  assert np.all((0.5 * 0.85 < widths / heights) & (widths / heights < 2 * 1.15))
  assert np.all((tops > -0.01) & (tops + heights < size + 0.01))
  assert np.ptp(heights * widths) > 0.1 * size**2 and np.ptp(tops) > 4  # Drawn per image.


def test_inception_crop_resizes_each_window_as_tf_image_resize():
  images = _images(3, num=3, size=20)
  tops, lefts, heights, widths = [0, 3, 5], [0, 2, 10], [20, 7, 15], [20, 9, 10]
  out = strong_augment._resized_crops(tf.constant(images), *map(tf.constant, (
      tops, lefts, heights, widths)), 20).numpy()
  for index, (top, left, height, width) in enumerate(zip(tops, lefts, heights, widths)):
    expected = tf.image.resize(images[index, top:top + height, left:left + width], (20, 20))
    # All but the outermost samples, which blend in the pixels beside the window instead of
    # repeating the window's edge (the whole image: no difference).
    inner = slice(None) if height == 20 else slice(2, -2)
    np.testing.assert_allclose(out[index, inner, inner], expected.numpy()[inner, inner],
                               atol=1e-5)


@pytest.mark.parametrize('value', [0.5, 'random'])
def test_random_erasing_fills_one_rectangle_within_scale_and_ratio(value):
  images = _images(3, num=64, size=32)
  images[images == 0.5] = 0.25
  np.testing.assert_array_equal(_augment(f'random_erasing(0, value={value!r})', images), images)
  out = _augment(f'random_erasing(1, value={value!r})', images)
  areas, aspects, tops = [], [], []
  for erased_image, image in zip(out, images):
    erased = np.any(erased_image != image, axis=-1)
    rows, columns = np.flatnonzero(erased.any(axis=1)), np.flatnonzero(erased.any(axis=0))
    assert rows.size and columns.size  # Every image has its rectangle...
    box = (slice(rows[0], rows[-1] + 1), slice(columns[0], columns[-1] + 1))
    if value == 0.5:  # ...filled with `value` (or noise),
      assert np.all(erased_image[box] == 0.5)
    assert erased[box].mean() > (0.99 if value == 0.5 else 0.9)  # ...and nothing else.
    areas.append(rows.size * columns.size / 32**2)
    aspects.append(rows.size / columns.size)
    tops.append(rows[0])
  # torchvision's draws rounded to whole pixels: area fractions in (0.02, 1/3), heights /
  # widths in (0.3, 3.3), up to that rounding.
  assert 0.02 * 0.75 < min(areas) and max(areas) < 1 / 3 * 1.15
  assert 0.3 * 0.7 < min(aspects) and max(aspects) < 3.3 * 1.3
  assert np.ptp(areas) > 0.1 and len(set(tops)) > 5
  partly = _augment('random_erasing(0.25)', images)
  assert 8 < np.sum(np.any(partly != images, axis=(1, 2, 3))) < 28  # About 1 image in 4.


@pytest.mark.parametrize('channels', [1, 3])
def test_color_jitter(channels):
  images = _images(channels)
  np.testing.assert_array_equal(_augment('color_jitter(0, 0, 0, 0)', images), images)
  if channels == 1:  # Saturation and hue leave grayscale images alone.
    np.testing.assert_array_equal(_augment('color_jitter(0, 0, 0.8, 0.5)', images), images)
  else:  # A hue turn keeps grays gray and keeps each pixel's value (its largest channel).
    grays = np.repeat(images[..., :1], 3, axis=-1)
    np.testing.assert_allclose(_augment('color_jitter(0, 0, 0, 0.5)', grays), grays, atol=1e-6)
    turned = _augment('color_jitter(0, 0, 0, 0.5)', images)
    np.testing.assert_allclose(turned.max(axis=-1), images.max(axis=-1), atol=1e-5)
    assert not np.allclose(turned, images, atol=0.05)
  # Brightness: each image multiplied by its own factor in [0.6, 1.4].
  brighter = _augment('color_jitter(0.4, 0, 0, 0)', images)
  unclipped = (images > 0.05) & (brighter < 0.999)
  factors = [np.median(out[keep] / image[keep])
             for out, image, keep in zip(brighter, images, unclipped)]
  np.testing.assert_allclose(
      brighter, np.clip(images * np.reshape(factors, (-1, 1, 1, 1)), 0, 1), atol=1e-5)
  assert 0.6 <= min(factors) and max(factors) <= 1.4 and np.ptp(factors) > 0.3
  # Contrast: each image's mean luminance kept (away from clipping), its spread scaled by its
  # factor.
  def mean_luminance(images):
    weights = [0.2989, 0.587, 0.114] if channels == 3 else [1.0]
    return (images @ np.float32(weights)).mean(axis=(1, 2))

  contrasted = _augment('color_jitter(0, 0.4, 0, 0)', images * 0.2 + 0.4)
  np.testing.assert_allclose(mean_luminance(contrasted), mean_luminance(images * 0.2 + 0.4),
                             atol=1e-4)  # The weights add up to 0.9999.
  spreads = contrasted.std(axis=(1, 2, 3)) / (images * 0.2).std(axis=(1, 2, 3))
  assert 0.6 - 1e-4 <= spreads.min() and spreads.max() <= 1.4 + 1e-4 and np.ptp(spreads) > 0.3


def _dots(channels, num=64, size=17):
  """Black images with one bright pixel: what autocontrast and equalize leave alone."""
  dots = np.zeros((num, size, size, channels), np.float32)
  dots[:, 4, 11] = (1, 0, 1)[:channels]
  return dots


@pytest.mark.parametrize('channels', [1, 3])
def test_randaugment_magnitude_zero_moves_nothing(channels):
  dots = _dots(channels)
  np.testing.assert_allclose(_augment('randaugment(3, 0)', dots), dots, atol=1e-6)
  # On any image, every op at m=0 maps each channel's levels monotonically (identity,
  # autocontrast, equalize, posterize to 8 bits): no pixel moves.
  images = _images(channels)
  out = _augment('randaugment(2, 0)', images)
  for image, augmented in zip(images, out):
    for channel in range(channels):
      order = np.argsort(image[..., channel], axis=None)
      assert np.all(np.diff(augmented[..., channel].ravel()[order]) >= -1e-6)
  # At m=9 the dot moves in the images that drew a geometric op (5 ops of 14), and solarize
  # (1 more) blackens it: about 27 images of 64.
  moved = _augment('randaugment(1, 9)', dots)[..., 0].reshape(64, -1).argmax(axis=1)
  assert 10 < np.sum(moved != 4 * 17 + 11) < 40


@pytest.mark.parametrize('channels', [1, 3])
def test_each_randaugment_op(channels):
  ops = strong_augment._randaugment_ops(0)
  assert list(ops) == ['identity', 'autocontrast', 'equalize', 'rotate', 'solarize', 'color',
                       'posterize', 'contrast', 'brightness', 'sharpness', 'shear_x',
                       'shear_y', 'translate_x', 'translate_y']  # The paper's.
  images = tf.constant(_images(channels, num=8))
  signs = tf.constant([1.0, -1.0] * 4)
  for name, op in ops.items():  # At magnitude 0, the identity but for the ops without one.
    if name not in ('autocontrast', 'equalize'):
      np.testing.assert_allclose(op(images, signs), images, atol=0.5 / 255 + 1e-6, err_msg=name)
  for name, op in strong_augment._randaugment_ops(10).items():
    out = op(images, signs).numpy()
    assert out.shape == images.shape and out.min() >= 0 and out.max() <= 1, name
    unchanged = name == 'identity' or (name == 'color' and channels == 1)
    assert np.allclose(out, images, atol=1e-3) == unchanged, name


def test_randaugment_level_ops_match_pil():
  image_module = pytest.importorskip('PIL.Image')
  from PIL import ImageEnhance, ImageOps  # pylint: disable=g-import-not-at-top
  levels = np.random.default_rng(1).integers(0, 256, (6, 12, 10, 3)).astype(np.uint8)
  levels[1] = levels[1] // 4 + 100  # A narrow histogram.
  levels[2] = 7  # A flat one.
  levels[3, ..., 0] %= 3  # Few levels.
  images = tf.constant(levels / np.float32(255))
  signs = tf.constant([-1.0, 1.0] * 3)
  ops = strong_augment._randaugment_ops(5)  # Solarize above 128; factors 0.55 and 1.45.
  posterize = strong_augment._randaugment_ops(10)['posterize']  # To 4 bits.
  for index, image in enumerate(map(image_module.fromarray, levels)):
    def ours(op, index=index):
      return np.round(op(images, signs).numpy()[index] * 255)
    factor = 1 + 0.45 * signs.numpy()[index]
    expected = {'equalize': (ImageOps.equalize(image), 0),
                'autocontrast': (ImageOps.autocontrast(image), 1),  # PIL truncates.
                'solarize': (ImageOps.solarize(image, 128), 0),
                'color': (ImageEnhance.Color(image).enhance(factor), 2),  # PIL's integer gray.
                'contrast': (ImageEnhance.Contrast(image).enhance(factor), 2),
                'brightness': (ImageEnhance.Brightness(image).enhance(factor), 1),
                'sharpness': (ImageEnhance.Sharpness(image).enhance(factor), 2)}
    for name, (pil, tolerance) in expected.items():
      np.testing.assert_allclose(ours(ops[name]), np.asarray(pil), atol=tolerance, err_msg=name)
    np.testing.assert_array_equal(ours(posterize), np.asarray(ImageOps.posterize(image, 4)))


@pytest.mark.parametrize('spec', [
    'inception_crop(0)', 'inception_crop(32, scale=(0.5, 0.2))', 'inception_crop(32, (0, 1))',
    'inception_crop(32, ratio=1)', 'inception_crop(32, ratio=(1, 2, 3))', 'color_jitter(-0.1)',
    'color_jitter(hue=0.6)', 'color_jitter(contrast="high")', 'random_erasing(1.5)',
    'random_erasing(scale=(0.1, 1.5))', 'random_erasing(ratio=(0, 1))',
    'random_erasing(value="noise")', 'random_erasing(value=2)', 'randaugment(0)',
    'randaugment(2.5)', 'randaugment(2, 31)', 'randaugment(m=True)', 'randaugment(2, 9, 1)'])
def test_bad_arguments_are_config_errors(spec):
  with pytest.raises(errors.ConfigError) as error:
    preprocessing.parse(spec)
  assert (error.value.key, error.value.value) == ('preprocess', spec)


def test_the_model_input_shape():
  spec = 'resize(32)|inception_crop(32)|randaugment(2, 9)|random_erasing(0.25)'
  assert preprocessing.parse(spec).image_shape((None, None, 3), 'x') == (32, 32, 3)
  assert preprocessing.parse(spec).image_shape((None, None, 1), 'x') == (32, 32, 1)
  with pytest.raises(errors.ConfigError) as error:  # The crop must give the model's input size.
    preprocessing.parse('resize(32)|inception_crop(24)').image_shape((None, None, 3), 'x')
  assert error.value.key == 'preprocess' and 'size must be the image size' in str(error.value)
