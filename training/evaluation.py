"""The evaluations of a run: each scores one split with its evaluators, at its own cadence.

A run lists its evaluations (`training/spec.py` resolves them from the config): the eval split
after every epoch ('eval', by which the best checkpoint is picked), the test split once at the
end with the best checkpoint ('test'), and any others of `config.evaluations`, each with its
own split, evaluators, preprocessing and cadence. `--mode=eval` runs one of them.

Every example of the split counts once: the batches are padded to equal sizes and the padding
is masked; with several devices or processes each holds a slice of every batch, and the
evaluators' states are global arrays that XLA sums across them. The examples scored are counted
from the masks (`<name>/num_examples`), the proof that none was dropped or counted twice.
"""

import dataclasses
import time

from absl import logging
from flax import nnx
import jax
import numpy as np

from data_sources import base
import preprocessing
from training import evaluators as evaluators_lib
from training import parallel
from training import state as state_lib

EVERY_EPOCH = 'epoch'  # At every epoch end.
AT_END = 'end'  # Once, after training, with the best checkpoint.


@dataclasses.dataclass(frozen=True)
class Result:
  """What an evaluation found, named '<evaluation>/<name>'."""
  scalars: dict[str, float]
  images: dict[str, np.ndarray]
  per_class: dict[str, np.ndarray]  # Column -> one value per class (the eval report's).
  num_examples: int  # Counted from the masks.


class Evaluation:
  """`evaluators` on `split`, its images prepared by `preprocess` (its deterministic stages),
  run `every` EVERY_EPOCH, AT_END or every N training steps; its scalars are '<name>/...'."""

  def __init__(self, name: str, split: str, evaluators: list[evaluators_lib.Evaluator],
               preprocess: preprocessing.Preprocessing, every: str | int = EVERY_EPOCH):
    self.name, self.split, self.preprocess, self.every = name, split, preprocess, every
    self._evaluators = [evaluators_lib.Count(), *evaluators]
    self._eval_step = state_lib.make_eval_step(self._evaluators)

  @property
  def directions(self) -> dict[str, bool]:
    """{scalar name: True if higher is better} of its evaluators, without the prefix."""
    return evaluators_lib.directions(self._evaluators)

  def due(self, step: int, end_of_epoch: bool) -> bool:
    """Whether it runs after training step `step` (it never does when it runs at the end)."""
    if self.every == EVERY_EPOCH:
      return end_of_epoch
    return isinstance(self.every, int) and step % self.every == 0

  def _initial_states(self, info: base.DatasetInfo) -> list:
    return [evaluator.init(info) for evaluator in self._evaluators]

  def compile(self, model: nnx.Module, batch_shapes: dict, info: base.DatasetInfo) -> None:
    """Compiles the eval step for batches of `batch_shapes` (`parallel.abstract_batch`), before
    the data exists; the first real call reuses the executable."""
    with state_lib.eval_mode(model):
      self._eval_step.lower(model, self._initial_states(info), batch_shapes).compile()

  def run(self, model: nnx.Module, batches, info: base.DatasetInfo) -> Result:
    """Scores `model` in eval mode (running BatchNorm averages, no dropout) on every batch of
    the split (padded, masked and sharded as `input_pipeline.eval_batches` gives them)."""
    start = time.time()
    states = self._initial_states(info)
    with state_lib.eval_mode(model):
      for batch in batches:
        states = self._eval_step(model, states, batch)
    states = jax.tree.map(parallel.to_host, states)
    scalars, images, per_class = {}, {}, {}
    for evaluator, state in zip(self._evaluators, states):
      scalars.update(evaluator.results(state, info))
      images.update(evaluator.images(state, info))
      per_class.update(evaluator.per_class(state, info))
    logging.debug('Evaluated %s in %.1fs.', self.name, time.time() - start)
    return Result(scalars={f'{self.name}/{name}': value for name, value in scalars.items()},
                  images={f'{self.name}/{name}': image for name, image in images.items()},
                  per_class=per_class, num_examples=scalars[evaluators_lib.Count.name])
