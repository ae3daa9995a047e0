"""`fewshot(shots, l2, seed)`: the linear few-shot accuracy of the pooled features."""

import jax.numpy as jnp
import numpy as np

import evaluators
from evaluators import EVALUATORS

@EVALUATORS.register('fewshot')
class FewShot(evaluators.FeatureEvaluator, evaluators.HitRate):
  """The linear few-shot accuracy of the pooled features, `fewshot<shots>_accuracy`, as
  big_vision's few-shot evaluator (Kolesnikov et al. 2020) scores representations: a ridge
  regression (`l2`) of the features onto one-hot targets in {-1, 1}, fitted in closed form on
  `shots` reference examples of each class, drawn with `seed`; an example's class is its largest
  output. The features are standardised by the shots' mean and deviation, with a constant
  feature of 100 for the bias (large, so barely regularised), as big_vision does."""
  BIAS = 100.0

  def __init__(self, shots: int = 5, l2: float = 1024.0, seed: int = 0):
    for name, value in (('shots', shots), ('seed', seed)):
      if not isinstance(value, int) or isinstance(value, bool) or value < (name == 'shots'):
        raise ValueError(f'{name}={value!r} must be an integer >= {int(name == "shots")}')
    if not isinstance(l2, (int, float)) or l2 <= 0:
      raise ValueError(f'l2={l2!r} must be a number > 0')
    self.shots, self.l2, self.seed = shots, float(l2), seed
    self.name = f'fewshot{shots}_accuracy'
    self.directions = {self.name: True}

  def fit(self, features, labels, info):
    generator = np.random.default_rng(self.seed)
    chosen = np.concatenate([generator.permutation(np.flatnonzero(labels == label))[:self.shots]
                             for label in range(info.num_classes)])
    x = np.asarray(features, np.float64)[chosen]
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-5
    x = np.pad((x - mean) / std, ((0, 0), (0, 1)), constant_values=self.BIAS)
    y = 2.0 * np.eye(info.num_classes)[labels[chosen]] - 1.0
    # Ridge regression in closed form, through the smaller of the two Gram matrices.
    if len(x) >= x.shape[1]:
      weights = np.linalg.solve(x.T @ x + self.l2 * np.eye(x.shape[1]), x.T @ y)
    else:
      weights = x.T @ np.linalg.solve(x @ x.T + self.l2 * np.eye(len(x)), y)
    return {'mean': jnp.asarray(mean, jnp.float32), 'std': jnp.asarray(std, jnp.float32),
            'weights': jnp.asarray(weights, jnp.float32), **self._zeros()}

  def update(self, state, logits, batch):
    x = (batch['features'] - state['mean']) / state['std']
    outputs = x @ state['weights'][:-1] + self.BIAS * state['weights'][-1]
    return self._counted(state, outputs.argmax(axis=-1) == batch['label'], batch)
