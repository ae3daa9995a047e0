"""`knn(k, temperature)`: the weighted k-nearest-neighbour accuracy of the pooled features."""

import jax
import jax.numpy as jnp

import evaluators
from evaluators import EVALUATORS

@EVALUATORS.register('knn')
class NearestNeighbours(evaluators.FeatureEvaluator, evaluators.HitRate):
  """The weighted k-nearest-neighbour accuracy of the pooled features, `knn<k>_accuracy`, as
  DINO (Caron et al. 2021, after Wu et al. 2018) watches representations: each example's class
  is the vote of the `k` reference examples whose features are nearest by cosine similarity s,
  each weighing exp(s / `temperature`)."""

  def __init__(self, k: int = 20, temperature: float = 0.07):
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
      raise ValueError(f'k={k!r} must be an integer >= 1')
    if not isinstance(temperature, (int, float)) or temperature <= 0:
      raise ValueError(f'temperature={temperature!r} must be a number > 0')
    self.k, self.temperature = k, float(temperature)
    self.name = f'knn{k}_accuracy'
    self.directions = {self.name: True}

  def fit(self, features, labels, info):
    return {'bank': evaluators.normalized(jnp.asarray(features, jnp.float32)),
            'labels': jnp.asarray(labels, jnp.int32), **self._zeros()}

  def update(self, state, logits, batch):
    similarity = evaluators.normalized(batch['features']) @ state['bank'].T
    nearest, index = jax.lax.top_k(similarity, min(self.k, similarity.shape[-1]))
    num_classes = logits.shape[-1]
    votes = (jax.nn.one_hot(state['labels'][index], num_classes)
             * jnp.exp(nearest / self.temperature)[..., None]).sum(axis=1)
    return self._counted(state, votes.argmax(axis=-1) == batch['label'], batch)
