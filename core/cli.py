"""Command-line parsing shared by main.py and sweep.py, with one-line errors.

A missing or broken config file and an unknown or mistyped `--config.<key>` end the process with
one line naming the file or key, instead of a traceback from inside ml_collections.
"""

import os
import re
import sys
from collections.abc import Callable

from absl import flags
import ml_collections
from ml_collections import config_flags

from core import errors
from core.saved_config import renamed as renamed_key


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
  except (AttributeError, KeyError) as error:
    if 'get_config' in str(error):
      sys.exit(f'Config error: the config file {config_file!r} has no get_config() function '
               'returning an ml_collections.ConfigDict.')
    _exit_unknown_key(error, argv)


def check_inputs(inputs: str | None, mode: str) -> None:
  """A `FlagError` if `--mode=<mode>` has no --inputs."""
  if not inputs:
    raise errors.FlagError(
        f'--mode={mode} needs --inputs=PATH: an image file, a directory of images (searched '
        'recursively), a glob pattern such as "photos/*.jpg" or a CSV file listing images.',
        flag='inputs', value=inputs)


def define_config(default_file: str, help_text: str,
                  saved_config: Callable[[str], ml_collections.ConfigDict | None],
                  argv: list[str] = sys.argv) -> None:
  """Defines --config: a config file; without --config, the config saved in --workdir when it
  has one, else `default_file`. ml_collections applies the --config.<key> overrides to the
  default as the flag is defined, so they are checked against the keys of the config the
  workdir was trained with (a key it has that `default_file` lacks is fine), and an unknown key
  ends the process in one line here too."""
  workdir = _flag_argument(argv, 'workdir')
  saved = None if _flag_argument(argv, 'config') or not workdir else saved_config(workdir)
  try:
    if saved is None:
      config_flags.DEFINE_config_file('config', default_file, help_text, lock_config=True)
    else:
      config_flags.DEFINE_config_dict('config', saved, help_text, lock_config=True)
  except (AttributeError, KeyError) as error:
    _exit_unknown_key(error, argv)


def _exit_unknown_key(error: AttributeError | KeyError, argv: list[str]) -> None:
  """Ends the process with one line naming the --config.<key> override of a key the config lacks
  (ml_collections raises a KeyError, or an AttributeError holding one); re-raises otherwise."""
  if isinstance(error, AttributeError):
    if not error.args or not isinstance(error.args[0], KeyError):
      raise error
    error = error.args[0]
  key, *hint = str(error.args[0]).split('\n')
  key = key.strip('"\'')
  if (new := renamed_key(key)) is not None:
    hint = [f'it is now {new}']
  override = next((arg.split('=')[0] for arg in argv if re.match(
      rf'--config\.(.+\.)?{re.escape(key)}(\.|=|$)', arg)), f'--config.{key}')
  sys.exit(f'Config error: {override} is not a key of the config'
           f'{" (" + hint[0].strip() + ")" if hint else ""}; the keys are listed in the '
           'config file and by --config=... --helpfull. A new section (such as an evaluation) '
           'is defined in a config file.')


def _config_argument(argv: list[str]) -> str:
  """The path given by --config=PATH (or '--config PATH') in `argv`."""
  return _flag_argument(argv, 'config')


def _flag_argument(argv: list[str], name: str) -> str:
  """The value given by --name=VALUE (or '--name VALUE') in `argv`, '' if absent."""
  for i, arg in enumerate(argv):
    if arg.startswith(f'--{name}='):
      return arg.split('=', 1)[1]
    if arg == f'--{name}' and i + 1 < len(argv):
      return argv[i + 1]
  return ''
