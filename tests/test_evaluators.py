"""Evaluators equal a direct computation, whatever the padding and batching; a new one is one
file."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import errors
from data_sources import base
import evaluators

NUM_CLASSES = 5
INFO = base.DatasetInfo(name='toy', image_shape=(2, 2, 1), num_classes=NUM_CLASSES,
                        num_train_examples=1, num_eval_examples=1,
                        class_names=('a', 'b', 'c', 'd', 'e'))


def _imbalanced(seed=0, num=203):
  """Labels mostly of class 0, a few of 1 and 2, class 3 never a label; logits that never
  predict class 4 (and sometimes predict the absent class 3)."""
  rng = np.random.default_rng(seed)
  labels = rng.choice([0, 1, 2, 4], size=num, p=[0.7, 0.15, 0.1, 0.05]).astype(np.int32)
  logits = rng.normal(size=(num, NUM_CLASSES)).astype(np.float32)
  logits[np.arange(num), labels] += rng.choice([0.0, 3.0], size=num, p=[0.3, 0.7])
  logits[:, 4] -= 10.0  # Never predicted.
  return logits, labels


def _run(spec, logits, labels, batch_size):
  """The evaluators' results over `logits` in padded, masked batches of `batch_size`."""
  chosen = evaluators.create(spec)
  states = [evaluator.init(INFO) for evaluator in chosen]
  pad = -len(labels) % batch_size
  logits = np.concatenate([logits, np.full((pad, NUM_CLASSES), 100.0, np.float32)])
  labels = np.concatenate([labels, np.zeros(pad, np.int32)])
  mask = np.arange(len(labels)) < len(labels) - pad
  images = np.arange(len(labels), dtype=np.float32)[:, None, None, None] * np.ones((1, 2, 2, 1))
  update = jax.jit(lambda states, logits, batch: [
      evaluator.update(state, logits, batch) for evaluator, state in zip(chosen, states)])
  for start in range(0, len(labels), batch_size):
    window = slice(start, start + batch_size)
    states = update(states, jnp.asarray(logits[window]),
                    {'image': images[window], 'label': labels[window], 'mask': mask[window]})
  states = jax.tree.map(np.asarray, states)
  results, per_class, pictures = {}, {}, {}
  for evaluator, state in zip(chosen, states):
    results.update(evaluator.results(state, INFO))
    per_class.update(evaluator.per_class(state, INFO))
    pictures.update(evaluator.images(state, INFO))
  return results, per_class, pictures, states


def _expected(logits, labels):
  """Written out with NumPy, as scikit-learn defines them (zero_division=0)."""
  predicted = logits.argmax(axis=1)
  log_probs = logits - logits.max(1, keepdims=True)
  log_probs -= np.log(np.exp(log_probs).sum(1, keepdims=True))
  precision, recall, f1, support = [], [], [], []
  for k in range(NUM_CLASSES):
    tp = np.sum((predicted == k) & (labels == k))
    p = tp / np.sum(predicted == k) if np.any(predicted == k) else 0.0
    r = tp / np.sum(labels == k) if np.any(labels == k) else 0.0
    precision.append(p)
    recall.append(r)
    f1.append(2 * p * r / (p + r) if p + r else 0.0)
    support.append(np.sum(labels == k))
  probabilities = np.exp(log_probs)
  occurring = np.union1d(labels, predicted)
  present = np.unique(labels)
  top3 = np.argsort(-logits, axis=1)[:, :3]
  return {
      'loss': -log_probs[np.arange(len(labels)), labels].mean(),
      'accuracy': np.mean(predicted == labels),
      'top3_accuracy': np.mean([label in row for label, row in zip(labels, top3)]),
      'macro_precision': np.mean(np.array(precision)[occurring]),
      'macro_recall': np.mean(np.array(recall)[occurring]),
      'macro_f1': np.mean(np.array(f1)[occurring]),
      'balanced_accuracy': np.mean(np.array(recall)[present]),
      'ece': _numpy_ece(probabilities.max(axis=1), predicted == labels),
  }, {'precision': precision, 'recall': recall, 'f1': f1, 'support': support}


def _numpy_ece(confidences, correct, bins=15):
  """Guo et al.'s ECE, bin by bin: bin m holds the confidences in ((m-1)/bins, m/bins]."""
  ece = 0.0
  for m in range(bins):
    in_bin = (confidences > m / bins) & (confidences <= (m + 1) / bins)
    if in_bin.any():
      ece += in_bin.mean() * abs(correct[in_bin].mean() - confidences[in_bin].mean())
  return ece


SPEC = ('loss|accuracy|top_k(3)|per_class|balanced_accuracy|confusion_matrix|misclassified(4)'
        '|ece')


@pytest.mark.parametrize('batch_size', [203, 64, 7])
def test_every_evaluator_equals_the_direct_computation(batch_size):
  logits, labels = _imbalanced()
  results, per_class, pictures, _ = _run(SPEC, logits, labels, batch_size)
  expected, expected_per_class = _expected(logits, labels)
  assert results.keys() == expected.keys()
  for name, value in expected.items():
    assert results[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
  for column, values in expected_per_class.items():
    np.testing.assert_allclose(per_class[column], values, rtol=1e-6, err_msg=column)
  assert per_class['support'][3] == 0 and per_class['precision'][4] == 0  # The edge classes.
  assert set(pictures) == {'confusion_matrix', 'misclassified', 'reliability_diagram'}


def test_ece_of_a_hand_checked_split_counts_every_example_once():
  # Confidences (top probabilities) 0.9 right and 0.88 wrong share the bin (13/15, 14/15]:
  # accuracy 0.5, confidence 0.89, gap 0.39; 0.5 right: gap 0.5; 0.7 right: gap 0.3. Over the
  # split: (2 * 0.39 + 0.5 + 0.3) / 4 = 0.395. Batches of 3 put the last example with padding
  # (a confident right answer, were it counted); the mean of the batches' ECEs would be 0.363.
  probabilities = np.array([[0.9, 0.025, 0.025, 0.025, 0.025], [0.88, 0.03, 0.03, 0.03, 0.03],
                            [0.5, 0.2, 0.1, 0.1, 0.1], [0.1, 0.7, 0.1, 0.05, 0.05]])
  labels = np.array([0, 1, 0, 1], np.int32)
  results, _, pictures, states = _run('ece', np.log(probabilities).astype(np.float32), labels,
                                      batch_size=3)
  assert results['ece'] == pytest.approx(0.395, abs=1e-6)
  assert results['ece'] == pytest.approx(_numpy_ece(probabilities.max(axis=1),
                                                    probabilities.argmax(axis=1) == labels))
  state, = states
  assert state['count'].sum() == 4 and state['count'][13] == 2 and state['correct'][13] == 1
  assert pictures['reliability_diagram'].dtype == np.uint8


def test_misclassified_keeps_the_first_errors_in_order():
  logits, labels = _imbalanced()
  wrong = np.flatnonzero(logits.argmax(1) != labels)[:4]
  for batch_size in (203, 5):
    *_, states = _run('misclassified(4)', logits, labels, batch_size)
    state, = states
    np.testing.assert_array_equal(state['images'][:, 0, 0, 0], wrong)  # Images carry their index.
    np.testing.assert_array_equal(state['labels'], labels[wrong])
    np.testing.assert_array_equal(state['predictions'], logits.argmax(1)[wrong])
    assert state['found'] == np.sum(logits.argmax(1) != labels)


def test_directions_and_bad_specs():
  assert evaluators.directions(evaluators.create('loss|accuracy|top_k(5)')) == {
      'loss': False, 'accuracy': True, 'top5_accuracy': True}
  for spec in ('top_k(0)', 'accuracy|accuracy', 'f2_score', 'misclassified(count=-1)',
               'ece(bins=0)'):
    with pytest.raises(errors.ConfigError) as error:
      evaluators.create(spec)
    assert (error.value.key, error.value.value) == ('evaluators', spec)


def test_the_report_adds_per_class_and_the_confusion_matrix_once():
  names = lambda spec: [evaluator.name for evaluator in
                        evaluators.with_report(evaluators.create(spec))]
  assert names('loss|accuracy') == ['loss', 'accuracy', 'per_class', 'confusion_matrix']
  assert names('confusion_matrix|ece|per_class') == ['confusion_matrix', 'ece', 'per_class']


_NEW_EVALUATOR = '''
"""`wrong_rate`: the share of examples whose highest logit is not their label."""

import evaluators
from evaluators import EVALUATORS


@EVALUATORS.register('wrong_rate')
class WrongRate(evaluators.HitRate):
  name = 'wrong_rate'
  directions = {'wrong_rate': False}

  def init(self, info):
    return self._zeros()

  def update(self, state, logits, batch):
    return self._counted(state, logits.argmax(axis=-1) != batch['label'], batch)
'''

# Adds a directory to the evaluators package's path before the registry first looks, then
# evaluates one batch (4 examples, 2 right, and 1 of padding) with the new evaluator beside a
# built-in one; prints the registry's names and the results.
_FIND_IT_SCRIPT = r'''
import json, sys
import numpy as np
import evaluators
from data_sources import base
evaluators.__path__.append(sys.argv[1])
info = base.DatasetInfo(name='toy', image_shape=(1, 1, 1), num_classes=3,
                        num_train_examples=1, num_eval_examples=1)
batch = {'label': np.array([0, 1, 1, 2, 0]), 'mask': np.array([True] * 4 + [False])}
logits = 5.0 * np.eye(3, dtype=np.float32)[[0, 1, 2, 0, 1]]
results = {}
for evaluator in evaluators.create('accuracy|wrong_rate'):
  results.update(evaluator.results(evaluator.update(evaluator.init(info), logits, batch), info))
print('RESULT', json.dumps({'names': evaluators.EVALUATORS.names(), 'results': results}))
'''


@pytest.mark.slow
def test_an_evaluator_added_as_one_file_is_found_by_the_registry(tmp_path):
  (tmp_path / 'wrong_rate.py').write_text(_NEW_EVALUATOR)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run([sys.executable, '-c', _FIND_IT_SCRIPT, str(tmp_path)], cwd=root,
                          env={**os.environ, 'JAX_PLATFORMS': 'cpu'}, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.split('RESULT ')[-1])
  assert 'wrong_rate' in out['names'] and 'accuracy' in out['names']
  assert out['results'] == {'accuracy': 0.5, 'wrong_rate': 0.5}
