"""`misclassified(count)`: a grid of the first misclassified examples."""

import jax.numpy as jnp
import numpy as np

import evaluators
from evaluators import EVALUATORS
from training import pictures

@EVALUATORS.register('misclassified')
class Misclassified(evaluators.Evaluator):
  """A grid of the first `count` misclassified examples, captioned 'true -> predicted'."""
  name = 'misclassified'

  def __init__(self, count: int = 36):
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
      raise ValueError(f'count={count!r} must be an integer >= 1')
    self.count = count

  def init(self, info):
    return {'images': jnp.zeros((self.count, *info.image_shape), jnp.float32),
            'labels': jnp.zeros(self.count, jnp.int32),
            'predictions': jnp.zeros(self.count, jnp.int32),
            'found': jnp.zeros((), jnp.int32)}

  def update(self, state, logits, batch):
    predictions = logits.argmax(axis=-1).astype(jnp.int32)
    wrong = batch['mask'] & (predictions != batch['label'])
    # Each error's slot in the grid, in the order of the split; errors past the last slot (and
    # correct examples, sent to slot `count`) are dropped by the scatter.
    slots = jnp.where(wrong, state['found'] + jnp.cumsum(wrong) - 1, self.count)
    def place(kept, values):
      return kept.at[slots].set(values.astype(kept.dtype), mode='drop')
    return {'images': place(state['images'], batch['image']),
            'labels': place(state['labels'], batch['label']),
            'predictions': place(state['predictions'], predictions),
            'found': state['found'] + wrong.sum(dtype=jnp.int32)}

  def images(self, state, info):
    shown = min(int(state['found']), self.count)
    if not shown:
      return {}
    return {'misclassified': pictures.misclassified_grid(
        np.asarray(state['images'][:shown]), np.asarray(state['labels'][:shown]),
        np.asarray(state['predictions'][:shown]), info.class_names)}
