"""One eval split scored by the configured evaluators: one pass, exact, on every device.

Used by training (the eval split after every epoch, the test split at the end) and by
`--mode=eval`. Every example of the split counts once: the batches are padded to equal sizes and
the padding is masked; with several devices or processes each holds a slice of every batch, and
the evaluators' states are global arrays that XLA sums across them.
"""

import dataclasses
import time

from absl import logging
from flax import nnx
import jax
import numpy as np

from data_sources import base
from training import evaluators as evaluators_lib
from training import parallel
from training import state as state_lib


@dataclasses.dataclass(frozen=True)
class Result:
  """What an evaluation found, named '<split>/<name>'."""
  scalars: dict[str, float]
  images: dict[str, np.ndarray]
  per_class: dict[str, np.ndarray]  # Column -> one value per class (the eval report's).
  num_examples: int


class Evaluation:
  """The evaluators of `config.evaluators` on one split, named `split` ('eval', 'test')."""

  def __init__(self, split: str, evaluators: list[evaluators_lib.Evaluator],
               info: base.DatasetInfo, num_examples: int):
    self.split, self._evaluators = split, evaluators
    self._info, self._num_examples = info, num_examples
    self._eval_step = state_lib.make_eval_step(evaluators)

  def _initial_states(self) -> list:
    return [evaluator.init(self._info) for evaluator in self._evaluators]

  def compile(self, model: nnx.Module, batch_shapes: dict) -> None:
    """Compiles the eval step for batches of `batch_shapes` (`parallel.abstract_batch`), before
    the data exists; the first real call reuses the executable."""
    with state_lib.eval_mode(model):
      self._eval_step.lower(model, self._initial_states(), batch_shapes).compile()

  def run(self, model: nnx.Module, batches) -> Result:
    """Scores `model` in eval mode (running BatchNorm averages, no dropout) on every batch of
    the split (padded, masked and sharded as `parallel.eval_batches` gives them)."""
    start = time.time()
    states = self._initial_states()
    with state_lib.eval_mode(model):
      for batch in batches:
        states = self._eval_step(model, states, batch)
    states = jax.tree.map(parallel.to_host, states)
    scalars, images, per_class = {}, {}, {}
    for evaluator, state in zip(self._evaluators, states):
      scalars.update(evaluator.results(state, self._info))
      images.update(evaluator.images(state, self._info))
      per_class.update(evaluator.per_class(state, self._info))
    logging.debug('Evaluated %s in %.1fs.', self.split, time.time() - start)
    prefixed = {f'{self.split}/{name}': value for name, value in scalars.items()}
    return Result(scalars=prefixed,
                  images={f'{self.split}/{name}': image for name, image in images.items()},
                  per_class=per_class, num_examples=self._num_examples)
