"""Imported PyTorch weights in the app: `init_from` checked before any data is read, and
`--mode=eval`/`--mode=predict` scoring a backbone's imported weights before any training."""

import csv
import os

import numpy as np
import pytest

from configs import default
from core import errors
import image_folders
import input_pipeline
from modes import evaluate
from modes import predict
from training import run_spec
from tests.helpers.optional import requires_extras


def _config(root: str, weights: str):
  config = default.get_config()
  config.update(dict(data_source='folder', dataset=root, train_split='train', eval_split='test',
                     model='resnet18', init_from=weights, preprocess='resize(64)',
                     eval_batch_size=8, evaluators='accuracy|per_class'))
  return config


def test_eval_and_predict_score_imported_weights_before_training(tmp_path):
  """A timm resnet18 (seeded random weights, 3 classes) saved as safetensors: eval's accuracy
  on a generated folder is timm's own on the same prepared images, and predict classifies
  every readable file."""
  requires_extras('timm', 'torch', 'safetensors')
  import safetensors.torch  # pylint: disable=g-import-not-at-top
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  root = str(tmp_path / 'shapes')
  files = image_folders.make_shapes_folder(root, {'train': 4, 'test': 6}, image_sizes=(40, 90))
  torch.manual_seed(0)
  net = timm.create_model('resnet18', pretrained=False, num_classes=3).eval()
  weights = str(tmp_path / 'resnet18.safetensors')
  safetensors.torch.save_file(net.state_dict(), weights)
  config = _config(root, weights)
  workdir = str(tmp_path / 'workdir')

  scores = evaluate.evaluate_checkpoint(run_spec.resolve(config), workdir)
  run = run_spec.resolve(config)
  data = input_pipeline.open_data(run.input, run.eval_splits())
  test = input_pipeline.open_split(data, 'test', run.input)
  with torch.no_grad():
    logits = net(torch.from_numpy(test.images.astype(np.float32) / 255).permute(0, 3, 1, 2))
  expected = float((logits.argmax(-1).numpy() == test.labels).mean())
  assert scores['eval/num_examples'] == len(files['test']) == 18
  assert scores['eval/accuracy'] == pytest.approx(expected)

  # Into a workdir of its own that does not exist yet: predict creates it.
  predictions = predict.predict(run, str(tmp_path / 'predictions'), os.path.join(root, 'test'))
  with open(predictions, newline='', encoding='utf-8') as file:
    rows = list(csv.reader(file))
  assert len(rows) == 1 + 18 and rows[0] == ['file', 'class', 'probability']


@pytest.mark.parametrize('init_from', ['no_such_weights.safetensors', 'no/such/workdir'])
def test_a_missing_init_from_is_refused_before_any_data_is_read(tmp_path, init_from):
  config = _config(str(tmp_path / 'no_such_folder'), str(tmp_path / init_from))
  with pytest.raises(errors.ConfigError) as error:
    run_spec.resolve(config)
  assert (error.value.key, error.value.value) == ('init_from', str(tmp_path / init_from))
