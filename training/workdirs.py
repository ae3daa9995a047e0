"""A training run's hold on its workdir: one live run at a time, and the config it resumes with.

  <workdir>/lock         pid, host and start time of the run that holds the workdir;
  <workdir>/config.json  the config the checkpoints were trained with (flattened, dotted keys).
"""

import contextlib
import datetime
import fcntl
import json
import os
import socket

from absl import logging
import jax
import ml_collections

from training import config_checks

LOCK_FILE = 'lock'
CONFIG_FILE = 'config.json'
# Changing these on resume would continue with another data order, or another shape of the
# model or optimizer state, than the checkpoint's, so a resumed run refuses them. Any other key
# may change (learning rate, epochs, logging, ...), with a warning. A key also covers its
# sub-keys (model_options.cnn...).
FIXED_ON_RESUME = ('data_source', 'dataset', 'train_split', 'batch_size', 'seed',
                   'shuffle_buffer_size', 'input_backend', 'in_memory', 'image_size', 'model',
                   'model_options', 'optimizer', 'grad_accum_steps', 'ema_decay')


@contextlib.contextmanager
def hold(workdir: str):
  """Holds `workdir` for one training run: checks it, then locks it until the block ends.

  The lock is an advisory `flock` on <workdir>/lock, which the operating system releases when
  the process ends in any way (even SIGKILL), so a lock left by a killed run is never "live".
  Its file names the holder, for the message of a second run. With several processes, process
  0 holds it for all.
  """
  config_checks.check_workdir(workdir)
  if jax.process_index() > 0:
    yield
    return
  path = os.path.join(workdir, LOCK_FILE)
  with open(path, 'a+', encoding='utf-8') as lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise config_checks.ConfigError(
          f'Workdir {workdir!r} is in use by another run ({_holder(lock)}): wait for it to end '
          'or stop it, or pass another --workdir.') from None
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
      os.remove(path)  # Under the lock still: a run that starts now finds no stale holder.


def _holder(lock) -> str:
  """'pid 123 on host h, started 2026-11-30T05:00:00', as the lock file says; '' if empty."""
  lock.seek(0)
  try:
    holder = json.loads(lock.read())
  except ValueError:
    return ''
  return f'pid {holder["pid"]} on host {holder["host"]}, started {holder["started"]}'


def _flat(config: ml_collections.ConfigDict) -> dict:
  """{'model_options.cnn.dropout_rate': 0.025, ...}, as JSON stores it (tuples as lists)."""
  def flatten(tree, prefix=''):
    for key, value in tree.items():
      if isinstance(value, dict):
        yield from flatten(value, f'{prefix}{key}.')
      else:
        yield f'{prefix}{key}', value
  return json.loads(json.dumps(dict(flatten(config.to_dict())), default=str))


def check_resume_config(config: ml_collections.ConfigDict, workdir: str,
                        has_checkpoint: bool) -> None:
  """Compares `config` with the config the workdir's checkpoints were trained with.

  Refuses a change of a `FIXED_ON_RESUME` key, warns about any other change (old -> new), and
  saves `config` as the workdir's config; the config it replaces is kept as config.<time>.json.
  Without a checkpoint there is nothing to resume, so any config starts afresh.
  """
  path = os.path.join(workdir, CONFIG_FILE)
  new = _flat(config)
  if has_checkpoint and os.path.exists(path):
    with open(path, encoding='utf-8') as file:
      old = json.load(file)
    changed = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))
    if fixed := [key for key in changed if key.split('.')[0] in FIXED_ON_RESUME]:
      raise config_checks.ConfigError(
          f'Workdir {workdir!r} holds checkpoints trained with other values of '
          f'{_listed(fixed, old, new)}; these change the data order or the model, so a resumed '
          'run must keep them: rerun with the old values, or pass a new --workdir.')
    if not changed:
      return
    logging.warning('Resuming %s with a changed config: %s.', workdir,
                    _listed(changed, old, new))
    if jax.process_index() == 0:
      stamp = datetime.datetime.now().strftime('%Y%m%dT%H%M%S')
      os.replace(path, os.path.join(workdir, f'config.{stamp}.json'))
  if jax.process_index() == 0:
    with open(path, 'w', encoding='utf-8') as file:
      json.dump(new, file, indent=2, sort_keys=True)


def _listed(keys: list[str], old: dict, new: dict) -> str:
  missing = '(unset)'
  return ', '.join(f'config.{key} ({old.get(key, missing)!r} -> {new.get(key, missing)!r})'
                   for key in keys)
