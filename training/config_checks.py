"""Checks a config and workdir before any data is read or any code is compiled."""

import importlib
import inspect
import os
import tempfile

import ml_collections

import data_sources
from data_sources import augmentations
import input_pipeline
import kernels
import models
from training import optimizers
from training import profiling


_PROBE_BYTES = 1 << 20  # Written by the workdir check: a full disk fails it, an empty file not.


BEST_METRICS = ('eval_accuracy', 'eval_loss')


class ConfigError(ValueError):
  """A config value or workdir that cannot work; the message names the value and the fix."""


def _require(condition: bool, message: str) -> None:
  if not condition:
    raise ConfigError(message)


def check_config(config: ml_collections.ConfigDict, data_source: bool = True) -> None:
  """Checks every value that can be judged without the data.

  `data_source=False` leaves out the data source and dataset, for modes that read a workdir's
  saved dataset info instead of the data (predict, export).
  """
  if data_source:
    _check_data_source(config)
  _check_input(config)
  for key, valid in (('model', models.MODELS), ('optimizer', optimizers.OPTIMIZERS),
                     ('schedule', optimizers.SCHEDULES), ('cpu_kernels', kernels.CPU_KERNELS),
                     ('compute_dtype', kernels.COMPUTE_DTYPES)):
    _require(config[key] in valid,
             f'Unknown {key} {config[key]!r}: config.{key} must be one of {sorted(valid)}.')
  _check_model_options(config)
  for key in ('batch_size', 'eval_batch_size', 'num_epochs', 'steps_per_dispatch',
              'log_every_steps', 'shuffle_buffer_size', 'checkpoint_every_steps',
              'max_checkpoints_to_keep', 'grad_accum_steps'):
    _require(isinstance(config[key], int) and config[key] >= 1,
             f'config.{key}={config[key]!r} is invalid: it must be an integer >= 1.')
  num_images = config.num_misclassified_images
  _require(isinstance(num_images, int) and num_images >= 0,
           f'config.num_misclassified_images={num_images!r} is invalid: it must be an '
           'integer >= 0 (0 = no eval images).')
  _require(config.learning_rate > 0,
           f'config.learning_rate={config.learning_rate!r} is invalid: it must be > 0.')
  _require(0 <= config.label_smoothing < 1,
           f'config.label_smoothing={config.label_smoothing!r} is invalid: it must be in [0, 1) '
           '(0 = off).')
  _require(isinstance(config.profile_steps, int) and config.profile_steps >= 0,
           f'config.profile_steps={config.profile_steps!r} is invalid: it must be an integer >= 0 '
           '(0 = off).')
  _require(config.best_metric in BEST_METRICS,
           f'config.best_metric={config.best_metric!r} is invalid: it must be one of '
           f'{", ".join(BEST_METRICS)}.')
  _require(0 <= config.ema_decay < 1,
           f'config.ema_decay={config.ema_decay!r} is invalid: it must be in [0, 1) (0 = off).')
  patience = config.early_stopping_patience
  _require(isinstance(patience, int) and patience >= 0,
           f'config.early_stopping_patience={patience!r} is invalid: it must be an integer >= 0 '
           '(0 = off).')
  _require(0 <= config.momentum < 1,
           f'config.momentum={config.momentum!r} is invalid: it must be in [0, 1).')
  _require(0 <= config.warmup_epochs <= config.num_epochs,
           f'config.warmup_epochs={config.warmup_epochs!r} is invalid: it must be in '
           f'[0, num_epochs={config.num_epochs}].')


def _check_model_options(config: ml_collections.ConfigDict) -> None:
  """Checks that `config.model`'s constructor takes every option in its config section."""
  parameters = inspect.signature(models.MODELS[config.model].__init__).parameters
  if any(parameter.kind == parameter.VAR_KEYWORD for parameter in parameters.values()):
    return
  options = [name for name, parameter in parameters.items()
             if parameter.kind == parameter.KEYWORD_ONLY and name not in ('layers', 'rngs')]
  for name in models.model_options(config):
    _require(name in options,
             f'config.model_options.{config.model}.{name} is not an option of model '
             f'{config.model!r} ({models.MODELS[config.model].__name__}); its options: '
             f'{", ".join(options) or "none"}.')


def _check_data_source(config: ml_collections.ConfigDict) -> None:
  """Checks the data source and input backend, their optional packages, and the dataset name."""
  for key, valid in (('data_source', data_sources.SOURCES),
                     ('input_backend', data_sources.INPUT_BACKENDS)):
    _require(config[key] in valid,
             f'Unknown {key} {config[key]!r}: config.{key} must be one of {sorted(valid)}.')
    _require_package(key, config[key])
  if config.data_source == 'tfds':
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  (slow import)
    known = tfds.list_builders(with_community_datasets=False)
    if config.dataset.split('/')[0].split(':')[0] not in known:
      try:  # A dataset prepared in data_dir needs no registered builder: TFDS reads its files.
        tfds.builder(config.dataset, data_dir=config.data_dir)
      except Exception as error:  # TFDS raises several types; all mean "not found" here.
        raise ConfigError(
            f'Unknown dataset {config.dataset!r}: config.dataset must be a TFDS dataset name '
            "such as 'mnist', 'fashion_mnist', 'kmnist' or 'cifar10' (see tfds.list_builders()), "
            'or the name of a dataset prepared in config.data_dir (now '
            f'{config.data_dir or "TFDS default: $TFDS_DATA_DIR or ~/tensorflow_datasets"}).'
        ) from error
  elif config.data_source == 'folder':
    _require(os.path.isdir(config.dataset),
             f'Image folder {config.dataset!r} is not a directory: with '
             "config.data_source='folder', config.dataset must be the root of the layout "
             '<root>/<split>/<class name>/<image file>.')
  elif config.data_source == 'torchvision':
    import torchvision  # pylint: disable=g-import-not-at-top  (optional, checked above)
    _require(config.dataset in torchvision.datasets.__all__,
             f'Unknown torchvision dataset {config.dataset!r}: config.dataset must be a '
             "torchvision.datasets class such as 'MNIST', 'FashionMNIST' or 'CIFAR10'.")
    _require(config.data_dir is not None,
             "config.data_source='torchvision' needs config.data_dir: the root that holds the "
             'data (for MNIST: ROOT/MNIST/raw/).')


def _check_input(config: ml_collections.ConfigDict) -> None:
  """Checks image_size, in_memory and augment, and that the source and backend can serve them."""
  size = config.image_size
  _require(size is None or (isinstance(size, int) and not isinstance(size, bool) and size >= 1),
           f'config.image_size={size!r} is invalid: it must be an integer >= 1 (every image is '
           "resized to that many pixels square) or None (the dataset's own size).")
  _require(config.in_memory in input_pipeline.IN_MEMORY,
           f'Unknown in_memory {config.in_memory!r}: config.in_memory must be one of '
           f'{list(input_pipeline.IN_MEMORY)}.')
  _require(config.in_memory != 'never' or config.data_source in data_sources.STREAMING_SOURCES,
           f"config.in_memory='never' streams splits from their files, which data_source "
           f"{config.data_source!r} cannot: use in_memory='auto' or 'always', or a data_source "
           f'in {list(data_sources.STREAMING_SOURCES)}.')
  try:
    augment = augmentations.parse(config.augment)
  except ValueError as error:
    raise ConfigError(f'config.augment={config.augment!r} is invalid: {error}.') from error
  _require(config.input_backend == 'tf' or (config.in_memory != 'never' and not augment),
           f"config.input_backend={config.input_backend!r} takes in-memory splits without "
           "augmentation: use input_backend='tf' for in_memory='never' or config.augment.")


def check_augment(config: ml_collections.ConfigDict, image_shape: tuple[int, int, int]) -> None:
  """Checks that config.augment gives training images of the model's `image_shape`."""
  try:
    augmentations.check(config.augment, image_shape)
  except ValueError as error:
    raise ConfigError(f'config.augment={config.augment!r} does not fit the data: {error}.'
                      ) from error


def _require_package(key: str, value: str) -> None:
  """Imports the optional package that `config.<key>=value` needs, if any."""
  package = data_sources.OPTIONAL_PACKAGES.get(value)
  if package is None:
    return
  try:
    importlib.import_module(package)
  except ImportError as error:
    raise ConfigError(f'config.{key}={value!r} needs the {package!r} package, which is not '
                      f'installed: pip install -r requirements-extras.txt (or pip install '
                      f'{package}).') from error


def check_workdir(workdir: str) -> None:
  """Creates `workdir` if needed and checks that it takes a file of `_PROBE_BYTES`."""
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.TemporaryFile(dir=workdir) as probe:
      probe.write(b'\0' * _PROBE_BYTES)
      probe.flush()
      os.fsync(probe.fileno())
  except OSError as error:
    raise ConfigError(f'Workdir {workdir!r} is not writable ({error.strerror}): free some space '
                      'or pass a --workdir you can write to.') from error


def check_against_data(config: ml_collections.ConfigDict, num_train_examples: int) -> None:
  """Checks the values that depend on the size of the training split."""
  _require(config.batch_size <= num_train_examples,
           f'config.batch_size={config.batch_size} is larger than the {num_train_examples} '
           f'examples of split {config.train_split!r}: use a batch size in '
           f'[1, {num_train_examples}].')
  steps_per_epoch = num_train_examples // config.batch_size
  _require(config.grad_accum_steps <= steps_per_epoch,
           f'config.grad_accum_steps={config.grad_accum_steps} is more than the {steps_per_epoch} '
           f'steps of an epoch (batch_size={config.batch_size}): use at most {steps_per_epoch}.')
  num_steps = steps_per_epoch * config.num_epochs
  _require(not config.profile_steps or profiling.min_steps(config) <= num_steps,
           f'config.profile_steps={config.profile_steps} does not fit in the {num_steps} steps of '
           f'this run with its {profiling.WARMUP_STEPS} warm-up steps: use at most '
           f'{max(num_steps - profiling.min_steps(config) + config.profile_steps, 0)}.')


def check_against_devices(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Checks that every device gets an equal share of each training batch."""
  _require(config.batch_size % num_devices == 0,
           f'config.batch_size={config.batch_size} does not divide by the {num_devices} devices '
           f'(jax.device_count()): use a multiple of {num_devices}, such as '
           f'{-(-config.batch_size // num_devices) * num_devices}.')
