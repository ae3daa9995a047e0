"""The crops of pretrained models (timm's and torchvision's transforms), on uint8 images.

  resize_small(size, interpolation='bilinear')
      image op: the shorter side to `size`, the aspect ratio kept (torchvision's Resize(size):
      the longer side truncated), antialiased;
  central_crop(size)
      image op: the centre size x size (torchvision's CenterCrop: offsets rounded, images
      smaller than `size` padded with black first);
  random_resized_crop(size, scale=(0.08, 1.0), ratio=(3/4, 4/3), crop_pct=0.875,
                      interpolation='bilinear')
      crop op (one image at a time, before batching): torchvision's RandomResizedCrop, a
      window of an area fraction drawn from `scale` and an aspect ratio (width / height)
      log-uniform in `ratio`, taken from the image as decoded and resized once to size x size.
      Eval, predict and export run `resize_small(int(size / crop_pct))|central_crop(size)` in
      its place: timm's eval transform for a model with that `crop_pct`.

Unlike `inception_crop` (a random op on batches already resized to the model's size), the
window of `random_resized_crop` sees the original pixels, and a JPEG decoder can decode only the
window (`data_sources/image_files.py`).
"""

import tensorflow as tf

import preprocessing
from preprocessing import resize
from preprocessing import scale as scale_ops
from preprocessing import strong_augment


def _shorter_side_to(images: tf.Tensor, size: int, method: str) -> tf.Tensor:
  """Images (..., H, W, C) with the shorter side `size`, the longer side `size` * long / short
  truncated (torchvision's Resize(int), in float64 as its Python arithmetic)."""
  shape = tf.cast(tf.shape(images)[-3:-1], tf.float64)
  scaled = tf.floor(size * shape / tf.reduce_min(shape))
  return resize.resize_images(images, tf.cast(tf.maximum(scaled, 1), tf.int32), method)


def _central(images: tf.Tensor, size: int) -> tf.Tensor:
  """The centre size x size of images (..., H, W, C), as torchvision's CenterCrop cuts it."""
  shape = tf.shape(images)
  height, width = shape[-3], shape[-2]
  # torchvision pads a smaller image with black, (missing // 2) before and the rest after.
  pad_height, pad_width = tf.maximum(size - height, 0), tf.maximum(size - width, 0)
  padding = [[pad_height // 2, pad_height - pad_height // 2],
             [pad_width // 2, pad_width - pad_width // 2], [0, 0]]
  images = tf.pad(images, [[0, 0]] * (len(images.shape) - 3) + padding)
  height, width = height + pad_height, width + pad_width
  # torchvision's offsets: round((extent - size) / 2), half to even as tf.round.
  top = tf.cast(tf.round((height - size) / 2), tf.int32)
  left = tf.cast(tf.round((width - size) / 2), tf.int32)
  return images[..., top:top + size, left:left + size, :]


@preprocessing.OPS.register('resize_small', stage='image')
def resize_small(size: int, interpolation: str = 'bilinear') -> preprocessing.ImageOp:
  """The shorter side to `size`, the aspect ratio kept; `interpolation` 'bilinear' or
  'bicubic' (timm's pretrained models name theirs)."""
  preprocessing.check_int('size', size, 1)
  method = resize.check_interpolation(interpolation)
  return lambda images: _shorter_side_to(images, size, method)


@preprocessing.OPS.register('central_crop', stage='image')
def central_crop(size: int) -> preprocessing.ImageOp:
  """The centre `size` x `size` pixels (black borders where the image is smaller)."""
  preprocessing.check_int('size', size, 1)
  return lambda images: tf.ensure_shape(_central(images, size),
                                        [*images.shape[:-3], size, size, images.shape[-1]])


@preprocessing.OPS.register('random_resized_crop', stage='crop')
def random_resized_crop(size: int, scale: tuple[float, float] = (0.08, 1.0),
                        ratio: tuple[float, float] = (3 / 4, 4 / 3), crop_pct: float = 0.875,
                        interpolation: str = 'bilinear') -> preprocessing.CropOp:
  """torchvision's RandomResizedCrop(size, scale, ratio) from the image as decoded; eval's
  stand-in is timm's: the shorter side to int(size / crop_pct), then the centre size x size
  (crop_pct 0.875 is timm's default, 224 from 256)."""
  preprocessing.check_int('size', size, 1)
  scale = preprocessing.check_interval('scale', scale, 1.0)
  ratio = preprocessing.check_interval('ratio', ratio)
  crop_pct = preprocessing.check_number('crop_pct', crop_pct, 0, 1, low_open=True)
  method = resize.check_interpolation(interpolation)

  def window(image_size: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    windows = strong_augment.crop_windows(seed, 1, image_size[0], image_size[1], scale, ratio)
    return tf.stack([values[0] for values in windows])

  eval_size = int(size / crop_pct)  # timm's math.floor(img_size / crop_pct).
  return preprocessing.CropOp(
      window=window,
      resize=lambda image: resize.resize_window(image, size, method),
      eval_op=lambda images: central_crop(size)(_shorter_side_to(images, eval_size, method)),
      eval_spec=f'resize_small({eval_size}, interpolation={interpolation!r})|central_crop({size})')


def pretrained_spec(pretrained_cfg: dict) -> str:
  """The preprocessing of a model pretrained as timm's `pretrained_cfg` (input_size, crop_pct,
  interpolation, mean, std) says: a random-resized crop from the decoded image and a flip in
  training, the shorter side to size / crop_pct and the centre crop in eval, its normalisation.
  """
  _, height, width = pretrained_cfg['input_size']
  if height != width:
    raise ValueError(f'input_size={pretrained_cfg["input_size"]} is not square')
  statistics = (tuple(pretrained_cfg['mean']), tuple(pretrained_cfg['std']))
  names = {values: name for name, values in scale_ops.STATISTICS.items()}
  normalize = (f'normalize({names[statistics]!r})' if statistics in names
               else f'normalize({statistics[0]}, {statistics[1]})')
  return (f'random_resized_crop({height}, crop_pct={pretrained_cfg["crop_pct"]}, '
          f'interpolation={pretrained_cfg["interpolation"]!r})|flip_lr|{normalize}')
