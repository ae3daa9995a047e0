"""The app's own numeric config values (counts, rates, intervals), its test-time augmentations
and its parameter patterns, checked with nothing but the config: `check(config)`.

Light on purpose, as `saved_config`: main.py runs `check` before it imports TensorFlow and
JAX, so that `--config.num_epochs=0` is refused in a second rather than after the imports.
`run_spec.resolve` runs it too, then checks what needs the plug-ins (names, choices, options).
"""

import re

import ml_collections

from core import errors

# Keys whose value is an integer >= 1, and >= 0.
COUNTS = ('batch_size', 'num_epochs', 'log_every_steps', 'shuffle_buffer_size',
          'checkpoint_every_steps', 'max_checkpoints_to_keep', 'grad_accum_steps', 'fsdp')
NON_NEGATIVE = ('early_stopping_patience', 'profile_steps', 'precise_bn_batches',
                'linear_probe_views')
# Test-time augmentations (config.eval_tta, --tta): 'flip', the image and its left-right mirror.
# Here, not beside the code that applies them (training/calibration.py), so that main.py
# refuses an unknown one before it imports JAX.
TTA_CHOICES = ('flip',)


def require(condition: bool, key: str, value, message: str) -> None:
  """A `ConfigError` naming config.`key` and its `value`, unless `condition`."""
  if not condition:
    raise errors.ConfigError(message, key=key, value=value)


def is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def check(config: ml_collections.ConfigDict) -> None:
  """Checks the counts, the numbers in their intervals and the parameter patterns; a
  `ConfigError` naming the first bad key."""
  for key in COUNTS + NON_NEGATIVE:
    minimum = 1 if key in COUNTS else 0
    require(is_int(config[key]) and config[key] >= minimum, key, config[key],
            f'config.{key}={config[key]!r} is invalid: it must be an integer >= {minimum}'
            f'{" (0 = off)" if minimum == 0 else ""}.')
  require(config.eval_batch_size is None or (is_int(config.eval_batch_size)
                                             and config.eval_batch_size >= 1),
          'eval_batch_size', config.eval_batch_size,
          f'config.eval_batch_size={config.eval_batch_size!r} is invalid: it must be an '
          'integer >= 1, or None (4 x batch_size, at most 1000).')
  for key, valid, interval in (
      ('learning_rate', lambda value: value > 0, '> 0'),
      ('ema_decay', lambda value: 0 <= value < 1, 'in [0, 1) (0 = off)'),
      ('warmup_epochs', lambda value: 0 <= value <= config.num_epochs,
       f'in [0, num_epochs={config.num_epochs}]'),
      ('unmixed_last_epochs', lambda value: is_int(value) and 0 <= value <= config.num_epochs,
       f'an integer in [0, num_epochs={config.num_epochs}]'),
      ('early_stopping_min_delta', lambda value: value >= 0, '>= 0'),
      ('grad_clip_norm', lambda value: value >= 0, '>= 0 (0 = off)'),
      ('layer_decay', lambda value: 0 < value <= 1, 'in (0, 1] (1 = off)'),
      ('mixup_alpha', lambda value: value >= 0, '>= 0 (0 = off)'),
      ('cutmix_alpha', lambda value: value >= 0, '>= 0 (0 = off)')):
    value = config[key]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    require(number and valid(value), key, value,
            f'config.{key}={value!r} is invalid: it must be {interval}.')
  require(config.eval_tta in (None, *TTA_CHOICES), 'eval_tta', config.eval_tta,
          f'config.eval_tta={config.eval_tta!r} is invalid: it must be one of {TTA_CHOICES}, '
          'or None (off).')
  _check_parameter_patterns(config)


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
    require(isinstance(factor, (int, float)) and factor > 0, 'lr_multipliers', factor,
            f'config.lr_multipliers.{pattern}={factor!r} is invalid: it must be > 0.')
