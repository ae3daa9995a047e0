"""Evaluators of pooled features: `knn(k)` against a brute-force weighted vote, `fewshot(shots)`
against ridge regression solved as a least-squares problem, and both in a real run and in
--mode=eval, fitted on the training split's features."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from core import errors
from data_sources import base
from evaluators import fewshot
from evaluators import knn
import evaluators
import image_folders
from modes import evaluate
import train
from training import run_spec

NUM_CLASSES = 3
INFO = base.DatasetInfo(name='features', image_shape=(1, 1, 1), num_classes=NUM_CLASSES,
                        num_train_examples=0, num_eval_examples=0, num_test_examples=0,
                        class_names=('a', 'b', 'c'))


def _clusters(seed: int, count: int, dims: int = 8, spread: float = 1.5):
  """Features around one centre per class, overlapping (`spread`), and their labels."""
  generator = np.random.default_rng(seed)
  centres = np.random.default_rng(99).normal(size=(NUM_CLASSES, dims))
  labels = generator.integers(0, NUM_CLASSES, count)
  return (centres[labels] + spread * generator.normal(size=(count, dims))).astype(np.float32), labels


def _score(evaluator, reference, evaluated, batch_size: int = 16):
  """The evaluator fitted on `reference` and run over `evaluated` in padded, masked batches."""
  state = evaluator.fit(*reference, INFO)
  features, labels = evaluated
  for start in range(0, len(labels), batch_size):
    count = len(labels[start:start + batch_size])
    pad = batch_size - count
    batch = {'features': jnp.asarray(np.pad(features[start:start + count], ((0, pad), (0, 0)))),
             'label': jnp.asarray(np.pad(labels[start:start + count], (0, pad))),
             'mask': jnp.asarray(np.arange(batch_size) < count)}
    state = evaluator.update(state, jnp.zeros((batch_size, NUM_CLASSES)), batch)
  return evaluator.results(state, INFO)


def test_knn_is_the_weighted_vote_of_the_k_most_similar_reference_examples():
  reference, evaluated = _clusters(0, 200), _clusters(1, 70)
  for k in (1, 7, 20):
    got = _score(knn.NearestNeighbours(k=k, temperature=0.1), reference, evaluated)
    bank = reference[0] / np.linalg.norm(reference[0], axis=1, keepdims=True)
    queries = evaluated[0] / np.linalg.norm(evaluated[0], axis=1, keepdims=True)
    similarity = queries @ bank.T
    nearest = np.argsort(-similarity, axis=1)[:, :k]
    votes = np.zeros((len(queries), NUM_CLASSES))
    for row, columns in enumerate(nearest):
      np.add.at(votes[row], reference[1][columns], np.exp(similarity[row, columns] / 0.1))
    expected = float(np.mean(votes.argmax(axis=1) == evaluated[1]))
    assert got == {f'knn{k}_accuracy': pytest.approx(expected)}
    assert 0.4 < expected < 1.0  # Overlapping clusters: neither chance nor trivially perfect.


@pytest.mark.parametrize('shots,dims', [(2, 8), (30, 8)])  # Fewer and more points than dims.
def test_fewshot_is_ridge_regression_on_the_shots_of_each_class(shots, dims):
  reference, evaluated = _clusters(2, 300, dims), _clusters(3, 50, dims)
  evaluator = fewshot.FewShot(shots=shots, l2=3.0, seed=4)
  got = _score(evaluator, reference, evaluated)
  # The same shots (the seed's draw), the regression solved as least squares with the ridge
  # term as extra rows: min |Xw - Y|^2 + l2 |w|^2.
  generator = np.random.default_rng(4)
  chosen = np.concatenate([generator.permutation(np.flatnonzero(reference[1] == label))[:shots]
                           for label in range(NUM_CLASSES)])
  x = reference[0][chosen].astype(np.float64)
  mean, std = x.mean(axis=0), x.std(axis=0) + 1e-5
  design = np.hstack([(x - mean) / std, np.full((len(x), 1), 100.0)])
  targets = 2.0 * np.eye(NUM_CLASSES)[reference[1][chosen]] - 1.0
  weights = np.linalg.lstsq(np.vstack([design, np.sqrt(3.0) * np.eye(dims + 1)]),
                            np.vstack([targets, np.zeros((dims + 1, NUM_CLASSES))]),
                            rcond=None)[0]
  queries = np.hstack([(evaluated[0] - mean) / std, np.full((len(evaluated[0]), 1), 100.0)])
  expected = float(np.mean((queries @ weights).argmax(axis=1) == evaluated[1]))
  assert got == {f'fewshot{shots}_accuracy': pytest.approx(expected)}
  assert expected > 1 / NUM_CLASSES


@pytest.mark.parametrize('spec', ['knn(0)', 'knn(5, temperature=0)', 'fewshot(0)',
                                  'fewshot(5, l2=-1)'])
def test_bad_arguments_are_config_errors_naming_the_key(spec):
  with pytest.raises(errors.ConfigError) as error:
    evaluators.create(spec)
  assert error.value.key == 'evaluators'


def test_a_model_without_pooled_features_is_refused_when_resolved():
  config = default.get_config()  # The CNN.
  config.evaluators = 'accuracy|knn(5)'
  with pytest.raises(errors.ConfigError) as error:
    run_spec.resolve(config)
  assert (error.value.key, error.value.value) == ('evaluators', 'accuracy|knn(5)')


def _folder_config(root: str):
  config = default.get_config()
  config.update(dict(
      data_source='folder', dataset=root, train_split='train', eval_split='test',
      model='resnet18', preprocess='resize(32)', batch_size=8, eval_batch_size=8,
      num_epochs=1, learning_rate=0.01, precise_bn_batches=0,
      evaluators='accuracy|knn(5)|fewshot(2)'))
  return config


@pytest.mark.slow  # A whole training run, then an eval run.
def test_a_run_and_eval_mode_report_knn_and_fewshot_fitted_on_the_training_split(tmp_path):
  """A resnet18 trained one epoch on a small folder: its eval writes knn5 and fewshot2
  accuracies every epoch, fitted on the training split's features; --mode=eval of the same
  checkpoint gives the same figures (the same features of the same images)."""
  root = str(tmp_path / 'shapes')
  image_folders.make_shapes_folder(root, {'train': 12, 'test': 6}, image_sizes=(40, 60))
  workdir = str(tmp_path / 'run')
  config = _folder_config(root)
  run = run_spec.resolve(config)
  assert run.evaluation('eval').reference == 'train'
  train.train_and_evaluate(run, workdir)
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as file:
    logged = [json.loads(line) for line in file]
  evaluated = [row for row in logged if 'eval/knn5_accuracy' in row]
  assert len(evaluated) == 1
  scores = {name: evaluated[0][f'eval/{name}'] for name in ('knn5_accuracy',
                                                            'fewshot2_accuracy')}
  assert all(0.0 <= value <= 1.0 for value in scores.values())
  again = evaluate.evaluate_checkpoint(run, workdir)
  assert {name: again[f'eval/{name}'] for name in scores} == pytest.approx(scores, abs=1e-6)
