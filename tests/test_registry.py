"""core/registry.py: a name is registered once; a second plug-in under it is one ConfigError
naming both places."""

import pytest

from core import errors
from core import registry


def test_a_name_already_taken_is_refused_naming_both_places():
  plugins = registry.Registry('widget', key='widget')

  @plugins.register('round')
  def first():
    return 1

  with pytest.raises(errors.ConfigError) as error:
    @plugins.register('round')
    def second():
      return 2

  assert (error.value.key, error.value.value) == ('widget', 'round')
  place = f'{__name__}.test_a_name_already_taken_is_refused_naming_both_places.<locals>'
  assert (error.value.registered, error.value.duplicate) == (f'{place}.first',
                                                             f'{place}.second')
  assert plugins.entry('round').factory is first


def test_the_same_definition_run_again_keeps_its_name():
  """A module reloaded registers its plug-ins again: the same places, not a conflict."""
  plugins = registry.Registry('widget', key='widget')
  for _ in range(2):
    @plugins.register('round', sides=0)
    def round_widget():
      return 1
  assert plugins.entry('round').factory is round_widget
