"""What a run reads of its own metrics and how it shows its config: `<workdir>/metrics.jsonl`
(one JSON object per write, written by the `jsonl` logger in training/loggers.py; the summary,
the finished-run check and the sweep's pruner read it) and the config as TensorBoard HParams.

The HParams dashboard lists a run when its event files hold a session start (the hparam values)
and, for the metric columns, an experiment config naming the metrics. clu's `write_hparams` only
writes the former (and rejects None values), so both are written here with TensorBoard's API.
"""

import json
import os

from clu import metric_writers
from clu import parameter_overview
import jax
import tensorflow as tf
from tensorboard.plugins.hparams import api as hp

METRICS_FILE = 'metrics.jsonl'


def read_metrics(workdir: str) -> dict[int, dict[str, float]]:
  """{step: {name: value}} of `workdir`'s metrics.jsonl; a later write of a step wins (a
  resumed run writes again the steps after its checkpoint)."""
  path = os.path.join(workdir, METRICS_FILE)
  by_step = {}
  if os.path.exists(path):
    with open(path, encoding='utf-8') as file:
      for line in file:
        try:
          record = json.loads(line)
        except ValueError:  # A line cut short by a killed run.
          continue
        by_step.setdefault(record.pop('step'), {}).update(record)
  return by_step


def write_config(writer: metric_writers.MetricWriter, workdir: str, settings: dict,
                 metrics: list[str]) -> None:
  """Writes the run's config (`settings`, as JSON values) as HParams (with these metric
  columns) and as a text summary."""
  # TensorBoard hparams are bool/int/float/str: tuples are shown as their text, and an unset
  # placeholder (None) has no value to show.
  flat = parameter_overview.flatten_dict(settings, delimiter='.')
  hparams = {key: str(value) if isinstance(value, (tuple, list)) else value
             for key, value in flat.items() if value is not None}
  if jax.process_index() == 0:  # The metric columns; the values go through every logger.
    hparams_writer = tf.summary.create_file_writer(workdir)
    with hparams_writer.as_default():
      hp.hparams_config(hparams=[hp.HParam(key) for key in sorted(hparams)],
                        metrics=[hp.Metric(tag) for tag in metrics])
    hparams_writer.close()
  writer.write_hparams(hparams)
  # Indented: markdown renders it as a code block, one `key: value` per line.
  text = '\n'.join(f'{key}: {value}' for key, value in sorted(flat.items()))
  writer.write_texts(0, {'config': '    ' + text.replace('\n', '\n    ')})
