"""A run's workdir: one live training run at a time, the config it trained with, its data's info.

  <workdir>/lock               pid, host and start time of the run that holds the workdir;
  <workdir>/config.json        the config the checkpoints were trained with;
  <workdir>/dataset_info.json  the data's metadata (image shape, class names), so that eval,
                               predict and export know the model without reading the data.
"""

import contextlib
import dataclasses
import datetime
import fcntl
import json
import os
import socket
import tempfile

from absl import logging
from clu import parameter_overview
import jax

from core import errors
from core.saved_config import CONFIG_FILE
from core.saved_config import read as saved_config
from data_sources import base
import models

LOCK_FILE = 'lock'
INFO_FILE = 'dataset_info.json'
_PROBE_BYTES = 1 << 20  # Written by the workdir check: a full disk fails it, an empty file not.
# Changing these on resume would continue with another data order, or another shape of the
# model or optimizer state, than the checkpoint's, so a resumed run refuses them. Any other key
# may change (learning rate, epochs, logging, ...), with a warning. A key also covers its
# sub-keys (model_options.cnn...).
FIXED_ON_RESUME = ('data_source', 'dataset', 'data_source_options', 'train_split', 'batch_size',
                   'seed', 'shuffle_buffer_size', 'input_backend', 'in_memory', 'preprocess',
                   'model', 'model_options', 'optimizer', 'grad_accum_steps', 'ema_decay',
                   'nonfinite')


def check_writable(workdir: str) -> None:
  """Creates `workdir` if needed and checks that it takes a file of `_PROBE_BYTES`."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise errors.FlagError(f'--workdir={workdir} is a file, not a directory: pass a directory '
                           '(it is created if it does not exist).', flag='workdir', value=workdir)
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.TemporaryFile(dir=workdir) as probe:
      probe.write(b'\0' * _PROBE_BYTES)
      probe.flush()
      os.fsync(probe.fileno())
  except OSError as error:
    raise errors.StorageError(f'Workdir {workdir!r} is not writable ({error.strerror}): free some '
                              'space, fix its permissions, or pass a --workdir you can write to.',
                              path=workdir, reason=error.strerror) from error


@contextlib.contextmanager
def hold(workdir: str):
  """Holds `workdir` for one training run: checks it, then locks it until the block ends.

  The lock is an advisory `flock` on <workdir>/lock, which the operating system releases when
  the process ends in any way (even SIGKILL), so a lock left by a killed run is never "live".
  Its file names the holder, for the message of a second run. With several processes, process
  0 holds it for all.
  """
  check_writable(workdir)
  if jax.process_index() > 0:
    yield
    return
  path = os.path.join(workdir, LOCK_FILE)
  with open(path, 'a+', encoding='utf-8') as lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _holder(lock)
      raise errors.WorkdirBusy(f'Workdir {workdir!r} is in use by another run ({holder}): wait '
                               'for it to end or stop it, or pass another --workdir.',
                               workdir=workdir, holder=holder) from None
    if previous := _holder(lock):
      logging.warning('Taking over the lock of workdir %s from a run that ended without '
                      'releasing it (%s).', workdir, previous)
    lock.seek(0)
    lock.truncate()
    lock.write(json.dumps({'pid': os.getpid(), 'host': socket.gethostname(),
                           'started': datetime.datetime.now().isoformat(timespec='seconds')}))
    lock.flush()
    try:
      yield
    finally:
      # Under the lock still: a run that starts now finds no stale holder. Only our own file:
      # if the workdir was deleted and another run's lock now stands there, it stays.
      if _same_file(lock, path):
        os.remove(path)


def _same_file(file, path: str) -> bool:
  """Whether `path` still names the open `file` (not removed, nor replaced by another)."""
  try:
    found = os.stat(path)
  except FileNotFoundError:
    return False
  held = os.fstat(file.fileno())
  return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)


def _holder(lock) -> str:
  """'pid 123 on host h, started 2026-11-30T05:00:00', as the lock file says; '' if empty."""
  lock.seek(0)
  try:
    holder = json.loads(lock.read())
  except ValueError:
    return ''
  return f'pid {holder["pid"]} on host {holder["host"]}, started {holder["started"]}'


def write_json(path: str, value) -> None:
  """Writes `value` to `path` atomically: a reader sees the old or the new file."""
  with open(path + '.tmp', 'w', encoding='utf-8') as file:
    json.dump(value, file, indent=2, sort_keys=True)
  os.replace(path + '.tmp', path)


def _flat(settings: dict) -> dict:
  """{'model_options.cnn.dropout_rate': 0.025, ...}; tuples as JSON stores them (lists)."""
  return parameter_overview.flatten_dict(json.loads(json.dumps(settings)), delimiter='.')


def _model_settings(settings: dict) -> dict:
  """`settings` with `model` the registered name it stands for and `model_options` its section
  alone (models.resolve): a former model name, or options of models not trained, change nothing."""
  if 'model' not in settings:
    return settings
  name, options = models.resolve(settings['model'], settings.get('model_options') or {})
  return {**settings, 'model': name, 'model_options': {name: options}}


def check_resume_config(settings: dict, workdir: str, has_checkpoint: bool) -> None:
  """Compares the run's `settings` (its config as JSON values) with the config the workdir's
  checkpoints were trained with.

  Refuses a change of a `FIXED_ON_RESUME` key, warns about any other change (old -> new), and
  saves `settings` as the workdir's config; the config it replaces is kept as
  config.<time>.json. Without a checkpoint there is nothing to resume, so any config starts
  afresh.
  """
  path = os.path.join(workdir, CONFIG_FILE)
  old_config = saved_config(workdir) if has_checkpoint else None
  if old_config is not None:
    old, flat_new = _flat(_model_settings(old_config.to_dict())), _flat(_model_settings(settings))
    changed = sorted(key for key in old.keys() | flat_new.keys()
                     if old.get(key) != flat_new.get(key))
    if fixed := [key for key in changed if key.split('.')[0] in FIXED_ON_RESUME]:
      raise errors.ConfigError(
          f'Workdir {workdir!r} holds checkpoints trained with other values of '
          f'{_listed(fixed, old, flat_new)}; these change the data order or the model, so a '
          'resumed run must keep them: rerun with the old values, or pass a new --workdir.',
          key=fixed[0], value=flat_new.get(fixed[0]))
    if not changed:
      return
    logging.warning('Resuming %s with a changed config: %s.', workdir,
                    _listed(changed, old, flat_new))
    if jax.process_index() == 0:
      stamp = datetime.datetime.now().strftime('%Y%m%dT%H%M%S')
      os.replace(path, os.path.join(workdir, f'config.{stamp}.json'))
  if jax.process_index() == 0:
    write_json(path, settings)


def _listed(keys: list[str], old: dict, new: dict) -> str:
  missing = '(unset)'
  return ', '.join(f'config.{key} ({old.get(key, missing)!r} -> {new.get(key, missing)!r})'
                   for key in keys)


def save_info(workdir: str, info: base.DatasetInfo) -> None:
  """Writes `info` to <workdir>/INFO_FILE (process 0 only)."""
  if jax.process_index() == 0:
    write_json(os.path.join(workdir, INFO_FILE), dataclasses.asdict(info))


def saved_info(workdir: str) -> base.DatasetInfo | None:
  """The info that training saved in `workdir`, if any."""
  path = os.path.join(workdir, INFO_FILE)
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as file:
    saved = json.load(file)
  return base.DatasetInfo(**{**saved, 'image_shape': tuple(saved['image_shape']),
                             'class_names': tuple(saved['class_names'])})
