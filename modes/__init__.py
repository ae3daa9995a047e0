"""The modes besides training: eval, export and predict, each on a trained workdir.

Each reads the config and the dataset info that training saved in the workdir, so it needs only
`--workdir` (and `--config.<key>=<value>` for what it changes, such as the eval split), and
builds the model of a checkpoint (`--checkpoint=latest|best|STEP`) exactly as training did.
"""

import contextlib

from absl import logging
from flax import nnx

import input_pipeline
from data_sources import base
from training import checkpointing
from training import init_from
from training import run_spec
from training import state as state_lib
from training import workdirs


def dataset_info(run: run_spec.Run, workdir: str) -> base.DatasetInfo:
  """The data's info saved in `workdir` by training, or (an older workdir) the data's own."""
  return (workdirs.saved_info(workdir)
          or input_pipeline.open_data(run.input, run.eval_splits()).info)


def load_model(run: run_spec.Run, workdir: str, info: base.DatasetInfo,
               checkpoint: str = 'latest') -> tuple[nnx.Module, int]:
  """The model of a checkpoint in `workdir`, in eval mode, with the EMA weights when the run
  averaged them; and the checkpoint's step. Without a checkpoint there, the weights of
  config.init_from (step 0), so that imported weights are scored or used before any training.
  A `CheckpointError` if there is neither."""
  checkpoints = checkpointing.Checkpoints(workdir, run.best.name, run.best.maximize,
                                          reader=True)
  imported = run.init_from and not checkpoints.all_steps()
  # The schedule's values are never used; a checkpoint's state needs the structure only
  # (initialising it would compile a program as large as the model's).
  state = state_lib.create(run.model, info, run.optimization,
                           run.optimization.learning_rate_schedule(steps_per_epoch=1),
                           seed=run.seed, ema_decay=run.ema_decay, abstract=not imported)
  with contextlib.closing(checkpoints):
    if imported:
      logging.info('No checkpoint in %s: the model of config.init_from=%r.',
                   checkpoints.directory, run.init_from.path)
      init_from.load(run.init_from, state, run.model, info)
      step = 0
    else:
      step = checkpoints.restore(state, checkpoint)
  model = state.eval_model()
  model.eval()
  return model, step
