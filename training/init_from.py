"""Starts a model from weights trained elsewhere (config.init_from), in training and in the modes.

`init_from` names a workdir of this app (its best checkpoint, else its newest), a checkpoint
directory, or PyTorch weights of a pretrained backbone: a timm/torchvision state_dict file
(`.safetensors`, `.pth`, `.pt`, `.bin`) or a Hugging Face Hub name, `hf-hub:<repo>`, downloaded
on first use (`backbones/weights.py`, `backbones/hub.py`). Parameters of another path or shape
(a new head) start fresh, and so does the head of a run of this app trained on other class
names than the dataset's, unless config.init_keep_head.
"""

import contextlib
import os
import re

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp

from backbones import weights
from core import errors
from core import saved_config
from data_sources import base
import models
from training import checkpointing
from training import run_spec
from training import state as state_lib
from training import workdirs

_NAMES_SHOWN = 5  # Class names a log line lists, of each side.


def load(run: run_spec.Run, state: state_lib.TrainState, info: base.DatasetInfo) -> None:
  """Loads run.init_from into `state`'s model, built for the data of `info` (but the
  run.init_exclude patterns, and the head of a run trained on other classes); the EMA, if any,
  starts at the loaded weights."""
  path = run.init_from
  if weights.is_pretrained_path(path):
    weights.load_pretrained(state.model, run.model.name, path, run.init_exclude)
  else:
    load_checkpoint(state.model, path, run.init_exclude + _head_to_renew(run, info))
  if state.ema is not None:
    # Copies: the train step donates both, so they must not share buffers.
    jax.tree.map(lambda average, variable: average.set_value(jnp.copy(variable[...])),
                 state.ema.params,
                 nnx.state(state.model, state.ema.filter),
                 is_leaf=lambda x: isinstance(x, nnx.Variable))


def fetch(run: run_spec.Run) -> None:
  """Downloads run.init_from's pretrained weights into their cache, if it names some that are
  not there yet: a name the Hub lacks or a missing network is then said before the data is
  read (indexing a photo folder can take seconds), not after."""
  if run.init_from and weights.is_pretrained_path(run.init_from):
    weights.fetch(run.init_from)


def _head_to_renew(run: run_spec.Run, info: base.DatasetInfo) -> tuple[str, ...]:
  """Patterns of the head's parameters when run.init_from is a workdir trained on as many
  classes as `info` has, but named otherwise (digits 0-4, then 5-9): its head maps features to
  classes that are not these, so it starts fresh, as a head of another size does. Empty with
  run.init_keep_head, the same names, or a source whose class names are not known."""
  source = workdirs.saved_info(run.init_from)
  if (run.init_keep_head or source is None or source.class_names == info.class_names
      or len(source.class_names) != len(info.class_names)):
    return ()
  head = _head_names(run.model, info)
  shown = lambda names: ', '.join(names[:_NAMES_SHOWN]) + (', ...' if len(names) > _NAMES_SHOWN
                                                          else '')
  logging.info('config.init_from=%r was trained on the classes %s; this dataset has %s: its '
               'head (%s) starts fresh (config.init_keep_head=True keeps it).', run.init_from,
               shown(source.class_names), shown(info.class_names), ', '.join(head))
  return tuple(f'^{re.escape(name)}$' for name in head)


def _head_names(model: models.ModelSpec, info: base.DatasetInfo) -> list[str]:
  """The names of the parameters whose shape follows the number of classes: the head, for any
  registered model."""
  def shapes(num_classes: int) -> dict[str, tuple[int, ...]]:
    built = nnx.eval_shape(lambda: model.build(info.image_shape, num_classes, nnx.Rngs(0)))
    return {name: variable.get_value().shape for name, variable in weights.model_variables(built)}
  these, more = shapes(info.num_classes), shapes(info.num_classes + 1)
  return sorted(name for name, shape in these.items() if more.get(name) != shape)


def load_checkpoint(model: nnx.Module, path: str,
                    exclude: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
  """Loads into `model` the weights of a checkpoint of this app: a workdir's best (else its
  newest), or the checkpoint directory `path` names; the averaged weights when that run kept an
  EMA. Every parameter and BatchNorm statistic whose path and shape match is loaded
  (`weights.assign`), but those matching a regex of `exclude`. Returns the names loaded and the
  others with the reason; a `ConfigError` if nothing matches."""
  saved_path = checkpointing.checkpoint_path(path)
  if (source := saved_config.with_defaults(path)) is not None:
    best = run_spec.resolve(source).best
    checkpoints = checkpointing.Checkpoints(path, best.name, best.maximize, reader=True)
    with contextlib.closing(checkpoints) as saved:
      if (step := saved.best_step()) is not None:
        saved_path = os.path.join(path, checkpointing.CHECKPOINT_DIR, str(step), 'state')
  saved = checkpointing.read_state(saved_path)
  prefix = 'ema.params.' if any(name.startswith('ema.params.') for name in saved) else 'model.'
  loaded, fresh = weights.assign(
      model, {name.removeprefix(prefix): array for name, array in saved.items()
              if name.startswith(prefix)}, exclude, saved_path)
  if not loaded:
    raise errors.ConfigError(
        f'config.init_from={path!r}: no parameter of its checkpoint {saved_path} has the path '
        f'and shape of one of model {model.__class__.__name__!r}: is it the same kind of '
        'model?', key='init_from', value=path)
  return loaded, fresh
