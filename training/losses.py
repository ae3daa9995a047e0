"""Training losses, chosen by `config.loss` with their options from `config.loss_options.<name>`.

A loss is registered with `@LOSSES.register(name)`: a factory that takes the number of classes,
a function giving the number of training examples of each class (called only by losses that
need it: it waits for the training split), and its options as keyword arguments, and returns
`loss(logits, targets) -> per-example losses`, where logits are float32 (batch, classes) and
targets are integer labels (batch,) or soft targets (batch, classes) that sum to 1 (mixed or
smoothed labels). The train step averages it over the batch. The train and eval metrics report
the plain cross-entropy whatever the loss, so that they compare across configs.
"""

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from core import registry

# (num_classes, class_counts): class_counts() -> training examples per class, an array.
LOSSES = registry.Registry('loss', key='loss', app_args=2)
Loss = Callable[[jax.Array, jax.Array], jax.Array]


def soft_targets(targets: jax.Array, num_classes: int) -> jax.Array:
  """`targets` as (batch, classes) probabilities: integer labels become one-hot."""
  return (jax.nn.one_hot(targets, num_classes) if targets.ndim == 1
          else targets.astype(jnp.float32))


def class_weight_vector(weights: str | Sequence[float] | None, num_classes: int,
                        class_counts: Callable[[], np.ndarray]) -> np.ndarray | None:
  """Per-class loss weights: None, 'balanced' (n / (classes x count), scikit-learn's) or one
  positive weight per class."""
  if weights is None:
    return None
  if weights == 'balanced':
    counts = np.asarray(class_counts(), np.float64)
    if (counts == 0).any():
      raise ValueError(f"class_weights='balanced' needs examples of every class; the training "
                       f'split has none of the classes {np.flatnonzero(counts == 0).tolist()}')
    return (counts.sum() / (num_classes * counts)).astype(np.float32)
  if (isinstance(weights, str) or len(weights) != num_classes
      or any(not isinstance(w, (int, float)) or w <= 0 for w in weights)):
    raise ValueError(f"class_weights={weights!r} must be None, 'balanced' or {num_classes} "
                     'positive numbers, one per class')
  return np.asarray(weights, np.float32)


@LOSSES.register('cross_entropy')
def cross_entropy(num_classes: int, class_counts: Callable[[], np.ndarray] = lambda: None, *,
                  label_smoothing: float = 0.0,
                  class_weights: str | Sequence[float] | None = None) -> Loss:
  """Softmax cross-entropy; `label_smoothing` mixes that weight of the uniform distribution
  into the targets (optax.smooth_labels); `class_weights` weighs each example's loss by its
  target's class (see `class_weight_vector`)."""
  if not 0 <= label_smoothing < 1:
    raise ValueError(f'label_smoothing={label_smoothing!r} must be in [0, 1) (0 = off)')
  weights = class_weight_vector(class_weights, num_classes, class_counts)

  def loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    if targets.ndim == 1 and not label_smoothing:
      losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    else:
      losses = optax.softmax_cross_entropy(
          logits, optax.smooth_labels(soft_targets(targets, num_classes), label_smoothing))
    if weights is None:
      return losses
    return losses * (soft_targets(targets, num_classes) @ weights)

  return loss
