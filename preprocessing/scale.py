"""Stage 3 ops: the pixel values the model takes, from float32 images in [0, 1]."""

from collections.abc import Sequence

import tensorflow as tf

import preprocessing


@preprocessing.OPS.register('value_range', stage='scale')
def value_range(low: float, high: float) -> preprocessing.ScaleOp:
  """Pixels mapped linearly from [0, 1] to [low, high], e.g. value_range(-1, 1)."""
  low, = preprocessing.check_numbers('low', low)
  high, = preprocessing.check_numbers('high', high)
  if not low < high:
    raise ValueError(f'low={low} must be below high={high}')
  return lambda images: images * (high - low) + low


@preprocessing.OPS.register('normalize', stage='scale')
def normalize(mean: float | Sequence[float], std: float | Sequence[float]) -> preprocessing.ScaleOp:
  """(pixel - mean) / std per channel, on pixels in [0, 1] (torchvision's Normalize), e.g.
  normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)) for ImageNet statistics."""
  mean, std = preprocessing.check_numbers('mean', mean), preprocessing.check_numbers('std', std)
  if any(value <= 0 for value in std):
    raise ValueError(f'std={std} must be positive')
  mean_tensor, std_tensor = tf.constant(mean, tf.float32), tf.constant(std, tf.float32)
  return lambda images: (images - mean_tensor) / std_tensor
