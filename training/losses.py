"""Training losses, chosen by `config.loss` with their options from `config.loss_options.<name>`.

A loss is registered with `@LOSSES.register(name)`: a factory that takes the number of classes
and its options as keyword arguments and returns `loss(logits, targets) -> per-example losses`,
where logits are float32 (batch, classes) and targets are integer labels (batch,) or soft
targets (batch, classes) that sum to 1 (mixed or smoothed labels). The train step averages it
over the batch. The train and eval metrics report the plain cross-entropy whatever the loss, so
that they compare across configs.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from core import registry

LOSSES = registry.Registry('loss', key='loss', app_args=1)  # (num_classes)
Loss = Callable[[jax.Array, jax.Array], jax.Array]


def soft_targets(targets: jax.Array, num_classes: int) -> jax.Array:
  """`targets` as (batch, classes) probabilities: integer labels become one-hot."""
  return (jax.nn.one_hot(targets, num_classes) if targets.ndim == 1
          else targets.astype(jnp.float32))


@LOSSES.register('cross_entropy')
def cross_entropy(num_classes: int, *, label_smoothing: float = 0.0) -> Loss:
  """Softmax cross-entropy; `label_smoothing` mixes that weight of the uniform distribution
  into the targets (optax.smooth_labels)."""
  if not 0 <= label_smoothing < 1:
    raise ValueError(f'label_smoothing={label_smoothing!r} must be in [0, 1) (0 = off)')

  def loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    if targets.ndim == 1 and not label_smoothing:
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return optax.softmax_cross_entropy(
        logits, optax.smooth_labels(soft_targets(targets, num_classes), label_smoothing))

  return loss
