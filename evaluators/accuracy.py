"""`accuracy` and `top_k(k)`: the share of examples whose label has the highest logit, or is
among the k highest."""

import jax

import evaluators
from evaluators import EVALUATORS

@EVALUATORS.register('top_k')
class TopK(evaluators.HitRate):
  """The share of examples whose label is among the `k` highest logits: `top<k>_accuracy`."""

  def __init__(self, k: int = 5):
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
      raise ValueError(f'k={k!r} must be an integer >= 1')
    self.k = k
    self.name = f'top{k}_accuracy'
    self.directions = {self.name: True}

  def init(self, info):
    return self._zeros()

  def update(self, state, logits, batch):
    _, top = jax.lax.top_k(logits, min(self.k, logits.shape[-1]))
    return self._counted(state, (top == batch['label'][:, None]).any(axis=-1), batch)


@EVALUATORS.register('accuracy')
class Accuracy(TopK):
  """The share of examples whose highest logit is their label: `accuracy`."""

  def __init__(self):
    super().__init__(k=1)
    self.name = 'accuracy'
    self.directions = {'accuracy': True}
