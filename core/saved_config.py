"""The config a workdir was trained with: training saves it as <workdir>/config.json, and every
later command on the workdir (a resume, eval, predict, export, init_from) reads it back.

Light on purpose (ml_collections alone): main.py and sweep.py read it while they parse the
command line, before TensorFlow and JAX are imported, so that a mistyped flag is refused in a
second.
"""

import json
import os

import ml_collections

from configs import default

CONFIG_FILE = 'config.json'
# Keys renamed since a workdir may have been trained: old name -> (new name, {old value: new}).
RENAMED = {'cpu_kernels': ('kernels', {'auto': 'auto', 'off': 'stock'})}


def renamed(key: str) -> str | None:
  """What a renamed key is called now, with its renamed values ("config.kernels ('off' is
  now 'stock')"); None if `key` was not renamed."""
  if key not in RENAMED:
    return None
  new, values = RENAMED[key]
  changed = ', '.join(f'{old!r} is now {value!r}' for old, value in values.items()
                      if old != value)
  return f'config.{new}' + (f' ({changed})' if changed else '')


def read(workdir: str) -> ml_collections.ConfigDict | None:
  """The config `workdir`'s checkpoints were trained with, as saved, its renamed keys under
  their new names; None if none is."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as file:
    saved = json.load(file)
  for old, (new, values) in RENAMED.items():
    if old in saved:
      value = saved.pop(old)
      saved[new] = values.get(value, value)  # An unknown value is refused under the new key.
  return ml_collections.ConfigDict(saved)


def with_defaults(workdir: str) -> ml_collections.ConfigDict | None:
  """`read(workdir)` on today's defaults: keys added to the app since it was trained take their
  default values."""
  if (saved := read(workdir)) is None:
    return None
  config = default.get_config()
  config.update(saved)
  return config
