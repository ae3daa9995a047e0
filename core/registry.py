"""Plug-ins by name, registered where they are defined, built from their own config section.

In the manner of big_vision's `Registry`: each kind of plug-in (models, data sources,
preprocessing ops, losses, optimizers, schedules, evaluators) has one `Registry`, and a plug-in
joins it with a decorator on its class or factory function:

    @MODELS.register('cnn')
    class CNN(nnx.Module):
      def __init__(self, image_shape, num_classes, *, layers, rngs, dropout_rate=0.025): ...

The config names the plug-in (`config.model = 'cnn'`) and holds its options in its own section
(`config.model_options.cnn.dropout_rate`), which the run's resolve step (`training/run_spec.py`)
gives to `bind`: the plug-in sees only its options, as keyword arguments. The signature is the
schema: an option the plug-in does not take is refused before anything runs, and the plug-in
checks its values itself (a `ValueError` it raises becomes a `ConfigError` naming the option).
Capabilities are declared at registration (`@SOURCES.register('folder', can_stream=True)`) and
read with `capability`; `requires='package'` names an optional package the plug-in needs.

Plug-ins chosen several at a time (preprocessing ops, evaluators) are written as calls joined
by '|' instead, e.g. 'resize(32)|flip_lr', their options as Python-literal arguments
(`create_calls`).

A registry whose plug-ins live in a package (`package='data_sources'`) imports every module of
it on first use, so a new plug-in is one new file there. Plug-ins outside the repository are
registered by importing their module, e.g. from the config file.
"""

import ast
from collections.abc import Callable
import dataclasses
import importlib
import inspect
import pkgutil
from typing import Any

from core import errors


@dataclasses.dataclass(frozen=True)
class Entry:
  """A registered plug-in: its class or factory and the capabilities it declared."""
  factory: Callable[..., Any]
  capabilities: dict[str, Any]


class Registry:
  """The plug-ins of one kind, by name."""

  def __init__(self, kind: str, key: str | None = None, package: str | None = None,
               app_args: int = 0, fallback: Callable[[str], Callable | None] | None = None):
    """`kind` names the plug-ins in messages ('model'); `key` is the config key that names the
    chosen one (options in `<key>_options.<name>`); `package` holds their modules; `app_args`
    is the number of positional arguments the app passes before the options; `fallback`
    gives a factory for a name nobody registered (or None), e.g. a library's own by name."""
    self.kind = kind
    self.key = key
    self.app_args = app_args
    self._package = package
    self._fallback = fallback
    self._entries: dict[str, Entry] = {}
    self._imported = package is None

  def register(self, name: str, **capabilities: Any) -> Callable:
    """A decorator that registers a class or factory under `name`, with `capabilities`; a
    `ConfigError` naming both places if another one holds `name`. The same definition run
    again (its module reloaded) replaces its own entry."""
    def decorator(factory):
      if (taken := self._entries.get(name)) and _place(taken.factory) != _place(factory):
        raise errors.ConfigError(
            f'Two {self.kind}s are registered as {name!r}: {_place(taken.factory)} and '
            f'{_place(factory)}; rename one of them.', key=self.key or self.kind, value=name,
            registered=_place(taken.factory), duplicate=_place(factory))
      self._entries[name] = Entry(factory, capabilities)
      return factory
    return decorator

  def _import_package(self) -> None:
    if self._imported:
      return
    package = importlib.import_module(self._package)
    for module in pkgutil.iter_modules(package.__path__):
      importlib.import_module(f'{self._package}.{module.name}')
    self._imported = True

  def names(self) -> list[str]:
    self._import_package()
    return sorted(self._entries)

  def entry(self, name: str, key: str | None = None) -> Entry:
    """The plug-in `name`; a `ConfigError` listing the valid names if there is none.

    An optional package it `requires` is imported here: a `MissingPackage` error if absent.
    """
    self._import_package()
    key = key or self.key
    if name not in self._entries and self._fallback and (factory := self._fallback(name)):
      self._entries[name] = Entry(factory, {})
    if name not in self._entries:
      raise errors.ConfigError(
          f'Unknown {self.kind} {name!r}: config.{key} must be one of {self.names()}.',
          key=key, value=name)
    entry = self._entries[name]
    if package := entry.capabilities.get('requires'):
      errors.require(package, f'config.{key}={name!r}', key=key, value=name)
    return entry

  def capability(self, name: str, capability: str, default: Any = None) -> Any:
    """What plug-in `name` declared for `capability` (without importing what it requires)."""
    self._import_package()
    entry = self._entries.get(name)
    return default if entry is None else entry.capabilities.get(capability, default)

  def bind(self, name: str, options: dict) -> Callable[..., Any]:
    """Plug-in `name` with `options` (its config section, `<key>_options.<name>`): a function
    of the app's arguments that builds it. The option names are checked here, against its
    signature; a `ValueError` the plug-in raises when built is its verdict on their values: a
    `ConfigError` naming the section."""
    section = f'{self.key}_options.{name}'
    factory = self.entry(name).factory
    self._check_options(name, options, section)

    def create(*args: Any, **kwargs: Any) -> Any:
      try:
        return factory(*args, **kwargs, **options)
      except ValueError as error:
        if not options:
          raise
        raise errors.ConfigError(f'config.{section} = {options} is invalid for {self.kind} '
                                 f'{name!r}: {error}.', key=section, value=options) from error

    return create

  def _check_options(self, name: str, options: dict, section: str) -> None:
    """Refuses options that `name`'s signature does not take as keywords (its first `app_args`
    parameters are the app's, never options); `section` is the config path in the error."""
    factory = self.entry(name).factory
    if inspect.isclass(factory):  # Its own signature: some metaclasses (nnx's) hide it.
      parameters = list(inspect.signature(factory.__init__).parameters.values())[1:]
    else:
      parameters = list(inspect.signature(factory).parameters.values())
    parameters = parameters[self.app_args:]
    if any(parameter.kind == parameter.VAR_KEYWORD for parameter in parameters):
      return
    accepted = [parameter.name for parameter in parameters
                if parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)
                and parameter.name not in ('layers', 'rngs')]
    for option in options:
      if option not in accepted:
        raise errors.ConfigError(
            f'config.{section}.{option} is not an option of {self.kind} {name!r}; its options: '
            f'{", ".join(accepted) or "none"}.', key=f'{section}.{option}', value=options[option])

  def check_calls(self, spec: str, key: str) -> list[str]:
    """The plug-in names of `spec`, each checked (known, its package installed) but not built;
    a `ConfigError` (or `MissingPackage`) naming config.`key` otherwise."""
    try:
      calls = _parse_calls(spec)
    except ValueError as error:
      raise errors.ConfigError(f'config.{key}={spec!r} is invalid: {error}.', key=key,
                               value=spec) from None
    for _, name, _, _ in calls:
      self.entry(name, key)
    return [name for _, name, _, _ in calls]

  def create_calls(self, spec: str, key: str, **kwargs: Any) -> list[tuple[str, Entry, Any]]:
    """Builds every call of `spec`, such as 'flip_lr|random_crop(32, pad=4)', with its
    arguments and `kwargs`: [(the call's text, its entry, the plug-in)], in order.

    A `ConfigError` naming config.`key`, the call at fault and the valid names otherwise.
    """
    def invalid(reason: str) -> errors.ConfigError:
      return errors.ConfigError(f'config.{key}={spec!r} is invalid: {reason} ({self.kind}s: '
                                f'{", ".join(self.names())}).', key=key, value=spec)

    try:
      calls = _parse_calls(spec)
    except ValueError as error:
      raise invalid(str(error)) from None
    built = []
    for text, name, args, call_kwargs in calls:
      if name not in self.names():
        raise invalid(f'unknown {self.kind} {name!r}')
      entry = self.entry(name, key)
      try:
        built.append((text, entry, entry.factory(*args, **call_kwargs, **kwargs)))
      except (TypeError, ValueError) as error:
        raise invalid(f'bad arguments for {text!r}: {error}') from None
    return built


def _place(factory: Callable) -> str:
  """Where `factory` is defined: 'module.qualname'."""
  return f'{factory.__module__}.{factory.__qualname__}'


def _parse_calls(spec: str) -> list[tuple[str, str, list, dict]]:
  """[(text, name, args, kwargs)] of 'flip_lr|random_crop(32, pad=4)': one per '|' part.

  Raises ValueError naming the part that is not a name or a call with literal arguments.
  """
  calls = []
  for text in filter(None, (part.strip() for part in spec.split('|'))):
    try:
      node = ast.parse(text, mode='eval').body
      if isinstance(node, ast.Name):
        calls.append((text, node.id, [], {}))
        continue
      if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        raise SyntaxError(text)
      calls.append((text, node.func.id, [ast.literal_eval(arg) for arg in node.args],
                    {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}))
    except (SyntaxError, ValueError):
      raise ValueError(f'{text!r} is not a name or a call with literal arguments, such as '
                       'flip_lr or random_crop(32, pad=4)') from None
  return calls
