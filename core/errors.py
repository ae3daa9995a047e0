"""Typed user errors: each ends the run as one line naming the value at fault and the fix.

A `UserError` is a mistake or a state of the world (a bad value, missing data, a busy workdir,
a full disk), never a bug: `main.py` prints it as `<label>: <message>` without a traceback.
Each type has fields that say what is wrong (the config key, the path, the step...), so callers
and tests can act on the fields instead of parsing the sentence.
"""

import importlib
from typing import Any


class UserError(Exception):
  """Base of the errors a user can fix; `fields` names the values at fault."""
  label = 'Error'  # What main.py prints before the message.
  required: tuple[str, ...] = ()  # Fields every error of this type carries.

  def __init__(self, message: str, **fields: Any):
    missing = set(self.required) - fields.keys()
    if missing:
      raise TypeError(f'{type(self).__name__} needs the fields {sorted(missing)}')
    super().__init__(message)
    self.fields = fields
    self.__dict__.update(fields)

  def one_line(self) -> str:
    return f'{self.label}: {" ".join(str(self).split())}'


class ConfigError(UserError):
  """A config value that cannot work: `key` (dotted, as in --config.<key>) and its `value`."""
  label = 'Config error'
  required = ('key', 'value')


class MissingPackage(ConfigError):
  """A config value that needs an optional package (`package`) that is not installed."""
  required = ('key', 'value', 'package')


class DownloadError(ConfigError):
  """Weights named by `key`'s `value` (a Hub name) that cannot be had: `reason` says why, one of
  'no_network', 'repository_not_found', 'revision_not_found', 'file_not_found', 'gated',
  'offline_not_cached', 'http_error', 'incomplete', 'hash_mismatch'."""
  label = 'Download error'
  required = ('key', 'value', 'reason')


class FlagError(UserError):
  """A command-line flag that cannot work: `flag` and its `value`."""
  label = 'Flag error'
  required = ('flag', 'value')


class DataError(UserError):
  """Data that is missing, unreadable or does not fit the config: `what` names it."""
  label = 'Data error'
  required = ('what',)


class CheckpointError(UserError):
  """A workdir's checkpoints cannot serve the request: `directory`, and `step` when one is meant."""
  label = 'Checkpoint error'
  required = ('directory',)


class StorageError(UserError):
  """A write failed for lack of space or permission: `path` and the OS's `reason`."""
  label = 'I/O error'
  required = ('path', 'reason')


class WorkdirBusy(UserError):
  """Another live run holds the workdir: `workdir` and its `holder` (pid, host, start time)."""
  label = 'Workdir busy'
  required = ('workdir', 'holder')


class NonFiniteError(UserError):
  """The training loss or state became NaN/Inf at `step`; `last_checkpoint` is kept (or None)."""
  label = 'Training halted'
  required = ('step', 'last_checkpoint')


class OutOfMemory(ConfigError):
  """A compiled step needs more memory than there is: `key` names the batch size to lower."""
  label = 'Out of memory'

  @staticmethod
  def caused(error: Exception) -> bool:
    """Whether `error` (a JAX runtime error) is XLA failing to allocate: its status code is
    only in the message ('RESOURCE_EXHAUSTED: Out of memory allocating ...')."""
    return 'RESOURCE_EXHAUSTED' in str(error)

  @staticmethod
  def reason(error: Exception) -> str:
    """XLA's first line, such as 'Out of memory allocating 6442450944 bytes'."""
    return str(error).split('\n', 1)[0].replace('RESOURCE_EXHAUSTED: ', '').strip()


def require(module: str, needed_by: str, error_type: type[UserError] = MissingPackage,
            **fields: Any):
  """The optional package `module`, imported; if it is absent, an `error_type` (with `package`
  and `fields`) saying that `needed_by` (e.g. "config.init_from='w.pth'") needs it."""
  try:
    return importlib.import_module(module)
  except ImportError as error:
    package = module.split('.')[0]
    raise error_type(
        f'{needed_by} needs the {package!r} package, which is not installed: pip install -r '
        f'requirements-extras.txt (or pip install {package}).', package=package,
        **fields) from error
