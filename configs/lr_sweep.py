"""The default config plus a sweep of learning rate and batch size, for sweep.py.

  python sweep.py --config=configs/lr_sweep.py --workdir=runs/lr_sweep
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  return default.get_config()


def get_sweep() -> dict[str, list]:
  """Values of config keys to sweep: sweep.py runs their product, a trial per combination in
  <workdir>/trial_0000 to trial_0005 (--sweep flags add keys)."""
  return {'learning_rate': [0.01, 0.05, 0.1], 'batch_size': [64, 128]}
