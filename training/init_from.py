"""Starts a model from weights trained elsewhere: config.init_from, read once into a source.

`parse` is the one reading of the string (run_spec calls it, before anything else runs):
  HubWeights     `hf-hub:<org>/<name>[@<revision>]`, or `timm/<name>` where no such path
                 exists: a Hugging Face Hub repository (backbones/hub.py);
  UrlWeights     `https://.../<file>.pth` (or .pt, .bin, .safetensors), or
                 `torchvision:<Weights enum>.<member>` (backbones/torch_hub.py);
  FileWeights    a local `.safetensors`, `.pth`, `.pt` or `.bin` state_dict of timm's or
                 torchvision's layout (backbones/weights.py converts it);
  AppCheckpoint  a workdir of this app (its best checkpoint, as its own record names it, else
                 its newest), its checkpoints directory, or one checkpoint's directory.
Each source is checked for its form when parsed; `check()` downloads what is remote before any
data is read (so that a name the Hub lacks, or no network, is said first); `pretrained_cfg()` is
the preprocessing its weights were trained with; `load()` puts them into a model. Parameters of
another path or shape (a new head) start fresh, and so does the head of a run of this app
trained on other class names than the dataset's, unless config.init_keep_head.
"""

import dataclasses
import functools
import os
import re

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp

from backbones import hub
from backbones import torch_hub
from backbones import weights
from core import errors
from data_sources import base
import models
from training import checkpointing
from training import state as state_lib
from training import workdirs

_NAMES_SHOWN = 5  # Class names a log line lists, of each side.


@dataclasses.dataclass(frozen=True)
class Source:
  """Weights trained elsewhere: `path` as config.init_from gives it, the regexes of the
  variables to leave as initialised (config.init_exclude), and whether to keep the head of a run
  trained on other class names (config.init_keep_head)."""
  path: str
  exclude: tuple[str, ...] = ()
  keep_head: bool = False

  def check(self) -> None:
    """Makes the weights available (downloaded, if remote), before any data is read."""

  def pretrained_cfg(self, registered: dict) -> tuple[dict, str] | None:
    """The preprocessing the weights were trained with (timm's `pretrained_cfg` keys:
    input_size, crop_pct, interpolation, mean, std) and where that was read; `registered` is
    the model's own (its default weights'). None when the source does not say (a run of this
    app: the run's config.preprocess)."""
    del registered
    return None

  def load(self, model: nnx.Module, spec: models.ModelSpec,
           info: base.DatasetInfo) -> tuple[list[str], list[str]]:
    """Loads the weights into `model` (of `spec`, built for the data of `info`); returns the
    names loaded and the others, each with the reason."""
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class _PyTorchWeights(Source):
  """A timm or torchvision state_dict, converted by the model family's key map."""

  @functools.cached_property
  def file(self) -> str:
    """The local file of the weights (downloaded on first use; cached by its library)."""
    raise NotImplementedError

  def check(self) -> None:
    self.file  # pylint: disable=pointless-statement  (downloads it)

  def pretrained_cfg(self, registered: dict) -> tuple[dict, str] | None:
    return registered, 'timm\'s pretrained_cfg of the model'

  def load(self, model, spec, info):
    del info  # A head of another size starts fresh by its shape.
    return weights.load_pretrained(model, spec.name, self.file, self.exclude, self.path)


@dataclasses.dataclass(frozen=True)
class FileWeights(_PyTorchWeights):

  @functools.cached_property
  def file(self) -> str:
    return self.path


@dataclasses.dataclass(frozen=True)
class HubWeights(_PyTorchWeights):
  repo_id: str = ''
  revision: str | None = None  # None: the default branch.

  @functools.cached_property
  def file(self) -> str:
    return hub.download(self.path, self.repo_id, self.revision)

  def pretrained_cfg(self, registered: dict) -> tuple[dict, str]:
    """The repository's own, from its config.json, as timm reads it; the model's when the
    repository says nothing. The weights are downloaded first: a repository that cannot serve
    them is said as such."""
    self.check()
    if (own := hub.pretrained_cfg(self.path, self.repo_id, self.revision)) is not None:
      return own, f'the pretrained_cfg of {self.repo_id}\'s {hub.CONFIG_FILE}'
    return registered, (f'timm\'s pretrained_cfg of the model: {self.repo_id} has no '
                        f'{hub.CONFIG_FILE} that gives one')


@dataclasses.dataclass(frozen=True)
class UrlWeights(_PyTorchWeights):
  url: str = ''
  torchvision: bool = False  # torchvision's weights by name, which know their preprocessing.

  @functools.cached_property
  def file(self) -> str:
    return torch_hub.download(
        self.path, self.url,
        check=lambda file: weights.read_state_dict(file, self.path, named=self.url))

  def pretrained_cfg(self, registered: dict) -> tuple[dict, str]:
    if self.torchvision:
      return (torch_hub.torchvision_pretrained_cfg(self.path),
              'the torchvision weights\' transforms()')
    return super().pretrained_cfg(registered)


@dataclasses.dataclass(frozen=True)
class AppCheckpoint(Source):
  """A run of this app: its model's weights, the EMA's when it kept one."""

  def check(self) -> None:
    checkpointing.checkpoint_path(self.path)

  def load(self, model, spec, info):
    return load_checkpoint(model, self.path, self.exclude + self._head_to_renew(spec, info))

  def _head_to_renew(self, spec: models.ModelSpec, info: base.DatasetInfo) -> tuple[str, ...]:
    """Patterns of the head's parameters when the run was trained on as many classes as `info`
    has, but named otherwise (digits 0-4, then 5-9): its head maps features to classes that
    are not these, so it starts fresh, as a head of another size does. Empty with keep_head,
    the same names, or a run whose class names are not known."""
    source = workdirs.saved_info(self.path)
    if (self.keep_head or source is None or source.class_names == info.class_names
        or len(source.class_names) != len(info.class_names)):
      return ()
    head = _head_names(spec, info)
    shown = lambda names: ', '.join(names[:_NAMES_SHOWN]) + (
        ', ...' if len(names) > _NAMES_SHOWN else '')
    logging.info('config.init_from=%r was trained on the classes %s; this dataset has %s: its '
                 'head (%s) starts fresh (config.init_keep_head=True keeps it).', self.path,
                 shown(source.class_names), shown(info.class_names), ', '.join(head))
    return tuple(f'^{re.escape(name)}$' for name in head)


def parse(path: str | None, exclude: tuple[str, ...] = (),
          keep_head: bool = False) -> Source | None:
  """The source config.init_from=`path` names (None: none), its form checked: a `ConfigError`
  (key 'init_from') for a malformed Hub name, an unknown torchvision name, a URL of no weights
  file, a missing file, or a path that holds no checkpoint of this app. Nothing is downloaded
  (`Source.check`)."""
  if not path:
    return None
  options = dict(path=path, exclude=tuple(exclude), keep_head=keep_head)
  if path.startswith(hub.HUB_PREFIX) or _is_timm_name(path):
    repo_id, revision = hub.parse(path)
    return HubWeights(**options, repo_id=repo_id, revision=revision)
  if path.startswith(torch_hub.TORCHVISION_PREFIX):
    return UrlWeights(**options, url=torch_hub.torchvision_url(path), torchvision=True)
  if path.startswith(torch_hub.URL_PREFIXES):
    return UrlWeights(**options, url=torch_hub.checked_url(path, path))
  if path.lower().endswith(hub.FILE_SUFFIXES):
    if not os.path.isfile(path):
      raise errors.ConfigError(
          f'config.init_from={path!r} is not a file: pass the path of a .safetensors (or .pth, '
          '.pt, .bin) state_dict, or a Hub name (hf-hub:timm/resnet18.a1_in1k).',
          key='init_from', value=path)
    return FileWeights(**options)
  source = AppCheckpoint(**options)
  source.check()
  return source


def _is_timm_name(path: str) -> bool:
  """`timm/<name>`, the short form of timm's own repositories (as timm's model names read:
  `timm/resnet18.a1_in1k`): one slash, no weights suffix, and no such file or directory (a
  workdir that happens to be called `timm/<name>` still means that workdir)."""
  return (path.startswith(hub.TIMM_PREFIX) and path.count('/') == 1
          and len(path) > len(hub.TIMM_PREFIX) and not path.lower().endswith(hub.FILE_SUFFIXES)
          and not os.path.exists(path))


def load(source: Source, state: state_lib.TrainState, spec: models.ModelSpec,
         info: base.DatasetInfo) -> None:
  """Loads `source` into `state`'s model (of `spec`, built for the data of `info`); the EMA, if
  any, starts at the loaded weights."""
  source.load(state.model, spec, info)
  if state.ema is not None:
    # Copies: the train step donates both, so they must not share buffers.
    jax.tree.map(lambda average, variable: average.set_value(jnp.copy(variable[...])),
                 state.ema.params,
                 nnx.state(state.model, state.ema.filter),
                 is_leaf=lambda x: isinstance(x, nnx.Variable))


def _head_names(spec: models.ModelSpec, info: base.DatasetInfo) -> list[str]:
  """The names of the parameters whose shape follows the number of classes: the head, for any
  registered model."""
  def shapes(num_classes: int) -> dict[str, tuple[int, ...]]:
    built = nnx.eval_shape(lambda: spec.build(info.image_shape, num_classes, nnx.Rngs(0)))
    return {name: variable.get_value().shape for name, variable in weights.model_variables(built)}
  these, more = shapes(info.num_classes), shapes(info.num_classes + 1)
  return sorted(name for name, shape in these.items() if more.get(name) != shape)


def load_checkpoint(model: nnx.Module, path: str,
                    exclude: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
  """Loads into `model` the weights of a checkpoint of this app: a workdir's best (as its
  record names it; else its newest), or the checkpoint directory `path` names; the averaged
  weights when that run kept an EMA. Every parameter and BatchNorm statistic whose path and
  shape match is loaded (`weights.assign`), but those matching a regex of `exclude`. Returns
  the names loaded and the others with the reason; a `ConfigError` if nothing matches."""
  saved_path = checkpointing.checkpoint_path(path)
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
