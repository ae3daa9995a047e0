"""`loss`: the mean softmax cross-entropy."""

import jax.numpy as jnp
import optax

import evaluators
from evaluators import EVALUATORS

@EVALUATORS.register('loss')
class Loss(evaluators.Evaluator):
  """The mean softmax cross-entropy: `loss`."""
  name = 'loss'
  directions = {'loss': False}

  def init(self, info):
    return {'sum': jnp.zeros((), jnp.float32), 'count': jnp.zeros((), jnp.int32)}

  def update(self, state, logits, batch):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch['label'])
    return {'sum': state['sum'] + jnp.where(batch['mask'], losses, 0).sum(),
            'count': state['count'] + evaluators.count(batch)}

  def results(self, state, info):
    return {'loss': float(state['sum'] / max(state['count'], 1))}
