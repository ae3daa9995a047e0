"""The evaluations of a run: each scores one split with its evaluators, at its own cadence.

A run lists its evaluations (`training/run_spec.py` resolves them from the config): the eval split
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

from core import errors
from core import progress
from data_sources import base
import evaluators as evaluators_lib
import preprocessing
from training import parallel
from training import state as state_lib

EVERY_EPOCH = 'epoch'  # At every epoch end.
AT_END = 'end'  # Once, after training, with the best checkpoint.
PROGRESS_SECONDS = 10.0  # A long evaluation logs a progress line this often.
_POLL_SECONDS = 0.5  # How often the finished batches are counted, for the rate.


@dataclasses.dataclass(frozen=True)
class Result:
  """What an evaluation found, named '<evaluation>/<name>'."""
  scalars: dict[str, float]
  images: dict[str, np.ndarray]
  per_class: dict[str, np.ndarray]  # Column -> one value per class (the eval report's).
  num_examples: int  # Counted from the masks.


class Evaluation:
  """`evaluators` on `split`, its images prepared by `preprocess` (its deterministic stages),
  run `every` EVERY_EPOCH, AT_END or every N training steps; its scalars are '<name>/...'.
  Evaluators of features are fitted on the `reference` split first (its images prepared alike)."""

  def __init__(self, name: str, split: str, evaluators: list[evaluators_lib.Evaluator],
               preprocess: preprocessing.Preprocessing, every: str | int = EVERY_EPOCH,
               reference: str | None = None):
    self.name, self.split, self.preprocess, self.every = name, split, preprocess, every
    self.evaluators = tuple(evaluators)  # As configured; the count of examples is added below.
    self._evaluators = [evaluators_lib.Count(), *evaluators]
    self.reads_features = evaluators_lib.reads_features(evaluators)
    self.reference = reference if self.reads_features else None  # None: none needed.
    self._eval_step = state_lib.make_eval_step(self._evaluators, preprocess,
                                               features=self.reads_features)

  @property
  def directions(self) -> dict[str, bool]:
    """{scalar name: True if higher is better} of its evaluators, without the prefix."""
    return evaluators_lib.directions(self._evaluators)

  def due(self, step: int, end_of_epoch: bool) -> bool:
    """Whether it runs after training step `step` (it never does when it runs at the end)."""
    if self.every == EVERY_EPOCH:
      return end_of_epoch
    return isinstance(self.every, int) and step % self.every == 0

  def _initial_states(self, info: base.DatasetInfo, model: nnx.Module | None = None,
                      reference=None) -> list:
    """The evaluators' states before the first batch; those of features fitted on the
    `reference` batches' features by `model`."""
    if self.reads_features:
      started = time.time()
      features, labels = reference_features(model, reference, self.preprocess)
      logging.info('%s: the evaluators of features fitted on the pooled features of %d '
                   'examples of %r (%.1fs).', self.name, len(labels), self.reference,
                   time.time() - started)
    return [evaluator.fit(features, labels, info)
            if isinstance(evaluator, evaluators_lib.FeatureEvaluator) else evaluator.init(info)
            for evaluator in self._evaluators]

  def compile(self, model: nnx.Module, batch_shapes: dict, info: base.DatasetInfo) -> None:
    """Compiles the eval step for batches of `batch_shapes` (`parallel.abstract_batch`), before
    the data exists; the first real call reuses the executable. (With evaluators of features,
    whose states' shapes come from the reference split, the first call compiles.)"""
    if self.reads_features:
      return
    with state_lib.eval_mode(model):
      self._eval_step.lower(model, self._initial_states(info), batch_shapes).compile()

  def run(self, model: nnx.Module, batches, info: base.DatasetInfo,
          num_examples: int | None = None, reference=None) -> Result:
    """Scores `model` in eval mode (running BatchNorm averages, no dropout) on every batch of
    the split (padded, masked and sharded as `input_pipeline.eval_batches` gives them), after
    fitting the evaluators of features on the `reference` split's batches (given alike).

    An evaluation longer than `PROGRESS_SECONDS` logs a progress line that often (batches the
    device has finished, with an ETA when `num_examples`, the split's size, is given); a batch
    that does not fit in memory ends the run with `errors.OutOfMemory` naming
    config.eval_batch_size."""
    start = time.time()
    with state_lib.eval_mode(model):
      states = self._initial_states(info, model, reference)
    finished = progress.Finished()
    watch = _EvalProgress(self, finished, num_examples)
    batch_size = None
    try:
      with state_lib.eval_mode(model), progress.Ticker(watch.tick, _POLL_SECONDS):
        for count, batch in enumerate(batches, 1):
          batch_size = watch.batch_size = len(batch['mask'])
          states = self._eval_step(model, states, batch)
          finished.dispatched(count, jax.tree.leaves(states)[0])
        states = jax.tree.map(parallel.to_host, states)
    except jax.errors.JaxRuntimeError as error:
      if not errors.OutOfMemory.caused(error):
        raise
      raise errors.OutOfMemory(
          f'An eval step of {batch_size} examples ({self.name} on {self.split!r}) does not fit '
          f'in memory ({errors.OutOfMemory.reason(error)}): set a lower '
          'config.eval_batch_size.', key='eval_batch_size', value=batch_size) from error
    scalars, images, per_class = {}, {}, {}
    for evaluator, state in zip(self._evaluators, states):
      scalars.update(evaluator.results(state, info))
      images.update(evaluator.images(state, info))
      per_class.update(evaluator.per_class(state, info))
    logging.debug('Evaluated %s in %.1fs.', self.name, time.time() - start)
    return Result(scalars={f'{self.name}/{name}': value for name, value in scalars.items()},
                  images={f'{self.name}/{name}': image for name, image in images.items()},
                  per_class=per_class, num_examples=scalars[evaluators_lib.Count.name])


def reference_features(model: nnx.Module, batches,
                       preprocess: preprocessing.Preprocessing) -> tuple[np.ndarray, np.ndarray]:
  """The pooled features and labels of every example of `batches` (padding dropped), on the
  host: what the evaluators of features are fitted on."""
  features, labels = [], []
  for batch in batches:
    kept = parallel.to_host(batch['mask'])
    features.append(parallel.to_host(state_lib.features_of(model, preprocess,
                                                           batch['image']))[kept])
    labels.append(parallel.to_host(batch['label'])[kept])
  return np.concatenate(features), np.concatenate(labels)


class _EvalProgress:
  """The progress lines of one evaluation: every `PROGRESS_SECONDS` while batches finish."""

  def __init__(self, evaluation_: Evaluation, finished: progress.Finished,
               num_examples: int | None):
    self._evaluation, self._finished, self._num_examples = evaluation_, finished, num_examples
    self.batch_size = None  # Of the batches, over all devices; set by the loop.
    self._rate = None
    self._last_line = (time.time(), 0)  # (time, batches) of the last line.

  def tick(self) -> None:
    done = self._finished.count()
    if self.batch_size is None:
      return
    total = -(-self._num_examples // self.batch_size) if self._num_examples else None
    self._rate = self._rate or progress.Rate(0, total or 0)
    measured = self._rate.update(done)
    if (measured is None or done == self._last_line[1]
        or time.time() - self._last_line[0] < PROGRESS_SECONDS):
      return
    self._last_line = time.time(), done
    rate, left = measured
    of_total = (f'/{total} ({100 * done / total:.0f}%)' if total else '')
    logging.info('Evaluating %s on %r: batch %d%s, %.1f examples/s%s', self._evaluation.name,
                 self._evaluation.split, done, of_total, rate * self.batch_size,
                 f', ETA {progress.duration(left)}' if total else '')
