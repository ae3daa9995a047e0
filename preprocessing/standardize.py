"""Stage 4 op `standardize`: each image to zero mean and unit variance, on its own statistics.

Where the colours of an image say nothing of its class (a shape, a texture or a digit drawn in
random colours), an image's mean and contrast vary far more between images than its class's
edges do; dividing them out per image (TensorFlow's `tf.image.per_image_standardization`) gives
the first convolutions edges to learn from, not flat colours. Eval, predict and export apply it
as every scale op.

Like the other scale ops it runs on TensorFlow tensors (the input pipeline) and on NumPy or JAX
arrays (inside a compiled step, or a model exported through JAX): the reductions come from the
array's own namespace (the array API's `__array_namespace__`, which JAX arrays, tracers and NumPy
arrays have), or from `tf.experimental.numpy` for a tensor, which has none.
"""

import math

import tensorflow as tf

import preprocessing


def _namespace(images):
  """The NumPy-like module of `images`: jax.numpy, numpy, or tf.experimental.numpy."""
  if isinstance(images, tf.Tensor):
    return tf.experimental.numpy
  return images.__array_namespace__()


@preprocessing.OPS.register('standardize', stage='scale')
def standardize(per_channel: bool = False, polarity: bool = False) -> preprocessing.ScaleOp:
  """(pixel - mean) / max(std, 1 / sqrt(N)) over each image's N = height x width x channels
  values, as tf.image.per_image_standardization (the floor keeps a flat image finite).

  `per_channel=True`: over each channel of each image (its height x width values), so that
  each channel's colour and contrast are divided out as well. `polarity=True`: then each
  image's (or channel's) values multiplied by the sign of their skewness, so that the colour
  covering less of the image is the positive one: a figure drawn light on dark and the same
  figure dark on light give the same values (with `per_channel`, a two-colour image gives the
  same mask in every channel, whatever its two colours).
  """
  for name, value in (('per_channel', per_channel), ('polarity', polarity)):
    if not isinstance(value, bool):
      raise ValueError(f'{name}={value!r} must be True or False')
  axes = (-3, -2) if per_channel else (-3, -2, -1)

  def op(images):
    xp = _namespace(images)
    count = math.prod(images.shape[axis] for axis in axes)
    mean = xp.mean(images, axis=axes, keepdims=True)
    std = xp.sqrt(xp.mean(xp.square(images - mean), axis=axes, keepdims=True))
    standardized = (images - mean) / xp.maximum(std, 1.0 / math.sqrt(count))
    if not polarity:
      return standardized
    skew = xp.mean(standardized * standardized * standardized, axis=axes, keepdims=True)
    return xp.where(skew < 0, -standardized, standardized)

  return op
