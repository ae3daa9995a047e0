"""The default config plus a range of learning rate and momentum, for a random or TPE search.

  python sweep.py --config=configs/lr_search.py --workdir=runs/lr_search --search=tpe \
      --num_trials=12
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  return default.get_config()


def get_sweep() -> dict[str, str]:
  """Ranges of config keys to search (see sweeps/spec.py; --sweep flags add keys)."""
  return {'learning_rate': 'loguniform(0.01,0.5)',
          'optimizer_options.sgd.momentum': 'uniform(0.5,0.95)'}
