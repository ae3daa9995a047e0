"""Eval-only mode: scores the latest checkpoint of a workdir on the whole eval split."""

import functools
import os

from absl import logging
from clu import metric_writers
import jax
import ml_collections

import data_sources
import input_pipeline
import train
from training import checkpointing
from training import config_checks
from training import parallel

EVAL_DIR = 'eval_only'  # TensorBoard run (a subdirectory of the workdir) of eval-only results.


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str,
                        checkpoint: str = 'latest') -> dict[str, float]:
  """Evaluates a checkpoint (--checkpoint) on `config.eval_split`; prints and writes the metrics."""
  config_checks.check_config(config)
  mesh = parallel.create_mesh()
  jax.set_mesh(mesh)  # As in training: the model is replicated, eval batches are sharded.
  source = data_sources.open_source(config)
  info = source.info(config)
  model, step = checkpointing.load_model(config, workdir, info, checkpoint)
  logging.info('Evaluating the checkpoint at step %d on %s %r.', step, config.dataset,
               config.eval_split)
  eval_batches = parallel.eval_batches(
      functools.partial(input_pipeline.open_split, source, config=config), config.eval_split,
      info.num_eval_examples, config, mesh)
  metrics, _ = train.evaluate(model, eval_batches)
  writer = metric_writers.create_default_writer(os.path.join(workdir, EVAL_DIR),
                                                just_logging=jax.process_index() > 0)
  writer.write_scalars(step, metrics)
  writer.flush()
  print(f'Checkpoint at step {step}, {config.dataset} {config.eval_split!r}: ' +
        ' '.join(f'{name}={value:.4f}' for name, value in metrics.items()))
  return metrics
