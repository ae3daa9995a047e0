"""Stage 4 ops: the pixel values the model takes, from float32 images in [0, 1].

Each op is arithmetic with NumPy constants, so it runs on JAX arrays (inside the compiled train
and eval steps, which take uint8 batches, and a model exported through JAX) and on TensorFlow
tensors alike.
"""

from collections.abc import Sequence

import numpy as np

import preprocessing

# Named per-channel statistics for `normalize`: those timm's pretrained_cfg gives its models.
STATISTICS = {
    'imagenet': ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    'inception': ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}


@preprocessing.OPS.register('value_range', stage='scale')
def value_range(low: float, high: float) -> preprocessing.ScaleOp:
  """Pixels mapped linearly from [0, 1] to [low, high], e.g. value_range(-1, 1)."""
  low, = preprocessing.check_numbers('low', low)
  high, = preprocessing.check_numbers('high', high)
  if not low < high:
    raise ValueError(f'low={low} must be below high={high}')
  return lambda images: images * (high - low) + low


@preprocessing.OPS.register('normalize', stage='scale')
def normalize(mean: str | float | Sequence[float],
              std: float | Sequence[float] | None = None) -> preprocessing.ScaleOp:
  """(pixel - mean) / std per channel, on pixels in [0, 1] (torchvision's Normalize), e.g.
  normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), or by name: normalize('imagenet')
  (those values) or normalize('inception') (0.5 and 0.5)."""
  if isinstance(mean, str):
    if mean not in STATISTICS or std is not None:
      raise ValueError(f'mean={mean!r} must be one of {sorted(STATISTICS)} (without std), or '
                       'numbers with std')
    mean, std = STATISTICS[mean]
  elif std is None:
    raise ValueError(f'mean={mean!r} needs std, or name statistics: {sorted(STATISTICS)}')
  mean, std = preprocessing.check_numbers('mean', mean), preprocessing.check_numbers('std', std)
  if any(value <= 0 for value in std):
    raise ValueError(f'std={std} must be positive')
  mean_array, std_array = np.asarray(mean, np.float32), np.asarray(std, np.float32)
  return lambda images: (images - mean_array) / std_array
