"""Weights by URL and by torchvision name (backbones/torch_hub.py), without the internet: a
stand-in file server on 127.0.0.1 serves the files that torch.hub's real `download_url_to_file`
fetches into an empty TORCH_HOME. The first download, the cache reused, the hash a file name
carries, and each failure as one typed error that leaves nothing in the cache."""

import hashlib
import http.server
import os
import threading

import numpy as np
import pytest

from backbones import torch_hub
from configs import default
from core import errors
from tests.helpers import timm_models
from tests.helpers.build import create_backbone
from tests.helpers.build import load_weights
from tests.helpers.build import read_weights
from tests.helpers.optional import requires_extras
from training import run_spec


class FileServer:
  """Serves `files` ({name: bytes}) at GET /<name>; 404 for any other name. With `interrupt`,
  a GET announces the whole file, sends half of it and closes the connection."""

  def __init__(self, files: dict[str, bytes]):
    self.files, self.interrupt, self.requests = files, False, 0
    self.server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), self._handler())
    self.url = f'http://127.0.0.1:{self.server.server_address[1]}'
    threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

  def stop(self) -> None:
    self.server.shutdown()
    self.server.server_close()

  def _handler(self):
    files = self

    class Handler(http.server.BaseHTTPRequestHandler):

      def log_message(self, *args):  # Quiet: the test's output is pytest's.
        pass

      def do_GET(self):  # pylint: disable=invalid-name
        files.requests += 1
        data = files.files.get(self.path.lstrip('/'))
        if data is None:
          self.send_response(404)
          self.send_header('Content-Length', '0')
          self.end_headers()
          return
        self.send_response(200)
        self.send_header('Content-Length', str(len(data)))
        self.end_headers()
        self.wfile.write(data[:len(data) // 2] if files.interrupt else data)

    return Handler


def _safetensors(seed: int = 0) -> tuple[dict[str, np.ndarray], bytes]:
  from safetensors import numpy as safetensors_numpy  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  arrays = {'conv1.weight': rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
            'fc.bias': rng.standard_normal(4).astype(np.float32)}
  return arrays, safetensors_numpy.save(arrays)


@pytest.fixture(name='cache')
def cache_fixture(tmp_path, monkeypatch):
  """torch.hub's checkpoints directory under an empty TORCH_HOME."""
  requires_extras('torch', 'safetensors')
  monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch_home'))
  return tmp_path / 'torch_home' / 'hub' / 'checkpoints'


@pytest.fixture(name='server')
def server_fixture():
  arrays, data = _safetensors()
  named = f'weights-{hashlib.sha256(data).hexdigest()[:8]}.safetensors'
  server = FileServer({'weights.safetensors': data, named: data,
                       'wrong-0123abcd.safetensors': data})
  server.arrays, server.named = arrays, named
  yield server
  server.stop()


def _download_error(path: str) -> errors.DownloadError:
  with pytest.raises(errors.DownloadError) as error:
    read_weights(path)
  return error.value


def test_a_url_is_downloaded_once_into_torch_hubs_cache(cache, server):
  url = f'{server.url}/weights.safetensors'
  read = read_weights(url)
  assert sorted(os.listdir(cache)) == ['weights.safetensors']
  server.stop()  # Later reads are the cache's.
  for state_dict in (read, read_weights(url)):
    assert state_dict.keys() == server.arrays.keys()
    for key, array in server.arrays.items():
      np.testing.assert_array_equal(state_dict[key], array)
  assert server.requests == 1


def test_the_hash_a_file_name_carries_is_checked(cache, server):
  read_weights(f'{server.url}/{server.named}')  # Its hash matches.
  error = _download_error(f'{server.url}/wrong-0123abcd.safetensors')
  assert (error.key, error.reason) == ('init_from', 'hash_mismatch')
  assert sorted(os.listdir(cache)) == [server.named]  # Nothing else, no temporary file.


def test_failures_are_one_typed_error_and_cache_nothing(cache, server):
  missing = _download_error(f'{server.url}/nope.safetensors')
  assert missing.reason == 'file_not_found'
  server.interrupt = True
  assert _download_error(f'{server.url}/weights.safetensors').reason == 'incomplete'
  url = f'{server.url}/weights.safetensors'
  server.stop()
  assert _download_error(url).reason == 'no_network'
  assert not os.path.exists(cache) or os.listdir(cache) == []


def test_names_that_cannot_be_weights_are_refused_before_any_data_is_read():
  requires_extras('torchvision')
  for init_from in ('torchvision:ResNet18_Weights.NOPE', 'torchvision:Nope_Weights.DEFAULT',
                    'https://example.com/weights.txt'):
    config = default.get_config()
    config.init_from = init_from
    with pytest.raises(errors.ConfigError) as error:
      run_spec.resolve(config)
    assert (error.value.key, error.value.value) == ('init_from', init_from)


def test_torchvision_weights_by_name_load_from_torch_hubs_cache(cache):
  """torchvision's name for its ResNet-18 weights, found where torchvision caches them (its
  URL's file name), gives torchvision's logits; a model with seeded random weights stands in
  for the real file, which cannot be downloaded here."""
  requires_extras('torchvision', 'timm')
  import torch  # pylint: disable=g-import-not-at-top
  import torchvision  # pylint: disable=g-import-not-at-top
  name = 'torchvision:ResNet18_Weights.IMAGENET1K_V1'
  torch.manual_seed(0)
  torch_model = torchvision.models.resnet18(num_classes=1000)
  timm_models.randomise(torch_model)
  cache.mkdir(parents=True)
  torch.save(torch_model.state_dict(), cache / os.path.basename(torch_hub.torchvision_url(name)))
  model = create_backbone('resnet18', image_shape=(64, 64, 3), num_classes=1000)
  assert load_weights(model, 'resnet18', name)[1] == []
  timm_models.assert_same_logits(torch_model, model, timm_models.images(64, 64))


def test_torchvision_weights_bring_their_own_preprocessing():
  """Unset, config.preprocess is what torchvision's weights were trained with (their
  transforms(): ImageNet's statistics, a 224 crop of the shorter side resized to 232, bilinear
  for ResNet50_Weights.IMAGENET1K_V2), not timm's pretrained_cfg of the model (0.95, bicubic)."""
  requires_extras('torchvision')
  config = default.get_config()
  config.update(model='resnet50', init_from='torchvision:ResNet50_Weights.IMAGENET1K_V2')
  assert run_spec.resolve(config).input.preprocess.spec == (
      "random_resized_crop(224, crop_pct=0.9655, interpolation='bilinear')|flip_lr|"
      "normalize('imagenet')")
