"""Pretrained weights by name from the Hugging Face Hub, downloaded on first use as timm does.

`hf-hub:<org>/<name>[@<revision>]`, or the short form `timm/<name>`, names a repository of the
Hub (`training/init_from.py` tells the forms apart); its weights file (`HUB_FILES`, in that
order) and its `config.json` (how the weights were trained) are fetched with huggingface_hub's
`hf_hub_download` into the Hugging Face cache (HF_HOME, HF_HUB_CACHE) with its progress bar, and
later runs reuse the cached file. HF_TOKEN opens gated or private repositories, HF_HUB_OFFLINE=1
reads the cache only, HF_ENDPOINT names another Hub. Each failure is one `errors.DownloadError`,
told apart by huggingface_hub's exception types. huggingface_hub is imported only when needed.
"""

import json
import os
import sys

from core import errors

HUB_PREFIX = 'hf-hub:'
# The short form: timm's own repositories, as timm's model names read (`timm/resnet18.a1_in1k`).
TIMM_PREFIX = 'timm/'
# The suffixes of a weights file's path (a `timm/<name>` with one is a file, existing or not).
FILE_SUFFIXES = ('.safetensors', '.pth', '.pt', '.bin')
# The files a timm repository on the Hub may hold, in the order they are preferred.
HUB_FILES = ('model.safetensors', 'pytorch_model.bin')
# timm's description of the repository's model: its `pretrained_cfg` says how the weights were
# trained (timm's `load_model_config_from_hf` reads the same file).
CONFIG_FILE = 'config.json'
_PREPROCESSING_KEYS = frozenset({'input_size', 'crop_pct', 'interpolation', 'mean', 'std'})
# The values of HF_HUB_OFFLINE that huggingface_hub takes for true.
_TRUE = ('1', 'ON', 'YES', 'TRUE')


def parse(path: str) -> tuple[str, str | None]:
  """The repository id and revision (None: the default branch) that the Hub name `path`
  (`hf-hub:<org>/<name>[@<revision>]`, or `timm/<name>`) names; a `ConfigError` (key
  'init_from') if the id is not a valid one."""
  repo_id, at, revision = path.removeprefix(HUB_PREFIX).partition('@')
  huggingface_hub = _require(path)
  problem = None
  if repo_id.count('/') != 1:
    problem = f'{repo_id!r} is not <org>/<name>'
  elif at and not revision:
    problem = 'no revision after @'
  else:
    try:
      huggingface_hub.utils.validate_repo_id(repo_id)
    except huggingface_hub.errors.HFValidationError as error:
      problem = str(error)
  if problem:
    raise errors.ConfigError(
        f'config.init_from={path!r} is not a Hub name ({problem}): give hf-hub:<org>/<name> '
        '(e.g. hf-hub:timm/resnet18.a1_in1k), optionally @<revision>.', key='init_from',
        value=path)
  return repo_id, revision or None


def download(path: str, repo_id: str, revision: str | None) -> str:
  """The local file of the weights in the Hub repository `repo_id` at `revision` (what
  config.init_from=`path` names): from the cache, else downloaded into it (a no-op without
  network when cached). A `DownloadError` (key 'init_from') saying why there is none: no
  network, no such repository, revision or file, a gated repository without a token, offline
  and not cached."""
  for filename in HUB_FILES:
    if (file := _fetch(path, repo_id, revision, filename)) is not None:
      return file
  if _offline():
    raise errors.DownloadError(
        f'config.init_from={path!r} is not in the Hugging Face cache {cache_directory()} and '
        'HF_HUB_OFFLINE=1 forbids downloading it: unset HF_HUB_OFFLINE, or point HF_HOME at a '
        'cache that holds it.', key='init_from', value=path, reason='offline_not_cached')
  raise errors.DownloadError(
      f'config.init_from={path!r}: the Hub repository {repo_id} holds none of '
      f'{", ".join(HUB_FILES)}: name a repository with PyTorch weights (timm\'s).',
      key='init_from', value=path, reason='file_not_found')


def pretrained_cfg(path: str, repo_id: str, revision: str | None) -> dict | None:
  """The `pretrained_cfg` of the repository's `config.json` (timm's: input_size, crop_pct,
  interpolation, mean, std: how its weights were trained), as timm reads it; None when the
  repository has no config.json, or one without it (offline: none in the cache)."""
  if (file := _fetch(path, repo_id, revision, CONFIG_FILE)) is None:
    return None
  try:
    with open(file, encoding='utf-8') as opened:
      config = json.load(opened)
  except ValueError as error:
    raise errors.ConfigError(
        f'config.init_from={path!r}: the Hub repository {repo_id}\'s {CONFIG_FILE} is not '
        f'JSON ({error}): set config.preprocess to the preprocessing its weights expect.',
        key='init_from', value=path) from None
  cfg = config.get('pretrained_cfg') if isinstance(config, dict) else None
  return cfg if isinstance(cfg, dict) and _PREPROCESSING_KEYS <= cfg.keys() else None


def _fetch(path: str, repo_id: str, revision: str | None, filename: str) -> str | None:
  """The local file of `filename` in the repository (cached, else downloaded); None if the
  repository has no such file, or (offline) the cache does not hold it. A `DownloadError` for
  any other failure (`_failure`)."""
  huggingface_hub = _require(path)
  offline = _offline()
  try:
    return huggingface_hub.hf_hub_download(
        repo_id, filename, revision=revision, cache_dir=cache_directory(),
        endpoint=os.environ.get('HF_ENDPOINT'), local_files_only=offline)
  except huggingface_hub.errors.LocalEntryNotFoundError as error:
    # Raised for every HEAD that failed with nothing cached; the HEAD's error is its cause.
    if offline or isinstance(error.__cause__, huggingface_hub.errors.EntryNotFoundError):
      return None
    raise _failure(path, repo_id, error.__cause__ or error, huggingface_hub) from None
  except huggingface_hub.errors.EntryNotFoundError:
    return None
  except Exception as error:  # pylint: disable=broad-except  (told apart by type in _failure)
    raise _failure(path, repo_id, error, huggingface_hub) from None


def _offline() -> bool:
  return (os.environ.get('HF_HUB_OFFLINE', '').upper() in _TRUE
          or _require('hf-hub:').constants.is_offline_mode())


def cache_directory() -> str:
  """The Hub cache of the environment now: huggingface_hub reads HF_HOME and HF_HUB_CACHE once,
  at import, and the app (or a test) may set them later."""
  if 'HF_HUB_CACHE' in os.environ:
    return os.environ['HF_HUB_CACHE']
  if 'HF_HOME' in os.environ:
    return os.path.join(os.environ['HF_HOME'], 'hub')
  return _require('hf-hub:').constants.HF_HUB_CACHE


def _require(path: str):
  """huggingface_hub, with the submodules used here imported (the package imports them only
  when first named); a `MissingPackage` if it is not installed."""
  for module in ('huggingface_hub.constants', 'huggingface_hub.errors', 'huggingface_hub.utils'):
    errors.require(module, f'config.init_from={path!r}', key='init_from', value=path)
  return sys.modules['huggingface_hub']


def _failure(path: str, repo_id: str, error: Exception, huggingface_hub) -> errors.UserError:
  """The one-line error for huggingface_hub's `error` (told apart by its type, never its text);
  the exception itself for a type that is none of a download's failures (a bug)."""
  import httpx2  # pylint: disable=g-import-not-at-top  (huggingface_hub's HTTP client)
  hub_errors = huggingface_hub.errors
  endpoint = os.environ.get('HF_ENDPOINT') or huggingface_hub.constants.ENDPOINT
  fields = dict(key='init_from', value=path)
  if isinstance(error, hub_errors.GatedRepoError):  # Before its base, RepositoryNotFoundError.
    return errors.DownloadError(
        f'config.init_from={path!r}: the Hub repository {repo_id} is gated: accept its terms '
        'on its page, then set HF_TOKEN to a token of that account.', reason='gated', **fields)
  if isinstance(error, hub_errors.RepositoryNotFoundError):
    return errors.DownloadError(
        f'config.init_from={path!r}: {endpoint} has no repository {repo_id} (or it is private: '
        'set HF_TOKEN). Check the name, e.g. hf-hub:timm/resnet18.a1_in1k.',
        reason='repository_not_found', **fields)
  if isinstance(error, hub_errors.RevisionNotFoundError):
    return errors.DownloadError(
        f'config.init_from={path!r}: the Hub repository {repo_id} has no such revision (branch, '
        'tag or commit after @).', reason='revision_not_found', **fields)
  if isinstance(error, (httpx2.TransportError, hub_errors.FileMetadataError)):
    return errors.DownloadError(
        f'config.init_from={path!r} is not in the Hugging Face cache and could not be '
        f'downloaded from {endpoint} ({type(error).__name__}): connect to the internet (or '
        'HF_ENDPOINT\'s server) and run again; the cache keeps it for later runs.',
        reason='no_network', **fields)
  # An HTTP error without the Hub's error code (a mirror, a proxy): told apart by its status.
  status = error.response.status_code if isinstance(error, hub_errors.HfHubHTTPError) else None
  if status in (401, 403, 404):  # Not there, or not for this machine: waiting changes nothing.
    return errors.DownloadError(
        f'config.init_from={path!r}: {endpoint} answered HTTP {status}: it has no repository '
        f'{repo_id} that this machine may read. Check the name (e.g. '
        'hf-hub:timm/resnet18.a1_in1k), or set HF_TOKEN for a private or gated one.',
        reason='repository_not_found', **fields)
  if status is not None:  # The server's trouble (5xx) or a limit (429): it may pass.
    return errors.DownloadError(
        f'config.init_from={path!r}: {endpoint} answered HTTP {status} while downloading it: '
        'run again later.', reason='http_error', **fields)
  if isinstance(error, OSError) and error.errno is not None:  # Disk full, no permission.
    return errors.StorageError(
        f'config.init_from={path!r} could not be saved in the Hugging Face cache '
        f'{cache_directory()}: {os.strerror(error.errno)}. Free space, or set HF_HOME.',
        path=cache_directory(), reason=os.strerror(error.errno))
  if isinstance(error, OSError):  # http_get's size check: the server sent too little.
    return errors.DownloadError(
        f'config.init_from={path!r}: the download from {endpoint} ended early: run again.',
        reason='incomplete', **fields)
  return error
