"""The preprocessing language: parsing, stages, resize methods, scaling and the random ops."""

import jax
import numpy as np
import pytest
import tensorflow as tf

from core import errors
import preprocessing
from preprocessing import augment


def _augment(spec, images, seed):
  return preprocessing.parse(spec).augment(tf.constant(images), tf.constant(seed, tf.int64)).numpy()


def _windows(padded, size):
  """Every size x size window of a padded image (H, W, C)."""
  return [padded[row:row + size, column:column + size]
          for row in range(padded.shape[0] - size + 1)
          for column in range(padded.shape[1] - size + 1)]


def test_augmentation_ops_draw_per_image():
  rng = np.random.default_rng(0)
  images = rng.random((64, 6, 6, 2)).astype(np.float32)
  flipped = _augment('flip_lr', images, [3, 4])
  mirrored = [np.array_equal(out, image[:, ::-1]) for out, image in zip(flipped, images)]
  assert all(mirrored[i] or np.array_equal(flipped[i], images[i]) for i in range(64))
  assert 16 < sum(mirrored) < 48  # About half, drawn per image.
  for spec, pad in (('random_crop(6, pad=2)', 2), ('translate(1)', 1)):
    out = _augment(spec, images, [3, 4])
    assert out.shape == images.shape
    offsets = set()
    for crop, image in zip(out, images):
      windows = _windows(np.pad(image, ((pad, pad), (pad, pad), (0, 0))), 6)
      matches = [index for index, window in enumerate(windows) if np.array_equal(window, crop)]
      assert matches, spec  # Each output is one window of its zero-padded image...
      offsets.add(matches[0])
    assert len(offsets) > 1, spec  # ...at offsets that differ between images.
  assert _augment('random_crop(4)', images, [3, 4]).shape == (64, 4, 4, 2)


def test_rotate_turns_each_image_by_its_own_angle_within_the_limit():
  rng = np.random.default_rng(0)
  images = rng.random((64, 6, 6, 2)).astype(np.float32)
  # A quarter turn is exact on a square grid: counter-clockwise, about the centre.
  quarter = augment.rotate_by(images, tf.fill([64], np.pi / 2)).numpy()
  np.testing.assert_allclose(quarter, np.rot90(images, axes=(1, 2)), atol=1e-5)
  # A single bright pixel at radius 10 from the centre of a 21x21 image: where it lands gives
  # the angle each image was turned by.
  dot = np.zeros((256, 21, 21, 1), np.float32)
  dot[:, 10, 20] = 1  # Right of the centre (10, 10).
  out = _augment('rotate(15)', dot, [1, 2])
  rows, columns = np.unravel_index(out[..., 0].reshape(256, -1).argmax(axis=1), (21, 21))
  angles = np.degrees(np.arctan2(10 - rows, columns - 10))  # Counter-clockwise, rows grow down.
  assert np.all(np.abs(angles) <= 15 + 3)  # Within the limit (plus a pixel's rounding)...
  assert angles.min() < -10 and angles.max() > 10  # ...spread over it, drawn per image.


def test_resize_methods_and_the_model_input_shape():
  image = np.zeros((20, 40, 3), np.uint8)
  image[:, :20] = 200  # Left half bright.
  stretch, crop, pad = (preprocessing.parse(f'resize(10, method="{method}")').resize(
      tf.constant(image)).numpy() for method in ('stretch', 'crop', 'pad'))
  assert stretch.shape == crop.shape == pad.shape == (10, 10, 3)
  # Antialiased: away from the edge between the halves (and the borders), exact values.
  assert (stretch[:, :4] == 200).all() and (stretch[:, 6:] == 0).all()  # Squeezed sideways.
  # The centre 20x20 of 20x40: its left half (columns 10-19 of 40) is bright.
  assert (crop[:, :4] == 200).all() and (crop[:, 6:] == 0).all()
  # The whole image at 5x10 between black borders of 2.5 rows.
  assert (pad[:2] == 0).all() and (pad[-2:] == 0).all() and (pad[4:6, :4] == 200).all()
  parsed = preprocessing.parse('resize(12)|flip_lr|value_range(-1, 1)')
  assert parsed.image_shape((None, None, 3), 'd') == (12, 12, 3)
  with pytest.raises(errors.DataError) as error:  # Varying sizes need a resize op.
    preprocessing.parse('flip_lr').image_shape((None, None, 3), 'photos')
  assert error.value.what == 'photos'


def test_scale_ops_map_the_unit_range():
  images = tf.constant(np.array([[[[0], [255]]]], np.uint8))
  np.testing.assert_allclose(preprocessing.parse('').scale(images).numpy().ravel(), [0, 1])
  np.testing.assert_allclose(
      preprocessing.parse('value_range(-1, 1)').scale(images).numpy().ravel(), [-1, 1])
  np.testing.assert_allclose(
      preprocessing.parse('normalize(0.5, 0.25)').scale(images).numpy().ravel(), [-2, 2])
  with pytest.raises(errors.ConfigError) as error:  # 3 channel values for 1-channel images.
    preprocessing.parse('normalize((0.5, 0.5, 0.5), (1, 1, 1))').image_shape((4, 4, 1), 'd')
  assert error.value.key == 'preprocess'


def test_scale_ops_give_the_same_values_on_jax_arrays_and_by_name():
  pixels = np.arange(0, 256, 5, np.uint8).reshape(1, -1, 1, 1).repeat(3, axis=-1)
  named, numbers = (preprocessing.parse(spec) for spec in (
      "normalize('imagenet')", 'normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))'))
  expected = numbers.scale(tf.constant(pixels)).numpy()
  np.testing.assert_allclose(named.scale(tf.constant(pixels)).numpy(), expected)
  np.testing.assert_allclose(np.asarray(jax.jit(named.scale)(pixels)), expected, atol=1e-6)


@pytest.mark.parametrize('spec', ['shear(10)', 'rotate(0)', 'random_crop(32, pad=-1)',
                                  'random_crop(32, 4, 5)', 'random_crop(32', 'translate(size)',
                                  'flip_lr|resize(32)', 'normalize(0, 1)|value_range(0, 1)',
                                  'resize(8, method="fit")', 'normalize(0, 0)',
                                  "normalize('cifar')", 'normalize(0.5)'])
def test_bad_specs_are_config_errors(spec):
  with pytest.raises(errors.ConfigError) as error:
    preprocessing.parse(spec)
  assert (error.value.key, error.value.value) == ('preprocess', spec)


def test_an_op_registered_in_one_place_joins_the_language():
  # Not helpers/plugins.py's 'invert_for_test': a registry refuses a name taken elsewhere.
  @preprocessing.OPS.register('invert_in_one_place_for_test', stage='random')
  def invert(probability: float = 1.0):
    del probability
    return lambda images, seed: 1.0 - images
  images = np.random.default_rng(0).random((2, 3, 3, 1)).astype(np.float32)
  np.testing.assert_allclose(_augment('flip_lr|invert_in_one_place_for_test(1.0)', images,
                                      [0, 0]),
                             1.0 - _augment('flip_lr', images, [0, 0]), atol=1e-6)
