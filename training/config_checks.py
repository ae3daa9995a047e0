"""Checks a config before any data is read or any code is compiled, and against the data.

Each plug-in checks its own options (its registry refuses names its signature does not take,
and the plug-in judges the values); this module checks the app's own keys and what crosses
plug-ins: the best metric against the evaluators, the batch size against the devices and the
training split.
"""

import re

import ml_collections

from core import errors
import data_sources
from data_sources import base
import input_pipeline
import kernels
import models
import preprocessing
from training import evaluators
from training import losses
from training import optimizers

# Keys whose value is an integer >= 1, and >= 0.
_COUNTS = ('batch_size', 'eval_batch_size', 'num_epochs', 'log_every_steps',
           'shuffle_buffer_size', 'checkpoint_every_steps', 'max_checkpoints_to_keep',
           'grad_accum_steps')
_NON_NEGATIVE = ('early_stopping_patience', 'profile_steps', 'precise_bn_batches')
_CHOICES = {'in_memory': input_pipeline.IN_MEMORY, 'input_backend': input_pipeline.INPUT_BACKENDS,
            'nonfinite': optimizers.NONFINITE}
_REGISTRIES = (data_sources.SOURCES, models.MODELS, losses.LOSSES, optimizers.OPTIMIZERS,
               optimizers.SCHEDULES)
EVAL_SPLIT = 'eval'  # The prefix of the eval split's metrics, the only split that picks.


def _require(condition: bool, key: str, value, message: str) -> None:
  if not condition:
    raise errors.ConfigError(message, key=key, value=value)


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def check_config(config: ml_collections.ConfigDict) -> None:
  """Checks every value that can be judged without the data."""
  for key in _COUNTS + _NON_NEGATIVE:
    minimum = 1 if key in _COUNTS else 0
    _require(_is_int(config[key]) and config[key] >= minimum, key, config[key],
             f'config.{key}={config[key]!r} is invalid: it must be an integer >= {minimum}'
             f'{" (0 = off)" if minimum == 0 else ""}.')
  for key, valid in _CHOICES.items():
    _require(config[key] in valid, key, config[key],
             f'Unknown {key} {config[key]!r}: config.{key} must be one of {list(valid)}.')
  for key, valid, interval in (
      ('learning_rate', lambda value: value > 0, '> 0'),
      ('ema_decay', lambda value: 0 <= value < 1, 'in [0, 1) (0 = off)'),
      ('warmup_epochs', lambda value: 0 <= value <= config.num_epochs,
       f'in [0, num_epochs={config.num_epochs}]'),
      ('unmixed_last_epochs', lambda value: _is_int(value) and 0 <= value <= config.num_epochs,
       f'an integer in [0, num_epochs={config.num_epochs}]'),
      ('early_stopping_min_delta', lambda value: value >= 0, '>= 0'),
      ('grad_clip_norm', lambda value: value >= 0, '>= 0 (0 = off)'),
      ('mixup_alpha', lambda value: value >= 0, '>= 0 (0 = off)'),
      ('cutmix_alpha', lambda value: value >= 0, '>= 0 (0 = off)')):
    value = config[key]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    _require(number and valid(value), key, value,
             f'config.{key}={value!r} is invalid: it must be {interval}.')
  _check_parameter_patterns(config)
  for registry in _REGISTRIES:
    registry.check(config)
  # Checks the values only: a named backend keeps JAX (and its accelerators) unstarted.
  kernels.select_layers(config.cpu_kernels, backend='cpu', compute_dtype=config.compute_dtype)
  preprocessing.parse(config.preprocess)
  input_pipeline.check_input(config)
  evaluators.of_split(config, 'test')
  check_best_metric(config)


def _check_parameter_patterns(config: ml_collections.ConfigDict) -> None:
  """Checks config.freeze and config.init_exclude (regular expressions) and
  config.lr_multipliers (pattern: factor)."""
  patterns = [(key, pattern) for key in ('freeze', 'init_exclude') for pattern in config[key]] + [
      ('lr_multipliers', pattern) for pattern in config.lr_multipliers]
  for key, pattern in patterns:
    try:
      re.compile(pattern)
    except (re.error, TypeError) as error:
      raise errors.ConfigError(f'config.{key} has {pattern!r}, which is not a regular '
                               f'expression ({error}).', key=key, value=pattern) from None
  for pattern, factor in config.lr_multipliers.items():
    _require(isinstance(factor, (int, float)) and factor > 0, 'lr_multipliers', factor,
             f'config.lr_multipliers.{pattern}={factor!r} is invalid: it must be > 0.')


def check_best_metric(config: ml_collections.ConfigDict) -> bool:
  """Checks `config.best_metric` against the evaluators; returns whether higher is better."""
  directions = evaluators.directions(evaluators.of_split(config, EVAL_SPLIT))
  split, _, name = config.best_metric.partition('/')
  valid = [f'{EVAL_SPLIT}/{metric}' for metric in directions]
  _require(split == EVAL_SPLIT and name in directions, 'best_metric', config.best_metric,
           f'config.best_metric={config.best_metric!r} is invalid: it must be a scalar of the '
           f'eval split that config.evaluators computes: one of {valid}.')
  return directions[name]


def check_against_data(config: ml_collections.ConfigDict, info: base.DatasetInfo,
                       num_devices: int) -> None:
  """Checks the values that depend on the training split's size and the device count."""
  num_train_examples = info.num_train_examples
  _require(config.batch_size <= num_train_examples, 'batch_size', config.batch_size,
           f'config.batch_size={config.batch_size} is larger than the {num_train_examples} '
           f'examples of split {config.train_split!r}: use a batch size in '
           f'[1, {num_train_examples}].')
  steps_per_epoch = num_train_examples // config.batch_size
  _require(config.grad_accum_steps <= steps_per_epoch, 'grad_accum_steps',
           config.grad_accum_steps,
           f'config.grad_accum_steps={config.grad_accum_steps} is more than the {steps_per_epoch} '
           f'steps of an epoch (batch_size={config.batch_size}): use at most {steps_per_epoch}.')
  _require(config.batch_size % num_devices == 0, 'batch_size', config.batch_size,
           f'config.batch_size={config.batch_size} does not divide by the {num_devices} devices '
           f'(jax.device_count()): use a multiple of {num_devices}, such as '
           f'{-(-config.batch_size // num_devices) * num_devices}.')
