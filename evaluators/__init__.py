"""Evaluators: what an evaluation measures, chosen by `config.evaluators`.

`config.evaluators` is a string of evaluators joined by '|', each with optional Python-literal
arguments, e.g. 'loss|accuracy|top_k(5)|per_class|confusion_matrix|misclassified(36)|ece'. An
evaluation (training/evaluation.py) runs all of its evaluators in one pass: on the device, each
folds every batch into a small state of sums (masked padding counts nothing; with several
devices or processes XLA sums across them), and on the host turns the final state into scalars
(and, for some, pictures and per-class rows).

An evaluator is a class registered with `@EVALUATORS.register(name)`, one module of this package
each (a new evaluator is one new file here), built from its arguments:

  `directions`  {scalar name: True if higher is better}, known before any data is read, so that
                `config.best_metric` (e.g. 'eval/macro_f1') can be checked and followed;
  `init(info)`  the state before the first batch (arrays of fixed shapes);
  `update(state, logits, batch)`  the state after one batch (traced inside the eval step);
  `results(state, info)`  {scalar name: float};
  `images(state, info)`  {picture name: uint8 RGB array} for TensorBoard (default none);
  `per_class(state, info)`  {column: one value per class} for the eval report (default none).

Evaluators of the pooled features rather than the logits (`knn(20)`, `fewshot(5)`) derive from
`FeatureEvaluator`: they are fitted on a reference split first (`fit` in place of `init`) and
read `batch['features']`. This module holds the bases (`Evaluator`, `HitRate`, `Confusion`,
`FeatureEvaluator`), the count every evaluation has, and the parsing of config.evaluators.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from core import errors
from core import registry
from data_sources import base

EVALUATORS = registry.Registry('evaluator', key='evaluators', package='evaluators')
State = Any  # A pytree of arrays.
Batch = dict[str, jax.Array]  # 'image', 'label' and 'mask' (False for padding).
# What the eval report (--mode=eval) always has, by name.
REPORT = ('per_class', 'confusion_matrix')


class Evaluator:
  """The base: no scalars, no pictures, no per-class values."""
  name: str = ''
  directions: dict[str, bool] = {}

  def init(self, info: base.DatasetInfo) -> State:
    raise NotImplementedError

  def update(self, state: State, logits: jax.Array, batch: Batch) -> State:
    raise NotImplementedError

  def results(self, state: State, info: base.DatasetInfo) -> dict[str, float]:
    del state, info
    return {}

  def images(self, state: State, info: base.DatasetInfo) -> dict[str, np.ndarray]:
    del state, info
    return {}

  def per_class(self, state: State, info: base.DatasetInfo) -> dict[str, np.ndarray]:
    del state, info
    return {}


def count(batch: Batch) -> jax.Array:
  """The examples of `batch` that are not padding."""
  return batch['mask'].sum(dtype=jnp.int32)


class Count(Evaluator):
  """The examples scored, counted from the masks: `num_examples`. Every evaluation has it
  (not a choice of config.evaluators): the proof that each example counted once."""
  name = 'num_examples'

  def init(self, info):
    return jnp.zeros((), jnp.int32)

  def update(self, state, logits, batch):
    return state + count(batch)

  def results(self, state, info):
    return {self.name: int(state)}


class HitRate(Evaluator):
  """A base for evaluators whose scalar, `name`, is the share of examples that are hits."""

  @staticmethod
  def _zeros() -> State:
    return {'correct': jnp.zeros((), jnp.int32), 'count': jnp.zeros((), jnp.int32)}

  @staticmethod
  def _counted(state: State, hit: jax.Array, batch: Batch) -> State:
    """`state` with the batch's hits (`hit` where the batch is not padding) counted."""
    return {**state, 'correct': state['correct'] + (hit & batch['mask']).sum(dtype=jnp.int32),
            'count': state['count'] + count(batch)}

  def results(self, state, info):
    return {self.name: float(state['correct'] / max(state['count'], 1))}


class Confusion(Evaluator):
  """A base for evaluators computed from the confusion matrix (rows true, columns predicted)."""

  def init(self, info):
    return jnp.zeros((info.num_classes, info.num_classes), jnp.int32)

  def update(self, state, logits, batch):
    # One-hot labels (masked) times one-hot predictions: a small matmul, where a scatter-add of
    # the cells costs XLA:CPU more.
    num_classes = state.shape[0]
    labels = jax.nn.one_hot(batch['label'], num_classes) * batch['mask'][:, None]
    predicted = jax.nn.one_hot(logits.argmax(axis=-1), num_classes)
    return state + jnp.round(labels.T @ predicted).astype(jnp.int32)


def class_scores(counts: np.ndarray) -> dict[str, np.ndarray]:
  """Per-class support, precision, recall and F1 of a confusion matrix (rows true).

  As scikit-learn's with zero_division=0: a class never predicted has precision 0, a class
  without examples recall 0, and F1 is 0 where precision and recall both are.
  """
  counts = np.asarray(counts, np.float64)
  true_positives = np.diag(counts)
  support, predicted = counts.sum(axis=1), counts.sum(axis=0)
  precision = np.divide(true_positives, predicted, out=np.zeros_like(predicted),
                        where=predicted > 0)
  recall = np.divide(true_positives, support, out=np.zeros_like(support), where=support > 0)
  total = precision + recall
  f1 = np.divide(2 * precision * recall, total, out=np.zeros_like(total), where=total > 0)
  return {'support': support.astype(np.int64), 'precision': precision, 'recall': recall,
          'f1': f1}


class FeatureEvaluator(Evaluator):
  """A base for evaluators of the model's pooled features (`batch['features']`: the embedding
  of --mode=embed) rather than its logits. Each is fitted first on the features and labels of a
  reference split (the evaluation's `reference`, by default the training split, prepared as
  eval prepares images): `fit` gives the state before the first batch, in place of `init`."""

  def fit(self, features: np.ndarray, labels: np.ndarray, info: base.DatasetInfo) -> State:
    raise NotImplementedError

  def init(self, info):
    raise TypeError(f'{type(self).__name__} starts from fit(features, labels, info).')


def reads_features(evaluators: list[Evaluator]) -> bool:
  """Whether any of `evaluators` scores the pooled features (a `FeatureEvaluator`)."""
  return any(isinstance(evaluator, FeatureEvaluator) for evaluator in evaluators)


def normalized(features):
  """`features` scaled to unit length along the last axis."""
  return features / jnp.maximum(jnp.linalg.norm(features, axis=-1, keepdims=True), 1e-12)


def create(spec: str, key: str = 'evaluators') -> list[Evaluator]:
  """The evaluators of `spec` (config.<key>); a `ConfigError` for a bad one or a repeat."""
  evaluators = [evaluator for _, _, evaluator in EVALUATORS.create_calls(spec, key)]
  names = [evaluator.name for evaluator in evaluators]
  if len(set(names)) < len(names):
    raise errors.ConfigError(
        f'config.{key}={spec!r} is invalid: it names one evaluator twice.', key=key, value=spec)
  return evaluators


def with_report(chosen: list[Evaluator]) -> list[Evaluator]:
  """`chosen` and, where it lacks them, `per_class` and `confusion_matrix`: what the eval
  report (--mode=eval) always has."""
  names = {evaluator.name for evaluator in chosen}
  return [*chosen, *(EVALUATORS.entry(report).factory() for report in REPORT
                     if report not in names)]


def directions(evaluators: list[Evaluator]) -> dict[str, bool]:
  """{scalar name: True if higher is better} of all `evaluators`."""
  return {name: higher for evaluator in evaluators
          for name, higher in evaluator.directions.items()}
