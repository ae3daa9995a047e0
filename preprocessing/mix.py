"""Mixup and CutMix of training batches, with soft targets (config.mixup_alpha, cutmix_alpha).

Each batch is mixed with itself reversed (as timm does, so no second batch is read): Mixup
blends whole images, `lam * x + (1 - lam) * x_reversed`; CutMix pastes a box of the reversed
batch's images, of area `1 - lam`. The targets mix the one-hot labels with the same weight (for
CutMix, the box's actual area after clipping at the borders). `lam` is drawn once per batch from
Beta(alpha, alpha); with both on, each batch takes one of the two with probability 1/2. Draws
come from TensorFlow's stateless ops and the batch's seed, as the random ops do, so a resumed
run mixes its batches as the uninterrupted run did. Hand-written: no TensorFlow or Keras op
mixes batches with stateless seeds (Keras's MixUp/CutMix layers draw from their own generator).
"""

import tensorflow as tf


def _beta(alpha: float, seed: tf.Tensor) -> tf.Tensor:
  """One draw from Beta(alpha, alpha), as a ratio of two Gamma(alpha) draws."""
  gammas = tf.random.stateless_gamma([2], seed, alpha)
  return gammas[0] / (gammas[0] + gammas[1])


def _mixup(images: tf.Tensor, lam: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
  return lam * images + (1 - lam) * images[::-1], lam


def _cutmix(images: tf.Tensor, lam: tf.Tensor, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
  """The batch with a box of its reversed self pasted in; the share of each image kept."""
  height, width = images.shape[1], images.shape[2]
  cut = tf.sqrt(1.0 - lam)
  box_height = tf.cast(tf.round(cut * height), tf.int32)
  box_width = tf.cast(tf.round(cut * width), tf.int32)
  centre = tf.random.stateless_uniform([2], seed, 0.0, 1.0)
  centre_row = tf.cast(centre[0] * height, tf.int32)
  centre_column = tf.cast(centre[1] * width, tf.int32)
  top = tf.clip_by_value(centre_row - box_height // 2, 0, height)
  bottom = tf.clip_by_value(centre_row + box_height // 2, 0, height)
  left = tf.clip_by_value(centre_column - box_width // 2, 0, width)
  right = tf.clip_by_value(centre_column + box_width // 2, 0, width)
  rows, columns = tf.range(height)[:, None], tf.range(width)[None, :]
  inside = (rows >= top) & (rows < bottom) & (columns >= left) & (columns < right)
  mixed = tf.where(inside[None, :, :, None], images[::-1], images)
  kept = 1.0 - tf.cast((bottom - top) * (right - left), tf.float32) / (height * width)
  return mixed, kept


def mix(images: tf.Tensor, labels: tf.Tensor, num_classes: int, seed: tf.Tensor,
        mixup_alpha: float, cutmix_alpha: float) -> tuple[tf.Tensor, tf.Tensor]:
  """(mixed images, soft targets (batch, num_classes)) of a float32 batch and its labels."""
  seeds = tf.unstack(tf.random.experimental.stateless_split(seed, 3))
  one_hot = tf.one_hot(labels, num_classes)
  if mixup_alpha and cutmix_alpha:
    use_cutmix = tf.random.stateless_uniform([], seeds[0]) < 0.5
    images, kept = tf.cond(
        use_cutmix, lambda: _cutmix(images, _beta(cutmix_alpha, seeds[1]), seeds[2]),
        lambda: _mixup(images, _beta(mixup_alpha, seeds[1])))
  elif cutmix_alpha:
    images, kept = _cutmix(images, _beta(cutmix_alpha, seeds[1]), seeds[2])
  else:
    images, kept = _mixup(images, _beta(mixup_alpha, seeds[1]))
  return images, kept * one_hot + (1 - kept) * one_hot[::-1]
