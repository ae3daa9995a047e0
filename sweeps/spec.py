"""The sweep spec: `--sweep='key=...'` flags and a config's get_sweep(), checked against the config.

A key takes a list of values, `key=v1,v2,...` (a grid runs the product of the lists; a random or
TPE search picks among the values), or a range, for a random or TPE search only:

  key=uniform(a,b)        a float in [a, b]
  key=loguniform(a,b)     a float in [a, b], uniform in log space (0 < a)
  key=int(a,b)            an integer in [a, b]
  key=choice(v1,v2,...)   one of the values
"""

import dataclasses
import importlib.util
import itertools
import math
import re

from absl import flags
from ml_collections import config_flags
import optuna

from core import errors
from training import run_spec

RANGE_KINDS = ('uniform', 'loguniform', 'int', 'choice')
RANGE_FORMS = 'uniform(a,b), loguniform(a,b), int(a,b) or choice(v1,v2,...)'
_RANGE_START = re.compile(r'\s*[A-Za-z_]\w*\s*\(')  # 'name(' opens a range, known or not.
_RANGE = re.compile(r'\s*([A-Za-z_]\w*)\s*\((.*)\)\s*', re.DOTALL)


class SweepError(errors.ConfigError):
  """A sweep spec or sweep workdir that cannot work: `value` is the text, value or directory at
  fault, and `param` the swept config key it concerns (None when it concerns the whole sweep)."""
  label = 'Sweep error'

  def __init__(self, message: str, value=None, param: str | None = None):
    super().__init__(message, key='sweep', value=value, param=param)


@dataclasses.dataclass(frozen=True)
class Range:
  """Values to search: `kind` is one of RANGE_KINDS; `values` its bounds or its choices."""
  kind: str
  values: tuple  # (low, high) as numbers, or the choices as strings.

  def __str__(self) -> str:
    return f'{self.kind}({",".join(str(value) for value in self.values)})'


Values = list[str] | Range


def parse_values(key: str, text: str) -> Values:
  """'v1,v2,...' as a list of values, 'kind(...)' as a Range; SweepError if it is malformed."""
  if not _RANGE_START.match(text):
    return text.split(',') if text else []
  match = _RANGE.fullmatch(text)
  if not match:
    raise SweepError(f'Sweep of {key!r}: {text!r} is not a complete range; write one of '
                     f'{RANGE_FORMS}.', text, key)
  kind, inner = match.groups()
  if kind not in RANGE_KINDS:
    raise SweepError(f'Sweep of {key!r}: unknown distribution {kind!r} in {text!r}; use '
                     f'{RANGE_FORMS}.', text, key)
  args = tuple(arg.strip() for arg in inner.split(','))
  if kind == 'choice':
    return Range(kind, args)
  number, numbers = (int, 'integers') if kind == 'int' else (float, 'numbers')
  try:
    low, high = (number(arg) for arg in args)
  except ValueError:
    raise SweepError(f'Sweep of {key!r}: {text!r} needs two bounds that are {numbers}: '
                     f'{kind}(a,b).', text, key) from None
  if not (math.isfinite(low) and math.isfinite(high) and low < high):
    raise SweepError(f'Sweep of {key!r}: {text!r} needs finite bounds a < b.', text, key)
  if kind == 'loguniform' and low <= 0:
    raise SweepError(f'Sweep of {key!r}: {text!r} needs 0 < a (a log scale has no 0).', text,
                     key)
  return Range(kind, (low, high))


def parse_sweep_flags(specs: list[str]) -> dict[str, Values]:
  """{'key': values} from --sweep='key=v1,v2,...' and --sweep='key=kind(...)' flags."""
  sweep = {}
  for spec in specs:
    key, sep, values = spec.partition('=')
    if not sep or not key:
      raise SweepError(f"--sweep={spec!r} is not of the form 'key=value1,value2,...' or "
                       "'key=uniform(a,b)'.", spec)
    if key in sweep:
      raise SweepError(f'--sweep gives {key!r} twice: put all its values in one flag.', spec, key)
    sweep[key] = parse_values(key, values)
  return sweep


def sweep_from_config_file(config_file: str) -> dict[str, Values]:
  """The `get_sweep()` of the config file, or {} when it has none.

  get_sweep() maps each key to a list of values or to a string in the syntax of --sweep (a
  range such as 'loguniform(0.01,0.5)', or 'v1,v2,...').
  """
  path = config_file.split(':')[0]  # 'file.py:arg' passes arg to get_config().
  spec = importlib.util.spec_from_file_location('sweep_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, 'get_sweep'):
    return {}
  sweep = {}
  for key, values in module.get_sweep().items():
    if isinstance(values, str):
      sweep[key] = parse_values(key, values)
    elif isinstance(values, (list, tuple)):
      sweep[key] = [str(value) for value in values]
    else:
      raise SweepError(f'get_sweep() of {path} gives {key!r} {values!r}: give a list of values '
                       f"or a range string such as 'uniform(0.5,0.9)'.", values, key)
  return sweep


def resolve_config(config_file: str, args: tuple[str, ...]):
  """The config main.py builds from `--config=config_file` and `args`, by the same flag parser."""
  argv = ['main.py', f'--config={config_file}', *args]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', flag_values=flag_values, sys_argv=argv)
  flag_values(argv)
  return flag_values.config


_MISSING = object()


def _lookup(config, dotted_key: str):
  """config's value at `dotted_key` (such as 'model_options.cnn.dropout_rate'), or _MISSING."""
  for key in dotted_key.split('.'):
    if not hasattr(config, 'keys') or key not in config:
      return _MISSING
    config = config[key]
  return config


def check_key(config, key: str, values: Values, overrides: dict[str, str]) -> None:
  """Checks that `key` can be swept over `values` (as a list or choices) next to `overrides`."""
  if _lookup(config, key) is _MISSING:
    raise SweepError(f'Sweep key {key!r} is not in the config; valid keys: '
                     f'{", ".join(sorted(config))} (nested ones with dots, such as '
                     "'model_options.cnn.dropout_rate').", key, key)
  if key in overrides:
    raise SweepError(f'config.{key} is both swept and set by --config.{key}: drop one.',
                     overrides[key], key)
  if isinstance(values, Range):
    if values.kind != 'choice':
      return
    values = list(values.values)
  if not values or '' in values:
    raise SweepError(f'Sweep of {key!r} has an empty value list or an empty value: '
                     f"{','.join(values)!r}; give values like '{key}=a,b'.", ','.join(values),
                     key)
  if len(set(values)) < len(values):
    raise SweepError(f'Sweep of {key!r} repeats a value: {values}.', ','.join(values), key)


def _checked_config(config_file: str, flag_args: tuple[str, ...], point: str, value,
                    key: str | None = None):
  """The config of `flag_args`, checked by run_spec.resolve; SweepError naming `point` if not."""
  try:
    config = resolve_config(config_file, flag_args)
    run_spec.resolve(config)
  except (flags.Error, errors.ConfigError) as error:
    raise SweepError(f'Sweep of {point}: {error}', value, key) from error
  return config


def search_space(config_file: str, overrides: dict[str, str], sweep: dict[str, Values],
                 grid: bool) -> dict[str, optuna.distributions.BaseDistribution]:
  """The Optuna distribution of every swept key, checked before anything runs.

  A list of values searches like a choice(); a `grid` takes lists only, and every point of its
  product is checked. Every bound and choice is checked in a config (run_spec.resolve); a numeric
  range needs a numeric key, and an integer key needs int(a,b).
  """
  if not sweep:
    raise SweepError("Nothing to sweep: pass --sweep='key=v1,v2,...' (or a range such as "
                     f"'key=uniform(a,b)') or define get_sweep() in {config_file}.")
  base_args = args(overrides)
  config = resolve_config(config_file, base_args)
  space = {}
  for key, values in sweep.items():
    check_key(config, key, values, overrides)
    if grid and isinstance(values, Range):
      raise SweepError(f"Sweep of {key!r} is a range, {values}: a grid runs lists of values "
                       f"('{key}=v1,v2,...'); search ranges with --search=random or "
                       '--search=tpe.', str(values), key)
    if isinstance(values, Range) and values.kind != 'choice':
      current = _lookup(config, key)
      if isinstance(current, bool) or not isinstance(current, (int, float)):
        raise SweepError(f'Sweep of {key!r}: {values} is a numeric range, but config.{key} is '
                         f'{current!r}; give its values as choice(v1,v2,...).', str(values), key)
      if isinstance(current, int) and values.kind != 'int':
        raise SweepError(f'Sweep of {key!r}: config.{key} is an integer ({current}): use '
                         f'int(a,b), not {values}.', str(values), key)
      for bound in values.values:
        _checked_config(config_file, (*base_args, f'--config.{key}={bound}'),
                        f'{key!r}, value {bound}', bound, key)
      low, high = values.values
      space[key] = (optuna.distributions.IntDistribution(low, high) if values.kind == 'int' else
                    optuna.distributions.FloatDistribution(low, high,
                                                           log=values.kind == 'loguniform'))
      continue
    texts = values.values if isinstance(values, Range) else values
    typed = [_lookup(_checked_config(config_file, (*base_args, f'--config.{key}={text}'),
                                     f'{key!r}, value {text}', text, key), key)
             for text in texts]
    # Optuna stores choices of these types only; others (tuples) are kept as their flag text.
    choices = [value if isinstance(value, (bool, int, float, str)) else text
               for value, text in zip(typed, texts)]
    if len(set(choices)) < len(choices):
      raise SweepError(f'Sweep of {key!r} repeats a value: {list(texts)}.', ','.join(texts), key)
    space[key] = optuna.distributions.CategoricalDistribution(choices)
  if grid and len(space) > 1:  # Values that pass alone may not together (warmup > epochs).
    for point in itertools.product(*[[(key, value) for value in distribution.choices]
                                     for key, distribution in space.items()]):
      text = ','.join(f'{key}={value}' for key, value in point)
      _checked_config(config_file, base_args + args(dict(point)), f'the grid point {text}', text)
  return space


def args(params: dict) -> tuple[str, ...]:
  """The `--config.<key>=<value>` flags of main.py that set `params` (or overrides)."""
  return tuple(f'--config.{key}={value}' for key, value in params.items())
