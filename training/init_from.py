"""Starts a model from weights trained elsewhere (config.init_from), in training and in the modes.

`init_from` names a workdir of this app (its best checkpoint, else its newest), a checkpoint
directory, or PyTorch weights of a pretrained backbone: a timm/torchvision state_dict file
(`.safetensors`, `.pth`, `.pt`, `.bin`) or a Hugging Face Hub name, `hf-hub:<repo>`, downloaded
on first use (`backbones/weights.py`, `backbones/hub.py`). Parameters of another path or shape
(a new head) start fresh.
"""

import contextlib
import os

from flax import nnx
import jax
import jax.numpy as jnp

from backbones import weights
from core import errors
from core import saved_config
from training import checkpointing
from training import run_spec
from training import state as state_lib


def load(run: run_spec.Run, state: state_lib.TrainState) -> None:
  """Loads run.init_from into `state`'s model (but the run.init_exclude patterns); the EMA, if
  any, starts at the loaded weights."""
  path = run.init_from
  if weights.is_pretrained_path(path):
    weights.load_pretrained(state.model, run.model.name, path, run.init_exclude)
  else:
    load_checkpoint(state.model, path, run.init_exclude)
  if state.ema is not None:
    # Copies: the train step donates both, so they must not share buffers.
    jax.tree.map(lambda average, variable: average.set_value(jnp.copy(variable[...])),
                 state.ema.params,
                 nnx.state(state.model, state.ema.filter),
                 is_leaf=lambda x: isinstance(x, nnx.Variable))


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
