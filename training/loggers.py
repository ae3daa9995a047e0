"""Where a run's metrics go: `config.loggers`, loggers joined by '|' like the app's other
plug-in strings, e.g. 'tensorboard|jsonl|mlflow(experiment="mnist")'.

Each logger is a factory `(workdir, **options) -> clu.metric_writers.MetricWriter`, registered in
`LOGGERS`; its options are its call arguments. `tensorboard` and `jsonl` are the app's event
files and metrics.jsonl (summaries), `csv` writes metrics.csv, `mlflow` and `wandb` log to those
trackers (optional packages). A resumed run, a new process on the same workdir, continues the
tracker's same run: the run's id is kept in the workdir.
"""

import csv
import html
import json
import os
import time
import uuid

from absl import logging
from clu import metric_writers
from clu import parameter_overview
import jax
import numpy as np
import tensorflow as tf
from tensorboard.plugins.hparams import api as hp

from core import errors
from core import registry
from training import summaries

LOGGERS = registry.Registry('logger', key='loggers')
CSV_FILE = 'metrics.csv'
MLFLOW_RUN_ID_FILE = 'mlflow_run_id'
WANDB_RUN_ID_FILE = 'wandb_run_id'


class Writer(metric_writers.MetricWriter):
  """A MetricWriter that ignores every kind of summary its subclass does not override (the app
  writes no videos or audio; a CSV file holds scalars only): a logger plug-in subclasses it and
  overrides what its tracker takes."""

  def write_summaries(self, step, values, metadata=None):
    pass

  def write_scalars(self, step, scalars):
    pass

  def write_images(self, step, images):
    pass

  def write_videos(self, step, videos):
    pass

  def write_audios(self, step, audios, *, sample_rate):
    pass

  def write_texts(self, step, texts):
    pass

  def write_histograms(self, step, arrays, num_buckets=None):
    pass

  def write_hparams(self, hparams):
    pass

  def flush(self):
    pass

  def close(self):
    pass


def _number(value) -> int | float:
  """A scalar as a plain Python int (kept exact, e.g. 'epoch') or float."""
  return value if isinstance(value, int) else float(value)


def _flat_hparams(hparams) -> dict:
  """Nested hparams flattened to 'a.b' keys, without the unset ones (None)."""
  return {key: value for key, value in parameter_overview.flatten_dict(
      dict(hparams), delimiter='.').items() if value is not None}


def _image_list(batch) -> list[np.ndarray]:
  """The [H, W, C] images of an [N, H, W, C] or [H, W, C] array (clu's two image shapes)."""
  batch = np.asarray(batch)
  return list(batch) if batch.ndim == 4 else [batch]


def _read_id(path: str) -> str | None:
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as file:
    return file.read().strip() or None


def _keep_id(path: str, run_id: str) -> None:
  """Writes `run_id` to `path` atomically: a run killed meanwhile leaves the old file or the new."""
  with open(path + '.tmp', 'w', encoding='utf-8') as file:
    file.write(run_id + '\n')
  os.replace(path + '.tmp', path)


class CsvWriter(Writer):
  """Appends every scalar to a CSV file as a `step,name,value` row (long format).

  One row per value, rather than a column per metric, so that a metric first written mid-run
  (eval, test) and a resumed run appending to the same file need no new header; a spreadsheet's
  pivot table (rows: step, columns: name) gives the wide table. A resumed run writes again the
  steps after its checkpoint: the later row of a (step, name) is the one that counts.
  """

  def __init__(self, path: str):
    if os.path.exists(path):
      # A run killed while writing a row leaves it cut short: dropped, so that the file stays
      # a table and the next row starts on its own line.
      with open(path, 'rb+') as file:
        file.truncate(file.read().rfind(b'\n') + 1)
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    # Line-buffered: each row is in the file at once, for users watching the run.
    self._file = open(  # pylint: disable=consider-using-with
        path, 'a', encoding='utf-8', newline='', buffering=1)
    self._csv = csv.writer(self._file, lineterminator='\n')
    if new:
      self._csv.writerow(('step', 'name', 'value'))

  def write_scalars(self, step, scalars):
    self._csv.writerows((int(step), name, _number(value)) for name, value in scalars.items())

  def flush(self):
    self._file.flush()

  def close(self):
    self._file.close()


@LOGGERS.register('mlflow', requires='mlflow')
class MlflowWriter(Writer):
  """Logs to one MLflow run (tracking server from $MLFLOW_TRACKING_URI, as MLflow's own tools):
  scalars as metrics with their step, hparams as params, images and texts as artifacts.

  The run is in `experiment` ($MLFLOW_EXPERIMENT_NAME, else MLflow's Default), named `run_name`
  (else the workdir's name). Its id is kept in `<workdir>/mlflow_run_id`, so that a resumed run
  logs to the same run.
  """

  def __init__(self, workdir: str, experiment: str | None = None, run_name: str | None = None):
    import mlflow  # pylint: disable=g-import-not-at-top  (optional: imported when chosen)
    self._mlflow = mlflow
    id_path = os.path.join(workdir, MLFLOW_RUN_ID_FILE)
    self._run_id = _read_id(id_path)
    try:
      self._client = mlflow.MlflowClient()
      if self._run_id is None:
        self._run_id = self._client.create_run(
            self._experiment_id(experiment or os.environ.get('MLFLOW_EXPERIMENT_NAME')),
            run_name=run_name or os.path.basename(os.path.abspath(workdir)),
            tags={'workdir': os.path.abspath(workdir)}).info.run_id
        _keep_id(id_path, self._run_id)
      else:  # Resumed: a missing run (another tracking URI) fails here, naming its id.
        self._client.update_run(self._run_id, status='RUNNING')
    except mlflow.MlflowException as error:
      # The tracking store refused (MLflow 3 refuses a file: store unless
      # MLFLOW_ALLOW_FILE_STORE=true; a server that is down; a resumed run's id it lacks).
      reason = str(error).split('. ')[0]
      raise errors.ConfigError(
          f'MLflow cannot log to $MLFLOW_TRACKING_URI={mlflow.get_tracking_uri()!r}: {reason}. '
          'Point it at a tracking server or a database (sqlite:///path/mlflow.db), or drop '
          'mlflow from config.loggers.', key='loggers', value='mlflow') from None

  def _experiment_id(self, name: str | None) -> str:
    if name is None:
      return '0'  # MLflow's Default experiment.
    experiment = self._client.get_experiment_by_name(name)
    if experiment is not None:
      return experiment.experiment_id
    try:
      return self._client.create_experiment(name)
    except self._mlflow.MlflowException:  # Created meanwhile by another run, e.g. a sweep's.
      if (experiment := self._client.get_experiment_by_name(name)) is None:
        raise
      return experiment.experiment_id

  def write_scalars(self, step, scalars):
    timestamp = int(time.time() * 1000)
    self._client.log_batch(self._run_id, metrics=[
        self._mlflow.entities.Metric(name, float(value), timestamp, int(step))
        for name, value in scalars.items()])

  def write_images(self, step, images):
    for name, batch in images.items():
      batch = _image_list(batch)
      for index, image in enumerate(batch):
        key = name if len(batch) == 1 else f'{name}/{index}'
        self._client.log_image(self._run_id, image, key=key, step=int(step))

  def write_texts(self, step, texts):
    for name, text in texts.items():
      self._client.log_text(self._run_id, text, f'texts/{name}/step_{int(step)}.txt')

  def write_hparams(self, hparams):
    # MLflow params are strings of bounded length, and refuse a changed value: a resumed run
    # whose config changed keeps the first values (its config text artifact has the new ones).
    limit = self._mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
    logged = self._client.get_run(self._run_id).data.params
    params = {key: str(value)[:limit] for key, value in _flat_hparams(hparams).items()}
    changed = sorted(key for key in params.keys() & logged.keys() if params[key] != logged[key])
    if changed:
      logging.warning('MLflow run %s keeps its first values of params %s.', self._run_id, changed)
    self._client.log_batch(self._run_id, params=[
        self._mlflow.entities.Param(key, value) for key, value in params.items()
        if key not in logged])

  def close(self):
    self._client.set_terminated(self._run_id)


@LOGGERS.register('wandb', requires='wandb')
class WandbWriter(Writer):
  """Logs to one Weights & Biases run (mode from $WANDB_MODE: online, offline, disabled):
  scalars, images and histograms with their step, texts as HTML, hparams into the run's config.

  The run is in `project` and `entity` (else W&B's defaults, e.g. $WANDB_PROJECT), named after
  the workdir. Its id is kept in `<workdir>/wandb_run_id`, so that a resumed run logs to the
  same run. W&B drops values logged at a step below the run's last one: a resumed run's first
  steps (those after its checkpoint, logged before) keep their first values.
  """

  def __init__(self, workdir: str, project: str | None = None, entity: str | None = None):
    import wandb  # pylint: disable=g-import-not-at-top  (optional: imported when chosen)
    self._wandb = wandb
    id_path = os.path.join(workdir, WANDB_RUN_ID_FILE)
    run_id = _read_id(id_path) or uuid.uuid4().hex[:12]
    self._run = wandb.init(dir=workdir, id=run_id, resume='allow', project=project,
                           entity=entity, name=os.path.basename(os.path.abspath(workdir)))
    _keep_id(id_path, run_id)

  def write_scalars(self, step, scalars):
    self._run.log({name: _number(value) for name, value in scalars.items()}, step=int(step))

  def write_images(self, step, images):
    self._run.log({name: [self._wandb.Image(image) for image in _image_list(batch)]
                   for name, batch in images.items()}, step=int(step))

  def write_texts(self, step, texts):
    self._run.log({name: self._wandb.Html(f'<pre>{html.escape(text)}</pre>')
                   for name, text in texts.items()}, step=int(step))

  def write_histograms(self, step, arrays, num_buckets=None):
    self._run.log({name: self._wandb.Histogram(
        np.asarray(array), num_bins=(num_buckets or {}).get(name, 64))
                   for name, array in arrays.items()}, step=int(step))

  def write_hparams(self, hparams):
    # A resumed run may change a value (e.g. more epochs): the run's config shows the latest.
    self._run.config.update(_flat_hparams(hparams), allow_val_change=True)

  def close(self):
    self._run.finish()


class JsonlWriter(Writer):
  """Appends every scalar write to a JSON-lines file: {"step": 468, "eval/accuracy": 0.98}."""

  def __init__(self, path: str):
    # Line-buffered: each write is in the file at once, for the sweep's pruner and for users.
    self._file = open(path, 'a', encoding='utf-8', buffering=1)  # pylint: disable=consider-using-with

  def write_scalars(self, step, scalars):
    line = {'step': int(step), **{name: value if isinstance(value, int) else float(value)
                                  for name, value in scalars.items()}}
    self._file.write(json.dumps(line) + '\n')

  def flush(self):
    self._file.flush()

  def close(self):
    self._file.close()


@LOGGERS.register('tensorboard')
def tensorboard(workdir: str) -> metric_writers.MetricWriter:
  """TensorBoard event files in `workdir`."""
  return metric_writers.SummaryWriter(workdir)


@LOGGERS.register('jsonl')
def jsonl(workdir: str) -> metric_writers.MetricWriter:
  """`<workdir>/metrics.jsonl`, which the app reads back (run summary, sweeps' pruning)."""
  return JsonlWriter(os.path.join(workdir, summaries.METRICS_FILE))


@LOGGERS.register('csv')
def csv_file(workdir: str) -> metric_writers.MetricWriter:
  """`<workdir>/metrics.csv`: `step,name,value` rows."""
  return CsvWriter(os.path.join(workdir, CSV_FILE))


def check(spec: str) -> str:
  """`spec` with `jsonl` added if it lacks it (the run reads its own metrics.jsonl: the summary,
  the finished-run check and the sweep); an unknown logger (a `ConfigError`) or one whose
  package is not installed (a `MissingPackage`) refused, naming config.loggers, without creating
  anything."""
  names = LOGGERS.check_calls(spec, 'loggers')
  return spec if 'jsonl' in names else '|'.join(filter(None, (spec.strip(), 'jsonl')))


def create_writer(spec: str, workdir: str) -> metric_writers.MetricWriter:
  """The loggers of `spec` (e.g. 'tensorboard|jsonl') in one writer, written by process 0 only.

  Every process checks `spec`, so that all stop at a bad one; and all loggers are checked before
  the first is created, so that a missing package leaves no files or tracker runs behind.
  """
  check(spec)
  if jax.process_index() > 0:
    return metric_writers.MultiWriter([])
  return metric_writers.MultiWriter(
      [writer for _, _, writer in LOGGERS.create_calls(spec, 'loggers', workdir=workdir)])


# The HParams dashboard lists a run when its event files hold a session start (the hparam
# values) and, for the metric columns, an experiment config naming the metrics. clu's
# `write_hparams` only writes the former (and rejects None values), so both are written here
# with TensorBoard's API.
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
