"""Pretrained weights by URL or torchvision name, downloaded into torch.hub's cache on first use.

`https://.../<file>.pth` (or `.pt`, `.bin`, `.safetensors`; `http://` too) names a weights file
on a server; `torchvision:<Weights enum>.<member>` names torchvision's, e.g.
`torchvision:ResNet50_Weights.IMAGENET1K_V2`, by the URL torchvision gives it. The file is
downloaded with torch.hub's `download_url_to_file` (its progress bar) into
`<torch.hub.get_dir()>/checkpoints/` (TORCH_HOME), where torchvision and timm keep theirs, so
either finds it there and later runs reuse it. A file whose name carries a hash
(`<name>-<sha256 prefix>.<ext>`, torchvision's convention) is checked against it, as
`torch.hub.load_state_dict_from_url(check_hash=True)` does.

torch.hub writes the download into a temporary file first, but moves it into place whole or
truncated alike (a connection that ends early is not an error to `urllib`), so the caller's
`check` reads the temporary file before it enters the cache: an interrupted download leaves no
cache entry. Each failure is one `errors.DownloadError`, told apart by the exception's type.
"""

import http.client
import os
import urllib.error
import urllib.parse
import uuid
from collections.abc import Callable

from absl import logging

from backbones import hub
from core import errors

URL_PREFIXES = ('https://', 'http://')
TORCHVISION_PREFIX = 'torchvision:'


def _torchvision_weights(path: str):
  """torchvision's weights enum member that the name `path` names; a `ConfigError` (key
  'init_from') if torchvision does not know it."""
  torchvision_models = errors.require('torchvision.models', f'config.init_from={path!r}',
                                      key='init_from', value=path)
  name = path.removeprefix(TORCHVISION_PREFIX)
  try:
    return torchvision_models.get_weight(name)
  except (ValueError, KeyError, AttributeError):  # No such enum, or no such member.
    raise errors.ConfigError(
        f'config.init_from={path!r}: torchvision has no weights {name!r}: give '
        'torchvision:<Weights enum>.<member>, e.g. torchvision:ResNet50_Weights.IMAGENET1K_V2 '
        '(torchvision.models.list_models() and get_model_weights(name) list them).',
        key='init_from', value=path) from None


def torchvision_url(path: str) -> str:
  """The URL of torchvision's weights `torchvision:<Weights enum>.<member>` (config.init_from
  `path`); a `ConfigError` (key 'init_from') for a name torchvision does not know."""
  return checked_url(_torchvision_weights(path).url, path)


def checked_url(address: str, path: str) -> str:
  """`address`, the URL config.init_from=`path` gives; a `ConfigError` (key 'init_from') if it
  names no weights file."""
  if not _filename(address).lower().endswith(hub.FILE_SUFFIXES):
    raise errors.ConfigError(
        f'config.init_from={path!r} names no weights file: the URL must end in a file name with '
        f'one of {", ".join(hub.FILE_SUFFIXES)}.', key='init_from', value=path)
  return address


def torchvision_pretrained_cfg(path: str) -> dict:
  """The preprocessing torchvision's weights `path` (`torchvision:<Weights enum>.<member>`)
  were trained with, as timm's `pretrained_cfg` keys (input_size, crop_pct, interpolation,
  mean, std), from the weights' own `transforms()`."""
  transforms = _torchvision_weights(path).transforms()
  crop_size, resize_size = transforms.crop_size[0], transforms.resize_size[0]
  return dict(input_size=(3, crop_size, crop_size), crop_pct=round(crop_size / resize_size, 4),
              interpolation=transforms.interpolation.value, mean=tuple(transforms.mean),
              std=tuple(transforms.std))


def download(path: str, address: str, check: Callable[[str], object]) -> str:
  """The local file of the weights at the URL `address` (what config.init_from=`path` names):
  from torch.hub's cache, else downloaded into it once `check(temporary_file)` has read it
  without raising. A `DownloadError` (key 'init_from') saying why there is none; a
  `StorageError` if the cache cannot take it."""
  torch_hub = errors.require('torch.hub', f'config.init_from={path!r}', key='init_from',
                             value=path)
  directory = os.path.join(torch_hub.get_dir(), 'checkpoints')
  file = os.path.join(directory, _filename(address))
  if os.path.isfile(file):
    return file
  match = torch_hub.HASH_REGEX.search(_filename(address))
  hash_prefix = match.group(1) if match else None
  partial = f'{file}.{uuid.uuid4().hex}.download'
  logging.info('Downloading %s into %s.', address, directory)
  try:
    os.makedirs(directory, exist_ok=True)
    torch_hub.download_url_to_file(address, partial, hash_prefix, progress=True)
    check(partial)
    os.replace(partial, file)
  except Exception as error:  # pylint: disable=broad-except  (told apart by type in _failure)
    raise _failure(path, address, directory, error, hash_prefix) from None
  finally:
    if os.path.exists(partial):
      os.remove(partial)
  return file


def _filename(address: str) -> str:
  return os.path.basename(urllib.parse.urlparse(address).path)


def _failure(path: str, address: str, directory: str, error: Exception,
             hash_prefix: str | None) -> Exception:
  """The one-line error for a failed download (by the exception's type, never its text); the
  exception itself for a type that is none of a download's failures (a bug)."""
  fields = dict(key='init_from', value=path)
  if isinstance(error, (errors.UserError, http.client.IncompleteRead)):  # Cut short.
    return errors.DownloadError(
        f'config.init_from={path!r}: the file downloaded from {address} does not read as a '
        f'state_dict (an interrupted download?); nothing was cached: run again. ({error})',
        reason='incomplete', **fields)
  if isinstance(error, urllib.error.HTTPError):
    return errors.DownloadError(
        f'config.init_from={path!r}: the server answered HTTP {error.code} for {address}: '
        + ('check the URL.' if error.code == 404 else 'run again later.'),
        reason='file_not_found' if error.code == 404 else 'http_error', **fields)
  if isinstance(error, (urllib.error.URLError, ConnectionError)):
    reason = getattr(error, 'reason', error)
    return errors.DownloadError(
        f'config.init_from={path!r} is not in torch.hub\'s cache {directory} and could not be '
        f'downloaded from {address} ({type(reason).__name__}): connect to the internet (or the '
        'server) and run again; the cache keeps it for later runs.', reason='no_network',
        **fields)
  if isinstance(error, RuntimeError) and hash_prefix is not None:  # torch.hub's hash check.
    return errors.DownloadError(
        f'config.init_from={path!r}: the file downloaded from {address} does not have the '
        f'SHA-256 its name carries ({hash_prefix}...); nothing was cached: check the URL, or '
        'run again.', reason='hash_mismatch', **fields)
  if isinstance(error, OSError) and error.errno is not None:  # Disk full, no permission.
    return errors.StorageError(
        f'config.init_from={path!r} could not be saved in torch.hub\'s cache {directory}: '
        f'{os.strerror(error.errno)}. Free space, or set TORCH_HOME.', path=directory,
        reason=os.strerror(error.errno))
  return error
