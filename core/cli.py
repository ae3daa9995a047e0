"""Command-line parsing shared by main.py and sweep.py, with one-line errors.

A missing or broken config file and an unknown or mistyped `--config.<key>` end the process with
one line naming the file or key, instead of a traceback from inside ml_collections.
"""

import os
import re
import sys

from absl import flags


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (for `app.run(..., flags_parser=parse_flags)`), with one-line errors."""
  config_file = _config_argument(argv).split(':')[0]  # 'file.py:arg' passes arg to get_config().
  if config_file and not os.path.isfile(config_file):  # Before ml_collections logs a traceback.
    reason = 'a directory' if os.path.isdir(config_file) else 'no such file'
    sys.exit(f'Config error: cannot read the config file {config_file!r} ({reason}): pass '
             '--config=PATH of a Python file with get_config(), such as configs/default.py.')
  try:
    rest = flags.FLAGS(argv)
    flags.FLAGS['config'].value  # pylint: disable=pointless-statement  (loads the file now)
    return rest
  except flags.Error as error:
    sys.exit(f'Flag error: {str(error).splitlines()[0]} (see --helpfull).')
  except OSError as error:  # ml_collections' "Failed loading config file ...".
    reason = str(error).splitlines()[-1].strip()
    sys.exit(f'Config error: cannot read the config file {config_file!r} ({reason}): pass '
             '--config=PATH of a Python file with get_config(), such as configs/default.py.')
  except SyntaxError as error:
    sys.exit(f'Config error: the config file {error.filename} has a syntax error at line '
             f'{error.lineno}: {error.msg}.')
  except AttributeError as error:
    if isinstance(error.args[0], KeyError):  # An override of a key the config does not have.
      key, *hint = str(error.args[0].args[0]).split('\n')
      key = key.strip("'")
      override = next((arg.split('=')[0] for arg in argv if re.match(
          rf'--config\.(.+\.)?{re.escape(key)}(=|$)', arg)), f'--config.{key}')
      sys.exit(f'Config error: {override} is not a key of the config'
               f'{" (" + hint[0].strip() + ")" if hint else ""}; the keys are listed in the '
               'config file and by --config=... --helpfull.')
    if 'get_config' in str(error):
      sys.exit(f'Config error: the config file {config_file!r} has no get_config() function '
               'returning an ml_collections.ConfigDict.')
    raise


def _config_argument(argv: list[str]) -> str:
  """The path given by --config=PATH (or '--config PATH') in `argv`."""
  for i, arg in enumerate(argv):
    if arg.startswith('--config='):
      return arg.split('=', 1)[1]
    if arg == '--config' and i + 1 < len(argv):
      return argv[i + 1]
  return ''
