"""Evaluators: what an evaluation measures, chosen by `config.evaluators`.

`config.evaluators` is a string of evaluators joined by '|', each with optional Python-literal
arguments, e.g. 'loss|accuracy|top_k(5)|per_class|confusion_matrix|misclassified(36)|ece'. An
evaluation (training/evaluation.py) runs all of its evaluators in one pass: on the device, each
folds every batch into a small state of sums (masked padding counts nothing; with several
devices or processes XLA sums across them), and on the host turns the final state into scalars
(and, for some, pictures and per-class rows).

An evaluator is a class registered with `@EVALUATORS.register(name)`, built from its arguments:

  `directions`  {scalar name: True if higher is better}, known before any data is read, so that
                `config.best_metric` (e.g. 'eval/macro_f1') can be checked and followed;
  `init(info)`  the state before the first batch (arrays of fixed shapes);
  `update(state, logits, batch)`  the state after one batch (traced inside the eval step);
  `results(state, info)`  {scalar name: float};
  `images(state, info)`  {picture name: uint8 RGB array} for TensorBoard (default none);
  `per_class(state, info)`  {column: one value per class} for the eval report (default none).

Evaluators of the pooled features rather than the logits (`knn(20)`, `fewshot(5)`) derive from
`FeatureEvaluator`: they are fitted on a reference split first (`fit` in place of `init`) and
read `batch['features']`.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from core import errors
from core import registry
from data_sources import base
from training import pictures

EVALUATORS = registry.Registry('evaluator', key='evaluators')
State = Any  # A pytree of arrays.
Batch = dict[str, jax.Array]  # 'image', 'label' and 'mask' (False for padding).


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


def _count(batch: Batch) -> jax.Array:
  return batch['mask'].sum(dtype=jnp.int32)


class Count(Evaluator):
  """The examples scored, counted from the masks: `num_examples`. Every evaluation has it
  (not a choice of config.evaluators): the proof that each example counted once."""
  name = 'num_examples'

  def init(self, info):
    return jnp.zeros((), jnp.int32)

  def update(self, state, logits, batch):
    return state + _count(batch)

  def results(self, state, info):
    return {self.name: int(state)}


@EVALUATORS.register('loss')
class Loss(Evaluator):
  """The mean softmax cross-entropy: `loss`."""
  name = 'loss'
  directions = {'loss': False}

  def init(self, info):
    return {'sum': jnp.zeros((), jnp.float32), 'count': jnp.zeros((), jnp.int32)}

  def update(self, state, logits, batch):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch['label'])
    return {'sum': state['sum'] + jnp.where(batch['mask'], losses, 0).sum(),
            'count': state['count'] + _count(batch)}

  def results(self, state, info):
    return {'loss': float(state['sum'] / max(state['count'], 1))}


class _HitRate(Evaluator):
  """A base for evaluators whose scalar, `name`, is the share of examples that are hits."""

  @staticmethod
  def _zeros() -> State:
    return {'correct': jnp.zeros((), jnp.int32), 'count': jnp.zeros((), jnp.int32)}

  @staticmethod
  def _counted(state: State, hit: jax.Array, batch: Batch) -> State:
    """`state` with the batch's hits (`hit` where the batch is not padding) counted."""
    return {**state, 'correct': state['correct'] + (hit & batch['mask']).sum(dtype=jnp.int32),
            'count': state['count'] + _count(batch)}

  def results(self, state, info):
    return {self.name: float(state['correct'] / max(state['count'], 1))}


@EVALUATORS.register('top_k')
class TopK(_HitRate):
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


class _Confusion(Evaluator):
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


@EVALUATORS.register('per_class')
class PerClass(_Confusion):
  """Per-class precision, recall and F1 (in the eval report), and their macro averages:
  `macro_precision`, `macro_recall`, `macro_f1`, over the classes that occur in the split's
  labels or predictions (scikit-learn's average='macro')."""
  name = 'per_class'
  directions = {'macro_precision': True, 'macro_recall': True, 'macro_f1': True}

  def results(self, state, info):
    scores = class_scores(state)
    occurring = (scores['support'] > 0) | (np.asarray(state).sum(axis=0) > 0)
    return {f'macro_{name}': float(scores[name][occurring].mean()) if occurring.any() else 0.0
            for name in ('precision', 'recall', 'f1')}

  def per_class(self, state, info):
    return class_scores(state)


@EVALUATORS.register('balanced_accuracy')
class BalancedAccuracy(_Confusion):
  """The mean recall over the classes that have examples in the split: `balanced_accuracy`
  (scikit-learn's balanced_accuracy_score)."""
  name = 'balanced_accuracy'
  directions = {'balanced_accuracy': True}

  def results(self, state, info):
    scores = class_scores(state)
    present = scores['support'] > 0
    return {'balanced_accuracy': float(scores['recall'][present].mean()) if present.any() else 0.0}


@EVALUATORS.register('confusion_matrix')
class ConfusionMatrix(_Confusion):
  """A picture of the confusion matrix, labelled with the class names: `confusion_matrix`."""
  name = 'confusion_matrix'

  def images(self, state, info):
    return {'confusion_matrix': pictures.confusion_matrix(np.asarray(state), info.class_names)}


@EVALUATORS.register('ece')
class CalibrationError(Evaluator):
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
    # Masked one-hot bins times the values: a small matmul (as _Confusion's) for the sums.
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


@EVALUATORS.register('misclassified')
class Misclassified(Evaluator):
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


def _normalized(features):
  return features / jnp.maximum(jnp.linalg.norm(features, axis=-1, keepdims=True), 1e-12)


@EVALUATORS.register('knn')
class NearestNeighbours(FeatureEvaluator, _HitRate):
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
    return {'bank': _normalized(jnp.asarray(features, jnp.float32)),
            'labels': jnp.asarray(labels, jnp.int32), **self._zeros()}

  def update(self, state, logits, batch):
    similarity = _normalized(batch['features']) @ state['bank'].T
    nearest, index = jax.lax.top_k(similarity, min(self.k, similarity.shape[-1]))
    num_classes = logits.shape[-1]
    votes = (jax.nn.one_hot(state['labels'][index], num_classes)
             * jnp.exp(nearest / self.temperature)[..., None]).sum(axis=1)
    return self._counted(state, votes.argmax(axis=-1) == batch['label'], batch)


@EVALUATORS.register('fewshot')
class FewShot(FeatureEvaluator, _HitRate):
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
  return [*chosen, *(report() for report in (PerClass, ConfusionMatrix)
                     if report.name not in names)]


def directions(evaluators: list[Evaluator]) -> dict[str, bool]:
  """{scalar name: True if higher is better} of all `evaluators`."""
  return {name: higher for evaluator in evaluators
          for name, higher in evaluator.directions.items()}
