"""Stage 3 ops: random augmentation of training batches (batch, height, width, channels).

Each op draws independently for every image of the batch, from TensorFlow's stateless random ops
and the seed it is given (see the package docstring):

  flip_lr                   mirror left-right, with probability 1/2;
  random_crop(size, pad=0)  pad every side with `pad` black pixels, then take a random
                            size x size window (size must be the image size: the model's input);
  translate(pixels)         shift by up to `pixels` rows and columns each way, filling with black
                            (random_crop at the image's own size);
  rotate(degrees)           rotate about the centre by an angle drawn uniformly from
                            [-degrees, degrees], bilinear, filling with black.

All but `rotate` only move pixels (`uint8=True`): they run on uint8 batches, which then travel
to the devices as uint8; `rotate` interpolates, on float32 batches in [0, 1].
"""

import functools
import math

import tensorflow as tf

import preprocessing


def _crop(images: tf.Tensor, seed: tf.Tensor, *, size: tuple[int, int] | None,
          pad: int) -> tf.Tensor:
  """A random `size` window (default: the images' own) of each image padded by `pad` zeros."""
  height, width = images.shape[1:3]
  out_height, out_width = size or (height, width)
  if out_height > height + 2 * pad or out_width > width + 2 * pad:
    raise ValueError(f'a {out_height}x{out_width} crop is larger than the images padded by {pad}')
  padded = tf.pad(images, [[0, 0], [pad, pad], [pad, pad], [0, 0]])
  num = tf.shape(images)[0]
  rows = tf.random.stateless_uniform((num, 1), seed, 0, height + 2 * pad - out_height + 1,
                                     dtype=tf.int32) + tf.range(out_height)
  columns = tf.random.stateless_uniform((num, 1), tf.random.experimental.stateless_fold_in(
      seed, 1), 0, width + 2 * pad - out_width + 1, dtype=tf.int32) + tf.range(out_width)
  # Per-image windows as two gathers (rows, then columns): one vectorised op each.
  return tf.gather(tf.gather(padded, rows, axis=1, batch_dims=1), columns, axis=2, batch_dims=1)


@preprocessing.OPS.register('flip_lr', stage='random', uint8=True)
def flip_lr() -> preprocessing.RandomOp:
  return tf.image.stateless_random_flip_left_right


@preprocessing.OPS.register('random_crop', stage='random', uint8=True)
def random_crop(size: int, pad: int = 0) -> preprocessing.RandomOp:
  preprocessing.check_int('size', size, 1)
  preprocessing.check_int('pad', pad, 0)
  return functools.partial(_crop, size=(size, size), pad=pad)


@preprocessing.OPS.register('translate', stage='random', uint8=True)
def translate(pixels: int) -> preprocessing.RandomOp:
  preprocessing.check_int('pixels', pixels, 1)
  return functools.partial(_crop, size=None, pad=pixels)


def rotate_by(images: tf.Tensor, angles: tf.Tensor) -> tf.Tensor:
  """Each image rotated counter-clockwise by its angle (radians) about its centre.

  TensorFlow's projective-transform op (the one Keras's RandomRotation runs), given for each
  image the map from output to input pixel coordinates: a rotation about the centre.
  """
  height, width = images.shape[1:3]
  cos, sin = tf.cos(angles), tf.sin(angles)
  x_offset = ((width - 1) - (cos * (width - 1) - sin * (height - 1))) / 2
  y_offset = ((height - 1) - (sin * (width - 1) + cos * (height - 1))) / 2
  zeros = tf.zeros_like(angles)
  transforms = tf.stack([cos, -sin, x_offset, sin, cos, y_offset, zeros, zeros], axis=1)
  return tf.raw_ops.ImageProjectiveTransformV3(
      images=images, transforms=transforms, output_shape=tf.constant([height, width]),
      fill_value=0.0, interpolation='BILINEAR', fill_mode='CONSTANT')


@preprocessing.OPS.register('rotate', stage='random')
def rotate(degrees: float) -> preprocessing.RandomOp:
  limit = preprocessing.check_number('degrees', degrees, 0, 180, low_open=True) * math.pi / 180
  return lambda images, seed: rotate_by(images, tf.random.stateless_uniform(
      tf.shape(images)[:1], seed, -limit, limit))
