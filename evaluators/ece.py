"""`ece(bins)`: the expected calibration error and a reliability diagram."""

import jax
import jax.numpy as jnp
import numpy as np

import evaluators
from evaluators import EVALUATORS
from training import pictures

@EVALUATORS.register('ece')
class CalibrationError(evaluators.Evaluator):
  """The expected calibration error over `bins` equal-width confidence bins, `ece` (Guo et al.,
  2017): sum over the bins of |accuracy - mean confidence| weighted by the bin's share of the
  examples, the confidence being the top softmax probability; and a reliability diagram.

  Each bin's count, confidence and correct predictions are summed over the whole split, so the
  result is the split's ECE, not a mean of per-batch ones. Bin m holds confidences in
  ((m-1)/bins, m/bins].
  """
  name = 'ece'
  directions = {'ece': False}

  def __init__(self, bins: int = 15):
    if not isinstance(bins, int) or isinstance(bins, bool) or bins < 1:
      raise ValueError(f'bins={bins!r} must be an integer >= 1')
    self.bins = bins

  def init(self, info):
    return {'count': jnp.zeros(self.bins, jnp.int32),
            'confidence': jnp.zeros(self.bins, jnp.float32),
            'correct': jnp.zeros(self.bins, jnp.int32)}

  def update(self, state, logits, batch):
    probabilities = jax.nn.softmax(logits)
    confidence = probabilities.max(axis=-1)
    correct = logits.argmax(axis=-1) == batch['label']
    bins = jnp.clip(jnp.ceil(confidence * self.bins).astype(jnp.int32) - 1, 0, self.bins - 1)
    # Masked one-hot bins times the values: a small matmul (as evaluators.Confusion's) for the sums.
    in_bin = jax.nn.one_hot(bins, self.bins) * batch['mask'][:, None]
    counted = lambda values: jnp.round(values.astype(jnp.float32) @ in_bin).astype(jnp.int32)
    return {'count': state['count'] + counted(batch['mask']),
            'confidence': state['confidence'] + confidence @ in_bin,
            'correct': state['correct'] + counted(correct)}

  def results(self, state, info):
    gaps = np.abs(np.asarray(state['correct'], np.float64) - state['confidence'])
    return {'ece': float(gaps.sum() / max(int(np.sum(state['count'])), 1))}

  def images(self, state, info):
    return {'reliability_diagram': pictures.reliability_diagram(
        np.asarray(state['count']), np.asarray(state['confidence']),
        np.asarray(state['correct']))}
