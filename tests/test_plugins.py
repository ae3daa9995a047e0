"""Each kind of plug-in is added in one file outside the app's tree (tests/helpers/plugins.py)
and trained and exported with from config values alone: a model, a data source, a preprocessing
op, a loss, an optimizer, an evaluator, a logger and an export format. Nothing in the app names
them: their registrations are the whole change.
"""

import json
import os

import pytest

from core import errors
from modes import export
from modes import model_card
import train
from training import run_spec
from training import summaries
from tests.helpers import plugins


def test_one_of_each_kind_trains_from_the_config_alone(tmp_path):
  metrics = train.train_and_evaluate(run_spec.resolve(plugins.stripes_config()), str(tmp_path))
  assert metrics['eval/accuracy'] >= 0.9, metrics  # Stripes' orientation, from any phase.
  assert 0.5 <= metrics['eval/mean_confidence'] <= 1.0
  written = summaries.read_metrics(str(tmp_path))
  assert sum('eval/mean_confidence' in values for values in written.values()) == 8
  with open(os.path.join(tmp_path, plugins.LOG_FILE), encoding='utf-8') as file:
    logged = [json.loads(line) for line in file]
  # The logger got what metrics.jsonl got: every epoch's evaluation, by step.
  assert {(line['step'], line['value']) for line in logged
          if line['name'] == 'eval/mean_confidence'} == {
              (step, values['eval/mean_confidence']) for step, values in written.items()
              if 'eval/mean_confidence' in values}
  # The export format: written, checked against the JAX model by its own runtime, carded.
  path = export.export(run_spec.resolve(plugins.stripes_config()), str(tmp_path),
                       'cpu_stablehlo_for_test')
  assert path == os.path.join(tmp_path, plugins.CpuStableHLO.directory, 'model.bin')
  with open(os.path.join(os.path.dirname(path), model_card.JSON_FILE), encoding='utf-8') as file:
    card = json.load(file)
  assert card['format_details'] == {'platforms': ['cpu'], 'classes': 2}


@pytest.mark.parametrize('section,options,key', [
    ('model_options', {'tiny_for_test': {'depth': 2}}, 'model_options.tiny_for_test.depth'),
    ('data_source_options', {'stripes_for_test': {'size': 2}},
     'data_source_options.stripes_for_test'),
    ('loss_options', {'squared_for_test': {'margin': 1.0}}, 'loss_options.squared_for_test.margin'),
    ('optimizer_options', {'sign_sgd_for_test': {'nesterov': True}},
     'optimizer_options.sign_sgd_for_test.nesterov'),
    ('loggers', None, 'loggers'),
])
def test_their_options_are_checked_by_their_signatures(tmp_path, section, options, key):
  config = plugins.stripes_config()
  if section == 'loggers':
    config.loggers = 'jsonl|scalars_for_test(path="x")'
  else:
    config[section].update(options)
  with pytest.raises(errors.ConfigError) as error:
    train.train_and_evaluate(run_spec.resolve(config), str(tmp_path))
  assert error.value.key == key
