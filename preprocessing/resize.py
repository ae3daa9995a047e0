"""Stage 1 ops: images of any size to one size, deterministic, one image (or batch) at a time."""

import tensorflow as tf

import preprocessing

METHODS = ('stretch', 'crop', 'pad')


INTERPOLATIONS = ('bilinear', 'bicubic')  # timm's pretrained_cfg names, as tf.image.resize's.


def resize_images(images: tf.Tensor, size, method: str = 'bilinear') -> tf.Tensor:
  """uint8 images (..., height, width, channels) resized to `size` (height, width; ints or an
  int32 tensor), as uint8.

  Antialiased (bilinear, or bicubic: Keys' a = -0.5 kernel, PIL's), so shrinking does not
  alias; rounded back to uint8, so a resized split takes no more memory than the source's, and
  in-memory, streamed, predicted and exported pixels agree.
  """
  if isinstance(size, tuple) and tuple(images.shape[-3:-1]) == size:
    return images
  antialiased = lambda: tf.image.resize(images, size, method=method, antialias=True)
  if method == 'bilinear':
    # Antialiasing widens the bilinear kernel only where an image shrinks: enlarging (most
    # random_resized_crop windows), the plain resize gives the same pixels but for rounding
    # (0.03% of them differ by 1) in less time (docs/performance.md).
    shrinks = tf.reduce_any(tf.shape(images)[-3:-1] > tf.cast(size, tf.int32))
    resized = tf.cond(shrinks, antialiased, lambda: tf.image.resize(images, size))
  else:
    resized = antialiased()
  return _rounded(resized)


def _rounded(resized: tf.Tensor) -> tf.Tensor:
  """Resized float pixels back to uint8, rounded to nearest."""
  return tf.cast(tf.clip_by_value(tf.round(resized), 0, 255), tf.uint8)


def resize_window(window: tf.Tensor, size: int, method: str = 'bilinear') -> tf.Tensor:
  """A uint8 crop window (height, width, channels) of any size resized to `size` x `size`, as
  uint8: the training crop's resize, run once per image per epoch.

  Where the window shrinks, it is first box-averaged down to at most `size` (tf.image.resize's
  'area': an antialiasing filter, about 4x faster than the antialiased bilinear kernel of
  `resize_images`, which made the cached epochs' shrinking windows the pipeline's bottleneck;
  docs/performance.md), then enlarged to `size` with `method` (bilinear plainly, bicubic with
  the Keys a = -0.5 kernel of `resize_images`). Eval's resizes keep `resize_images`: its pixels
  are the ones pretrained models were evaluated on.
  """
  shape = tf.shape(window)[:2]
  shrunk = tf.cond(tf.reduce_any(shape > size),
                   lambda: tf.image.resize(window, tf.minimum(shape, size), method='area'),
                   lambda: tf.cast(window, tf.float32))
  resized = tf.image.resize(shrunk, (size, size), method=method, antialias=method != 'bilinear')
  return tf.ensure_shape(_rounded(resized), [size, size, window.shape[-1]])


def check_interpolation(interpolation: str) -> str:
  """Raises ValueError unless `interpolation` is one of INTERPOLATIONS."""
  if interpolation not in INTERPOLATIONS:
    raise ValueError(f'interpolation={interpolation!r} must be one of {INTERPOLATIONS}')
  return interpolation


def fitted_size(images: tf.Tensor, size: int, cover: bool) -> tf.Tensor:
  """The aspect-preserving size whose shorter (`cover`) or longer side is `size`."""
  shape = tf.cast(tf.shape(images)[-3:-1], tf.float32)
  scale = size / (tf.reduce_min(shape) if cover else tf.reduce_max(shape))
  return tf.cast(tf.maximum(tf.round(shape * scale), 1), tf.int32)


@preprocessing.OPS.register('resize', stage='image')
def resize(size: int, method: str = 'stretch') -> preprocessing.ImageOp:
  """To `size` x `size` pixels. `method`: 'stretch' (ignore the aspect ratio), 'crop' (shorter
  side to `size`, then the centre square) or 'pad' (longer side to `size`, then black borders)."""
  preprocessing.check_int('size', size, 1)
  if method not in METHODS:
    raise ValueError(f'method={method!r} must be one of {METHODS}')
  if method == 'stretch':
    return lambda images: resize_images(images, (size, size))

  def fitted(images: tf.Tensor) -> tf.Tensor:
    scaled = resize_images(images, fitted_size(images, size, cover=method == 'crop'))
    return tf.image.resize_with_crop_or_pad(scaled, size, size)

  return fitted
