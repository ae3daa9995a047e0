"""Pretrained weights from PyTorch: timm's and torchvision's state_dicts into the backbones.

A state_dict comes from a `.safetensors` file or a `.pth`/`.pt`/`.bin` file (read with torch's
`weights_only` unpickler, which runs no code), local or downloaded first (the Hub by name:
`backbones/hub.py`; a URL or torchvision weights name: `backbones/torch_hub.py`;
`training/init_from.py` tells config.init_from's forms apart). Each backbone family declares
its key map as data, next to its model: rules (regex on the torch key, this model's variable
path, transform name), built with `conv_rules`, `norm_rules` and `linear_rules` below, and
registered with the model (`@MODELS.register(name, key_map=...)`). The transforms are the layout
changes between torch and flax (`TRANSFORMS`). torch and safetensors are imported only when
needed.
"""

from collections.abc import Callable
import pickle
import re

from absl import logging
from flax import nnx
import jax
import numpy as np

from core import errors

# (regex matching a whole torch key, template of the model's variable path, or None for keys
# that hold nothing to load, the transform's name in TRANSFORMS).
Rule = tuple[str, str | None, str]
# Checkpoint dicts of training scripts hold the state_dict under one of these keys.
CHECKPOINT_KEYS = ('state_dict', 'model')


def conv_rules(module: str, target: str) -> tuple[Rule, ...]:
  """A torch Conv2d at `module` (a regex) to the nnx.Conv at `target` (a template)."""
  return ((rf'{module}\.weight', rf'{target}.kernel', 'conv'),
          (rf'{module}\.bias', rf'{target}.bias', 'copy'))


def linear_rules(module: str, target: str) -> tuple[Rule, ...]:
  """A torch Linear at `module` to the nnx.Linear at `target`."""
  return ((rf'{module}\.weight', rf'{target}.kernel', 'linear'),
          (rf'{module}\.bias', rf'{target}.bias', 'copy'))


def norm_rules(module: str, target: str) -> tuple[Rule, ...]:
  """A torch BatchNorm or LayerNorm at `module` to the nnx.BatchNorm or nnx.LayerNorm at
  `target`; BatchNorm's step counter has no counterpart."""
  return ((rf'{module}\.weight', rf'{target}.scale', 'copy'),
          (rf'{module}\.bias', rf'{target}.bias', 'copy'),
          (rf'{module}\.running_mean', rf'{target}.mean', 'copy'),
          (rf'{module}\.running_var', rf'{target}.var', 'copy'),
          (rf'{module}\.num_batches_tracked', None, 'copy'))


def resample_pos_embed(pos_embed: np.ndarray, variable: nnx.Variable) -> np.ndarray:
  """A ViT's position embedding (1, prefix tokens + grid, features) resampled to the grid of
  `variable` (its `grid_size` metadata) when the checkpoint's square grid differs.

  As timm's `resample_abs_pos_embed`: the prefix (class token) rows are kept, the grid is
  resized bicubically with antialiasing (torch's, which is PIL's: Keys' cubic with a = -0.5, as
  `jax.image.resize`'s).
  """
  grid_height, grid_width = variable.get_metadata()['grid_size']
  prefix_tokens = variable.shape[1] - grid_height * grid_width
  prefix, grid = pos_embed[:, :prefix_tokens], pos_embed[:, prefix_tokens:]
  side = int(round(grid.shape[1] ** 0.5))
  if (side, side) == (grid_height, grid_width) or side * side != grid.shape[1]:
    return pos_embed  # Nothing to do, or not a square grid: the shape check reports it.
  grid = grid.reshape(1, side, side, -1)
  grid = jax.image.resize(grid, (1, grid_height, grid_width, grid.shape[-1]), 'cubic')
  return np.concatenate([prefix, np.asarray(grid).reshape(1, grid_height * grid_width, -1)], 1)


# How each torch array becomes a flax one; each takes the array and the variable it goes to.
TRANSFORMS: dict[str, Callable[[np.ndarray, nnx.Variable], np.ndarray]] = {
    'copy': lambda array, variable: array,
    # OIHW -> HWIO; a depthwise kernel (O, 1, H, W) becomes flax's (H, W, 1, O) alike.
    'conv': lambda array, variable: array.transpose(2, 3, 1, 0),
    'linear': lambda array, variable: array.T,  # (out, in) -> (in, out)
    # A Linear on pooled features as the 1x1 convolution that computes it: (1, 1, in, out).
    'linear_as_conv': lambda array, variable: array.T.reshape(variable.shape),
    'reshape': lambda array, variable: array.reshape(variable.shape),  # (C, 1, 1) -> (C,)
    'pos_embed': resample_pos_embed,
}


def load_pretrained(model: nnx.Module, model_name: str, file: str,
                    exclude: tuple[str, ...] = (), path: str | None = None
                    ) -> tuple[list[str], list[str]]:
  """Loads the PyTorch state_dict in the local `file` into `model`, the backbone registered as
  `model_name`, but the variables matching a regex of `exclude`; errors name `path`, the
  config.init_from that gave the file (default: `file`).

  Arrays whose shape differs from the model's (a head for another number of classes) are left
  as initialised, and so is the head of weights that have none (timm's `num_classes=0`).
  Returns the names of the variables loaded and of the others, each with the reason. A
  `ConfigError` (key 'init_from') for a file that is unreadable, holds pickled code, or does
  not fit the architecture; a `MissingPackage` for a missing reader.
  """
  import models  # pylint: disable=g-import-not-at-top  (models imports this package)
  path = path or file
  key_map = models.MODELS.capability(model_name, 'key_map')
  if key_map is None:
    raise errors.ConfigError(
        f'config.init_from={path!r} holds PyTorch weights, which load only into the pretrained '
        f'backbones, not model {model_name!r}.', key='init_from', value=path)
  state_dict = read_state_dict(file, path)
  variables = dict(model_variables(model))
  converted, unexpected = _convert(state_dict, key_map, variables)
  # Headless weights (timm's num_classes=0: DINOv2's, SigLIP's) leave the model's whole head
  # as initialised: a new head, for the dataset's classes.
  layers = models.MODELS.capability(model_name, 'layers')
  headless = layers is not None and not any(re.search(layers.head, name) for name in converted)
  missing = [name for name in variables if name not in converted
             and not any(re.search(pattern, name) for pattern in exclude)
             and not (headless and re.search(layers.head, name))]
  if missing or unexpected:
    raise errors.ConfigError(
        f'config.init_from={path!r} does not hold the weights of a {model_name!r}: '
        f'{len(missing)} of its arrays are not there (e.g. {", ".join(missing[:3]) or "none"}), '
        f'{len(unexpected)} there are not its own (e.g. {", ".join(unexpected[:3]) or "none"}).'
        ' Pass weights of this architecture, or name the arrays to leave out in '
        'config.init_exclude.', key='init_from', value=path)
  loaded, fresh = assign(model, converted, exclude, path)
  if not loaded:  # Nothing was changed: every array's shape differs from the model's.
    raise errors.ConfigError(
        f'config.init_from={path!r} does not hold the weights of a {model_name!r}: none of its '
        'arrays has the shape of the model\'s. Pass weights of this architecture.',
        key='init_from', value=path)
  return loaded, fresh


def assign(model: nnx.Module, arrays: dict[str, np.ndarray], exclude: tuple[str, ...],
           source: str) -> tuple[list[str], list[str]]:
  """Sets each parameter and BatchNorm statistic of `model` to the array of `arrays` under its
  name (`model_variables`) where the shapes agree, but those matching a regex of `exclude`;
  logs one line. The one way weights come into a model, from PyTorch files or from this app's
  checkpoints (training/init_from.py). Returns the names loaded and the others (left as
  initialised), each with the reason."""
  loaded, fresh = [], []
  for name, variable in model_variables(model):
    array = arrays.get(name)
    if any(re.search(pattern, name) for pattern in exclude):
      fresh.append(f'{name} (init_exclude)')
    elif array is None:
      fresh.append(f'{name} (not in {source})')
    elif array.shape != variable.shape:
      fresh.append(f'{name} ({tuple(variable.shape)}, {tuple(array.shape)} there)')
    else:
      variable.set_value(jax.device_put(np.asarray(array).astype(variable.dtype),
                                        variable[...].sharding))
      loaded.append(name)
  logging.info('Initialised the model from %s: loaded %d arrays%s.', source, len(loaded),
               f'; re-initialised {len(fresh)}: {", ".join(fresh)}' if fresh else '')
  return loaded, fresh


def model_variables(model: nnx.Module) -> list[tuple[str, nnx.Variable]]:
  """('layer1.0.conv1.kernel', its Variable) for every parameter and BatchNorm statistic, named
  as a checkpoint of this app names them (after its 'model.' or 'ema.params.')."""
  return [('.'.join(map(str, path)), node) for path, node in nnx.iter_graph(model)
          if isinstance(node, (nnx.Param, nnx.BatchStat))]


def _convert(state_dict: dict[str, np.ndarray], key_map: tuple[Rule, ...],
             variables: dict[str, nnx.Variable]) -> tuple[dict[str, np.ndarray], list[str]]:
  """The arrays of `state_dict` under the model's variable names, in flax's layouts, and the
  torch keys that name none of the model's variables."""
  converted, unexpected = {}, []
  compiled = [(re.compile(pattern), template, TRANSFORMS[transform])
              for pattern, template, transform in key_map]
  for key, array in state_dict.items():
    for pattern, template, transform in compiled:
      if match := pattern.fullmatch(key):
        if template is not None:
          name = match.expand(template)
          if name in variables:
            converted[name] = transform(array, variables[name])
          else:
            unexpected.append(key)
        break
    else:
      unexpected.append(key)
  return converted, unexpected


def read_state_dict(file: str, path: str | None = None,
                    named: str | None = None) -> dict[str, np.ndarray]:
  """{torch key: float32 array} of the state_dict in the local `file`, a `.safetensors` file or
  else a torch pickle by its name, or by `named` (the URL of a download's temporary file);
  errors name `path`, the config.init_from that gave it (default: `file`)."""
  return {key: array.astype(np.float32, copy=False)
          for key, array in _reader(named or file)(file, path or file).items()
          if np.issubdtype(array.dtype, np.floating)}


def _reader(file: str) -> Callable[[str, str], dict[str, np.ndarray]]:
  """The reader of the weights file named `file`, by its suffix."""
  return _read_safetensors if file.lower().endswith('.safetensors') else _read_torch


def _require_reader(module: str, path: str):
  return errors.require(module, f'config.init_from={path!r}', key='init_from', value=path)


def _unreadable(path: str, file: str, error: Exception) -> errors.ConfigError:
  first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
  return errors.ConfigError(f'config.init_from={path!r}: {file} is not a readable state_dict '
                            f'(truncated or another format?): {first_line}',
                            key='init_from', value=path)


def _read_safetensors(file: str, path: str) -> dict[str, np.ndarray]:
  safetensors_numpy = _require_reader('safetensors.numpy', path)
  try:
    return safetensors_numpy.load_file(file)
  except Exception as error:  # pylint: disable=broad-except  (Rust errors of any kind)
    raise _unreadable(path, file, error) from None


def _read_torch(file: str, path: str) -> dict[str, np.ndarray]:
  """The tensors of a torch pickle: a state_dict, or a checkpoint dict holding one under a key
  of `CHECKPOINT_KEYS`. torch's `weights_only` unpickler refuses anything but tensors and plain
  containers, so neither a whole pickled model nor a malicious file runs code here."""
  torch = _require_reader('torch', path)
  try:
    saved = torch.load(file, map_location='cpu', weights_only=True)
  except pickle.UnpicklingError:
    raise errors.ConfigError(
        f'config.init_from={path!r}: {file} holds pickled objects other than tensors (a whole '
        'model?), which are not unpickled since that could run any code: save '
        'model.state_dict() instead.', key='init_from', value=path) from None
  except Exception as error:  # pylint: disable=broad-except  (torch raises RuntimeError & co)
    raise _unreadable(path, file, error) from None
  for key in CHECKPOINT_KEYS:
    if isinstance(saved, dict) and isinstance(saved.get(key), dict):
      saved = saved[key]
      break
  if not (isinstance(saved, dict) and saved
          and all(isinstance(value, torch.Tensor) for value in saved.values())):
    raise errors.ConfigError(
        f'config.init_from={path!r}: {file} holds no state_dict (a dict of tensors, alone or '
        f'under one of the keys {list(CHECKPOINT_KEYS)}).', key='init_from', value=path)
  # DistributedDataParallel's wrapper prefixes every key with 'module.'.
  return {key.removeprefix('module.'): value.detach().float().numpy()
          for key, value in saved.items() if value.is_floating_point()}
