"""Training-batch augmentation from a spec string such as `'random_crop(32, pad=4)|flip_lr'`.

A spec is ops separated by '|', each a name with optional Python-literal arguments, in the style
of big_vision's preprocessing strings; '' means no augmentation. The ops run in order on float32
training batches (batch, height, width, channels), drawing independently for every image:

  flip_lr                   mirror left-right, with probability 1/2;
  random_crop(size, pad=0)  pad every side with `pad` black pixels, then take a random
                            size x size window (size must be the image size: the model's input);
  translate(pixels)         shift by up to `pixels` rows and columns each way, filling with black
                            (random_crop at the image's own size);
  rotate(degrees)           rotate about the centre by an angle drawn uniformly from
                            [-degrees, degrees], bilinear, filling with black.

Draws come from TensorFlow's stateless random ops, seeded per batch by `input_pipeline` from
(config.seed, epoch, batch number): the same seed gives the same batches, and a resumed run
continues with the draws of the uninterrupted one. Eval and predict images are never augmented.
"""

import ast
from collections.abc import Callable
import functools
import math

import tensorflow as tf

Op = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]  # (images, seed of shape [2]) -> images


def _crop(images: tf.Tensor, seed: tf.Tensor, *, size: tuple[int, int] | None,
          pad: int) -> tf.Tensor:
  """A random `size` window (default: the images' own) of each image padded by `pad` zeros."""
  height, width = images.shape[1:3]
  out_height, out_width = size or (height, width)
  padded = tf.pad(images, [[0, 0], [pad, pad], [pad, pad], [0, 0]])
  num = tf.shape(images)[0]
  rows = tf.random.stateless_uniform((num, 1), seed, 0, height + 2 * pad - out_height + 1,
                                     dtype=tf.int32) + tf.range(out_height)
  columns = tf.random.stateless_uniform((num, 1), tf.random.experimental.stateless_fold_in(
      seed, 1), 0, width + 2 * pad - out_width + 1, dtype=tf.int32) + tf.range(out_width)
  # Per-image windows as two gathers (rows, then columns): one vectorised op each.
  return tf.gather(tf.gather(padded, rows, axis=1, batch_dims=1), columns, axis=2, batch_dims=1)


def _check_int(name: str, value, minimum: int) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ValueError(f'{name}={value!r} must be an integer >= {minimum}')


def flip_lr() -> Op:
  return tf.image.stateless_random_flip_left_right


def random_crop(size: int, pad: int = 0) -> Op:
  _check_int('size', size, 1)
  _check_int('pad', pad, 0)
  return functools.partial(_crop, size=(size, size), pad=pad)


def translate(pixels: int) -> Op:
  _check_int('pixels', pixels, 1)
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


def rotate(degrees: float) -> Op:
  if isinstance(degrees, bool) or not isinstance(degrees, (int, float)) or not 0 < degrees <= 180:
    raise ValueError(f'degrees={degrees!r} must be a number in (0, 180]')
  limit = degrees * math.pi / 180
  return lambda images, seed: rotate_by(images, tf.random.stateless_uniform(
      tf.shape(images)[:1], seed, -limit, limit))


OPS: dict[str, Callable[..., Op]] = {'flip_lr': flip_lr, 'random_crop': random_crop,
                                     'translate': translate, 'rotate': rotate}
_USAGE = 'flip_lr, random_crop(size, pad=0), translate(pixels), rotate(degrees)'


def parse(spec: str) -> list[Op]:
  """The ops of `spec`; raises ValueError naming the op at fault and the valid ones."""
  ops = []
  for text in filter(None, (part.strip() for part in spec.split('|'))):
    try:
      node = ast.parse(text, mode='eval').body
      if isinstance(node, ast.Name):
        name, args, kwargs = node.id, [], {}
      elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name = node.func.id
        args = [ast.literal_eval(arg) for arg in node.args]
        kwargs = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
      else:
        raise SyntaxError
    except (SyntaxError, ValueError) as error:
      raise ValueError(f'{text!r} is not an op with literal arguments, such as flip_lr or '
                       f'random_crop(32, pad=4) (ops: {_USAGE})') from error
    if name not in OPS:
      raise ValueError(f'unknown op {name!r} (ops: {_USAGE})')
    try:
      ops.append(OPS[name](*args, **kwargs))
    except (TypeError, ValueError) as error:
      raise ValueError(f'bad arguments for {text!r}: {error} (ops: {_USAGE})') from error
  return ops


def apply(ops: list[Op], images: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
  """`images` (batch, height, width, channels) through `ops`, each op with its own seed."""
  for op, op_seed in zip(ops, tf.unstack(tf.random.experimental.stateless_split(seed, len(ops)))):
    images = op(images, op_seed)
  return images


def check(spec: str, image_shape: tuple[int, int, int]) -> None:
  """Raises ValueError unless `spec`'s ops keep images of `image_shape` at that shape."""
  out_shape = tuple(apply(parse(spec), tf.zeros((1, *image_shape)), tf.constant([0, 0])).shape[1:])
  if out_shape != tuple(image_shape):
    raise ValueError(f'it turns {image_shape[0]}x{image_shape[1]} images into '
                     f'{out_shape[0]}x{out_shape[1]} ones, but the model takes the image size: '
                     f'crop to {image_shape[0]} (or set config.image_size)')
