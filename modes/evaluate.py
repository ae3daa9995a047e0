"""Eval mode: scores a checkpoint on the whole eval split, with a report.

    python main.py --workdir=runs/mnist --mode=eval [--checkpoint=best] [--config.eval_split=...]

A report by default: the evaluators of config.evaluators and, where they lack them, per_class
and confusion_matrix. Prints a short table and writes `<workdir>/eval_<split>_<step>.json`
(every metric), `<workdir>/eval_<split>_<step>.csv` (class, support, precision, recall, F1) and
each picture as `<workdir>/eval_<split>_<step>_<picture>.png` (the confusion matrix, ...); the
scalars and pictures also go to TensorBoard under `<workdir>/eval_only`. The logits are divided
by the workdir's fitted temperature when config.temperature_scaling is on, and averaged over the
image and its mirror with config.eval_tta='flip'.
"""

import csv
import json
import os
import re

from clu import metric_writers
import jax
from PIL import Image

import evaluators
import input_pipeline
import modes
from training import calibration
from training import evaluation
from training import parallel
from training import run_spec

EVAL_DIR = 'eval_only'  # TensorBoard run (a subdirectory of the workdir) of eval-only results.
_PRINTED_CLASSES = 20


def report_path(workdir: str, split: str, step: int, extension: str, part: str = '') -> str:
  """<workdir>/eval_<split>_<step>[_<part>].<extension>, the split made a file name
  ('train_90_')."""
  name = re.sub(r'[^A-Za-z0-9]+', '_', split).strip('_')
  return os.path.join(workdir, f'eval_{name}_{step}{f"_{part}" if part else ""}.{extension}')


def evaluate_checkpoint(run: run_spec.Run, workdir: str,
                        checkpoint: str = 'latest') -> dict[str, float]:
  """Evaluates a checkpoint (--checkpoint) with the run's 'eval' evaluation (config.eval_split
  and config.evaluators, with the report's); prints, writes a report."""
  mesh = parallel.create_mesh(run.fsdp)
  jax.set_mesh(mesh)  # As in training: the model placed alike, eval batches sharded.
  info = modes.dataset_info(run, workdir)
  model, step = modes.load_model(run, workdir, info, checkpoint)
  temperature = calibration.saved_temperature(workdir, run.temperature_scaling)
  model = calibration.scored(model, temperature, run.eval_tta)
  configured = run.evaluation('eval')
  scored = evaluation.Evaluation(
      configured.name, configured.split,
      evaluators.with_report(list(configured.evaluators)), configured.preprocess,
      reference=configured.reference)
  splits = run.eval_splits()
  reference_name = run_spec.reference_name(scored.name)
  data = input_pipeline.open_data(run.input, {name: splits[name] for name in splits
                                              if name in ('eval', reference_name)})
  num_examples = data.eval_sizes[scored.name]
  applied = ''.join((f', temperature {temperature:.4f}' if temperature != 1.0 else '',
                     f', test-time augmentation {run.eval_tta!r}' if run.eval_tta else ''))
  print(f'Evaluating the checkpoint at step {step} on {data.info.name} {scored.split!r} '
        f'({num_examples} examples{applied}).', flush=True)
  def batches(split: str, size: int):
    return input_pipeline.open_eval_batches(
        data, run.input, split, size, parallel.round_up(run.eval_batch_size, mesh),
        scored.preprocess, lambda batch: parallel.shard(batch, mesh))
  reference = (batches(scored.reference, data.eval_sizes[reference_name]) if scored.reference
               else None)
  result = scored.run(model, batches(scored.split, num_examples), info, num_examples, reference)
  if jax.process_index() == 0:
    writer = metric_writers.SummaryWriter(os.path.join(workdir, EVAL_DIR))
    writer.write_scalars(step, result.scalars)
    if result.images:
      writer.write_images(step, result.images)
    writer.close()
    _write_report(workdir, scored.split, step, checkpoint, result, info,
                  {'temperature': temperature, 'tta': run.eval_tta})
  return result.scalars


def _write_report(workdir: str, split: str, step: int, checkpoint: str,
                  result: evaluation.Result, info, applied: dict) -> None:
  """The JSON report, the per-class CSV, the pictures and the printed table."""
  path = report_path(workdir, split, step, 'json')
  with open(path, 'w', encoding='utf-8') as file:
    json.dump({'split': split, 'step': step, 'checkpoint': checkpoint, **applied,
               'num_examples': result.num_examples, 'metrics': result.scalars,
               'per_class': {column: values.tolist()
                             for column, values in result.per_class.items()},
               'class_names': list(info.class_names)}, file, indent=2)
  print('\n'.join(f'  {name:<28} {value if isinstance(value, int) else f"{value:.4f}"}'
                  for name, value in result.scalars.items()))
  written = [path]
  if result.per_class:
    csv_path = report_path(workdir, split, step, 'csv')
    columns = ('support', 'precision', 'recall', 'f1')
    rows = [(name, *(result.per_class[column][k] for column in columns))
            for k, name in enumerate(info.class_names)]
    with open(csv_path, 'w', newline='', encoding='utf-8') as file:
      writer = csv.writer(file)
      writer.writerow(('class', *columns))
      writer.writerows((name, support, *(f'{value:.6f}' for value in scores))
                       for name, support, *scores in rows)
    width = max(len('class'), *(len(name) for name, *_ in rows[:_PRINTED_CLASSES]))
    print(f'  {"class":<{width}}  support  precision  recall      f1')
    for name, support, precision, recall, f1 in rows[:_PRINTED_CLASSES]:
      print(f'  {name:<{width}}  {support:>7}  {precision:>9.4f}  {recall:>6.4f}  {f1:>6.4f}')
    if len(rows) > _PRINTED_CLASSES:
      print(f'  ({len(rows) - _PRINTED_CLASSES} more classes in the CSV)')
    written.append(csv_path)
  for name, picture in result.images.items():
    written.append(report_path(workdir, split, step, 'png', name.split('/')[-1]))
    Image.fromarray(picture).save(written[-1])
  print(f'Report: {", ".join(written)}')
