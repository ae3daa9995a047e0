"""Weights by Hub name (`init_from='hf-hub:<org>/<name>'`, backbones/hub.py), without the
internet: a stand-in Hub on 127.0.0.1 (HF_ENDPOINT) answers the requests that huggingface_hub's
real `hf_hub_download` makes, into an empty HF_HOME. The first download, the cache reused,
offline mode, and each failure as one typed error; an interrupted download leaves no broken
cache entry."""

import collections
import hashlib
import http.server
import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.parse

import jax.numpy as jnp
import numpy as np
import pytest

from backbones import weights
from configs import default
from core import errors
import sample_folders
import models
from preprocessing import crop
from tests.helpers.build import create_backbone
from tests.helpers.build import load_weights
from tests.helpers.build import read_weights
from tests.helpers.optional import requires_extras
import train
from training import init_from
from training import run_spec

REPO = 'stand-in/resnet18.seeded'
NUM_CLASSES = 4  # The classes of `python -m sample_folders --kind=shapes`.


class StandInHub:
  """A Hub on the loopback address serving `repos` ({repo id: {filename: bytes}}) at
  HEAD/GET /<repo>/resolve/<revision>/<filename> with the headers hf_hub_download reads
  (X-Repo-Commit, ETag, Content-Length and, as for LFS files, X-Linked-Etag/X-Linked-Size), and
  the Hub's error codes (X-Error-Code). Repositories in `gated` answer only the bearer of
  `token`; those in `statuses` answer their status alone, as a mirror or proxy may. With `interrupt` set, a GET sends half the file then closes the connection, and the
  retries it resumes with get HTTP 503: the server has gone down mid-download. `requests`
  counts (method, filename)."""

  def __init__(self, repos: dict[str, dict[str, bytes]], gated=(), token: str = 'hf_secret'):
    self.repos, self.gated, self.token = repos, set(gated), token
    self.statuses = {}  # {repo id: the HTTP status it answers, without an error code}.
    self.interrupt = False
    self.requests = collections.Counter()
    self.server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), self._handler())
    self.endpoint = f'http://127.0.0.1:{self.server.server_address[1]}'
    self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
    self.thread.start()

  def commit(self, repo: str) -> str:
    return hashlib.sha1(repo.encode()).hexdigest()

  def stop(self) -> None:
    self.server.shutdown()
    self.server.server_close()

  def _handler(self):
    hub_server = self

    class Handler(http.server.BaseHTTPRequestHandler):
      """One request; HTTP/1.0, so the connection closes after each response."""

      def log_message(self, *args):  # Quiet: the test's output is pytest's.
        pass

      def do_HEAD(self):  # pylint: disable=invalid-name
        self._answer(body=False)

      def do_GET(self):  # pylint: disable=invalid-name
        self._answer(body=True)

      def _answer(self, body: bool) -> None:
        repo, _, rest = urllib.parse.unquote(self.path).partition('/resolve/')
        repo = repo.lstrip('/')
        revision, _, filename = rest.partition('/')
        hub_server.requests[(self.command, filename)] += 1
        if repo in hub_server.statuses:  # A mirror's or proxy's answer: no Hub error code.
          return self._error(hub_server.statuses[repo], None)
        if repo not in hub_server.repos:
          return self._error(404, 'RepoNotFound')
        if revision not in ('main', hub_server.commit(repo)):
          return self._error(404, 'RevisionNotFound')
        if (repo in hub_server.gated
            and self.headers.get('Authorization') != f'Bearer {hub_server.token}'):
          return self._error(403, 'GatedRepo')
        if filename not in hub_server.repos[repo]:
          return self._error(404, 'EntryNotFound', repo)
        if body and hub_server.interrupt and self.headers.get('Range'):
          return self._error(503, None)
        data = hub_server.repos[repo][filename]
        etag = hashlib.sha256(data).hexdigest()
        self.send_response(200)
        for header, value in (('X-Repo-Commit', hub_server.commit(repo)),
                              ('ETag', f'"{etag}"'), ('X-Linked-Etag', f'"{etag}"'),
                              ('X-Linked-Size', str(len(data))),
                              ('Content-Length', str(len(data)))):
          self.send_header(header, value)
        self.end_headers()
        if body:
          self.wfile.write(data[:len(data) // 2] if hub_server.interrupt else data)

      def _error(self, status: int, code: str | None, repo: str | None = None) -> None:
        self.send_response(status)
        if code:
          self.send_header('X-Error-Code', code)
        if repo:
          self.send_header('X-Repo-Commit', hub_server.commit(repo))
        self.send_header('Content-Length', '0')
        self.end_headers()

    return Handler


@pytest.fixture(name='weights_file', scope='module')
def fixture_weights_file(tmp_path_factory) -> str:
  """timm's resnet18 with seeded random weights and NUM_CLASSES classes, as safetensors."""
  requires_extras('timm', 'torch', 'safetensors', 'huggingface_hub')
  import safetensors.torch  # pylint: disable=g-import-not-at-top
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  model = timm.create_model('resnet18', pretrained=False, num_classes=NUM_CLASSES)
  path = str(tmp_path_factory.mktemp('weights') / 'resnet18.safetensors')
  safetensors.torch.save_file(model.state_dict(), path)
  return path


@pytest.fixture(name='model', scope='module')
def fixture_model():
  """Our resnet18 for 32x32 images (built once: building takes seconds); `_load` zeroes it
  before each load, so that no test passes on the weights an earlier load left."""
  return create_backbone('resnet18', image_shape=(32, 32, 3), num_classes=NUM_CLASSES)


@pytest.fixture(name='from_file', scope='module')
def fixture_from_file(model, weights_file) -> dict[str, np.ndarray]:
  """Our resnet18's variables as loaded from the local file."""
  return _load(model, weights_file)


@pytest.fixture(name='served')
def fixture_served(weights_file, tmp_path, monkeypatch):
  """The stand-in Hub serving the weights as REPO (and a gated copy, and a repository without
  weights), with HF_ENDPOINT pointing at it and an empty HF_HOME."""
  with open(weights_file, 'rb') as file:
    data = file.read()
  server = StandInHub({REPO: {'model.safetensors': data, 'config.json': b'{}'},
                      'stand-in/gated': {'model.safetensors': data},
                      'stand-in/no-weights': {'config.json': b'{}'}}, gated=['stand-in/gated'])
  monkeypatch.setenv('HF_ENDPOINT', server.endpoint)
  monkeypatch.setenv('HF_HOME', str(tmp_path / 'hf'))
  for name in ('HF_HUB_CACHE', 'HF_HUB_OFFLINE', 'HF_TOKEN', 'HUGGING_FACE_HUB_TOKEN'):
    monkeypatch.delenv(name, raising=False)
  yield server
  server.stop()


def _load(model, name: str) -> dict[str, np.ndarray]:
  """`model`'s variables after load_pretrained(name), every one zeroed before."""
  for _, variable in weights.model_variables(model):
    variable.set_value(jnp.zeros(variable.shape, variable.dtype))
  loaded, fresh = load_weights(model, 'resnet18', name)
  assert loaded and not fresh
  return {name: np.array(variable[...]) for name, variable in weights.model_variables(model)}


def _assert_equal(values: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
  assert values.keys() == expected.keys()
  for name, value in values.items():
    np.testing.assert_array_equal(value, expected[name], err_msg=name)


def _cache_files(home: str) -> list[str]:
  return sorted(os.path.relpath(os.path.join(folder, name), home)
                for folder, _, names in os.walk(home) for name in names)


def _refused(name: str, reason: str) -> errors.DownloadError:
  with pytest.raises(errors.DownloadError) as raised:
    read_weights(name)
  assert (raised.value.key, raised.value.value, raised.value.reason) == ('init_from', name, reason)
  assert '\n' not in raised.value.one_line()
  return raised.value


def test_first_download_then_the_cache(served, model, from_file, monkeypatch):
  """The first load downloads the file once (HEAD, GET) and equals the local file's weights;
  later loads reuse the cache: with the Hub up (a HEAD, no GET), down, and offline."""
  name = f'hf-hub:{REPO}'
  _assert_equal(_load(model, name), from_file)
  assert served.requests[('GET', 'model.safetensors')] == 1
  blobs = [file for file in _cache_files(os.environ['HF_HOME']) if '/blobs/' in file]
  assert len(blobs) == 1 and blobs[0].startswith('hub/models--stand-in--resnet18.seeded/')

  _assert_equal(_load(model, name), from_file)  # Up: checks the revision, downloads nothing.
  assert served.requests[('GET', 'model.safetensors')] == 1
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')
  before = sum(served.requests.values())
  _assert_equal(_load(model, name), from_file)  # Offline: no request at all.
  assert sum(served.requests.values()) == before
  monkeypatch.delenv('HF_HUB_OFFLINE')
  served.stop()
  _assert_equal(_load(model, name), from_file)  # Down: the cached file, as huggingface_hub does.


def test_revision_and_short_form(served, model, from_file, tmp_path, monkeypatch):
  """`@<revision>` (a branch or a commit) and the short form `timm/<name>`; a local path of
  that form wins over the Hub."""
  _assert_equal(_load(model, f'hf-hub:{REPO}@{served.commit(REPO)}'), from_file)
  served.repos['timm/resnet18.seeded'] = served.repos[REPO]
  monkeypatch.chdir(tmp_path)
  assert isinstance(init_from.parse('timm/resnet18.seeded'), init_from.HubWeights)
  _assert_equal(_load(model, 'timm/resnet18.seeded'), from_file)
  os.makedirs('timm/resnet18.seeded/checkpoints/1/state')  # A workdir of that name...
  assert isinstance(init_from.parse('timm/resnet18.seeded'), init_from.AppCheckpoint)  # ... wins.
  with pytest.raises(errors.ConfigError) as raised:  # A file, even a missing one.
    init_from.parse('timm/resnet18.safetensors')
  assert not isinstance(raised.value, errors.DownloadError)


def test_offline_without_the_cache_is_one_line(served, monkeypatch):
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')
  _refused(f'hf-hub:{REPO}', 'offline_not_cached')
  assert not served.requests  # Not one request.


@pytest.mark.parametrize('name,reason', [
    ('hf-hub:stand-in/missing', 'repository_not_found'),
    ('hf-hub:stand-in/no-weights', 'file_not_found'),
    (f'hf-hub:{REPO}@v9', 'revision_not_found'),
    ('hf-hub:stand-in/gated', 'gated')])
def test_what_the_hub_lacks_is_one_line(served, name, reason):
  _refused(name, reason)
  assert not any(method == 'GET' for method, _ in served.requests)


@pytest.mark.parametrize('status,reason', [(404, 'repository_not_found'),
                                           (401, 'repository_not_found'),
                                           (500, 'http_error')])
def test_a_bare_http_status_is_told_apart_by_its_cause(served, status, reason, retry_waits):
  """Without the Hub's error code, a missing or closed repository (4xx) is a name to fix, not a
  moment to wait; a server's failure (5xx) is."""
  served.statuses['stand-in/behind-a-proxy'] = status
  _refused('hf-hub:stand-in/behind-a-proxy', reason)
  assert bool(retry_waits) == (status >= 500)  # Retried before the line, as for any user.


def test_a_gated_repository_opens_with_hf_token(served, model, from_file, monkeypatch):
  monkeypatch.setenv('HF_TOKEN', served.token)
  _assert_equal(_load(model, 'hf-hub:stand-in/gated'), from_file)


@pytest.fixture(name='retry_waits')
def fixture_retry_waits(monkeypatch) -> list[float]:
  """huggingface_hub retries a refused connection or a server error 5 times over ~24 s, as for
  any user: here its waits are recorded in this list instead of slept (each retry is still
  made)."""
  from huggingface_hub.utils import _http  # pylint: disable=g-import-not-at-top
  waits = []

  class Clock:
    """The time module, but for sleeping."""

    def __getattr__(self, name):
      return getattr(time, name)

    def sleep(self, seconds):
      waits.append(seconds)

  monkeypatch.setattr(_http, 'time', Clock())
  return waits


@pytest.mark.slow
def test_no_network_is_one_line(served, retry_waits):
  served.stop()
  _refused(f'hf-hub:{REPO}', 'no_network')
  assert retry_waits  # It retried before giving up.


def test_an_interrupted_download_leaves_no_broken_entry(served, model, from_file):
  """The server closes the connection mid-file, then fails the resumed request: one line, and
  no blob, snapshot or partial file in the cache; the next run downloads it whole."""
  name = f'hf-hub:{REPO}'
  served.interrupt = True
  _refused(name, 'http_error')
  files = _cache_files(os.environ['HF_HOME'])
  assert not [file for file in files if '/blobs/' in file or '/snapshots/' in file
              or file.endswith('.incomplete')], files
  served.interrupt = False
  _assert_equal(_load(model, name), from_file)


def test_a_malformed_name_is_refused_by_the_config_check(tmp_path):
  """Before any data is read (the dataset folder does not exist) or any request is made."""
  requires_extras('huggingface_hub')
  for name in ('hf-hub:resnet18', 'hf-hub:timm/a/b', 'hf-hub:timm/resnet18@', 'hf-hub:timm/a b'):
    config = default.get_config()
    config.update(dict(data_source='folder', dataset=str(tmp_path / 'none'), model='resnet18',
                       init_from=name))
    with pytest.raises(errors.ConfigError) as raised:
      run_spec.resolve(config)
    assert (raised.value.key, raised.value.value) == ('init_from', name)


@pytest.mark.parametrize('name,reason', [('hf-hub:stand-in/missing', 'repository_not_found'),
                                         ('hf-hub:stand-in/gated', 'gated'),
                                         ('hf-hub:stand-in/failing', 'http_error')])
@pytest.mark.parametrize('preprocess', ['', 'resize(32)'])
def test_what_the_hub_cannot_serve_is_said_before_the_data_is_read(served, tmp_path, name,
                                                                    reason, preprocess,
                                                                    retry_waits):
  """Training downloads the weights first, whether the run takes their preprocessing (then
  resolving the config downloads them) or its own: the dataset folder does not exist, yet the
  error is the download's (reading the data first would have named the folder). A missing
  repository, a gated one without a token, a server's failure: each its own reason."""
  del retry_waits  # The server's failures are retried without sleeping.
  served.statuses['stand-in/failing'] = 500
  config = default.get_config()
  config.update(dict(data_source='folder', dataset=str(tmp_path / 'none'), model='resnet18',
                     init_from=name, preprocess=preprocess))
  with pytest.raises(errors.DownloadError) as raised:
    train.train_and_evaluate(run_spec.resolve(config), str(tmp_path / 'workdir'))
  assert (raised.value.key, raised.value.value, raised.value.reason) == ('init_from', name,
                                                                         reason)
  assert '\n' not in raised.value.one_line()


def test_a_repositorys_own_config_gives_the_preprocessing(served, caplog):
  """As timm reads it: `timm/resnet50.tv_in1k`'s config.json says torchvision's recipe (crop
  0.875, bilinear), not the registered model's a1_in1k (0.95, bicubic); a repository whose
  config.json says nothing leaves the registered one. Each is logged with where it was read."""
  tv_in1k = {'input_size': [3, 224, 224], 'crop_pct': 0.875, 'interpolation': 'bilinear',
             'mean': [0.485, 0.456, 0.406], 'std': [0.229, 0.224, 0.225]}
  served.repos['timm/resnet50.tv_in1k'] = {
      **served.repos[REPO],
      'config.json': json.dumps({'architecture': 'resnet50',
                                 'pretrained_cfg': {'tag': 'tv_in1k', **tv_in1k}}).encode()}
  served.repos['stand-in/resnet50.plain'] = served.repos[REPO]  # Its config.json: {}.
  registered = models.MODELS.capability('resnet50', 'pretrained')
  for name, expected, where in (('hf-hub:timm/resnet50.tv_in1k', tv_in1k, 'config.json'),
                                ('timm/resnet50.tv_in1k', tv_in1k, 'config.json'),
                                ('hf-hub:stand-in/resnet50.plain', registered, 'has no')):
    config = default.get_config()
    config.update(dict(data_source='folder', dataset='none', model='resnet50', init_from=name))
    caplog.clear()
    with caplog.at_level(logging.INFO):
      run = run_spec.resolve(config)
    assert run.input.preprocess.spec == crop.pretrained_spec(expected), name
    logged, = [record.getMessage() for record in caplog.records
               if 'preprocessing as they were trained' in record.getMessage()]
    assert where in logged and f"crop_pct {expected['crop_pct']}" in logged, logged
  assert registered['crop_pct'] != tv_in1k['crop_pct']  # The two differ, so the test can fail.
  assert served.requests[('GET', 'model.safetensors')] == 2  # Downloaded first, once a repo.


def _predict(root: str, inputs: str, init_from: str, workdir: str, env: dict[str, str]):
  """main.py --mode=predict with `init_from`, writing into the (new, empty) `workdir`: the
  process and its predictions.csv."""
  os.makedirs(workdir)
  command = [sys.executable, 'main.py', '--mode=predict', '--config=configs/finetune.py',
             f'--config.dataset={root}', '--config.model=resnet18',
             f'--config.init_from={init_from}', f'--inputs={inputs}', f'--workdir={workdir}']
  process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600,
                           check=False)
  rows = None
  if process.returncode == 0:
    with open(os.path.join(workdir, 'predictions.csv'), encoding='utf-8') as file:
      rows = file.read()
  return process, rows


@pytest.mark.slow
def test_predict_downloads_by_name_then_reads_the_cache(served, weights_file, tmp_path):
  """Issue 47's acceptance: predict with hf-hub:<name> and an empty HF_HOME equals predict with
  the local file; with HF_HUB_OFFLINE=1 and the server stopped, the same from the cache; a
  repository the Hub lacks is one line."""
  root, inputs = str(tmp_path / 'shapes'), str(tmp_path / 'shapes' / 'train')
  sample_folders.make_kind_folder(root, 'shapes', num_images=8, image_sizes=(40, 60),
                                  messy=False)
  env = dict(os.environ)
  # The reference, predict from the local file: main.py --mode=predict's call, in this process
  # (a main.py start less).
  from configs import finetune  # pylint: disable=g-import-not-at-top
  from modes import predict  # pylint: disable=g-import-not-at-top
  config = finetune.get_config()
  config.update(dict(dataset=root, model='resnet18', init_from=weights_file))
  os.makedirs(tmp_path / 'local')
  with open(predict.predict(run_spec.resolve(config), str(tmp_path / 'local'), inputs),
            encoding='utf-8') as file:
    expected = file.read()
  downloaded, rows = _predict(root, inputs, f'hf-hub:{REPO}', str(tmp_path / 'hub'), env)
  assert downloaded.returncode == 0, downloaded.stderr[-2000:]
  assert rows == expected and served.requests[('GET', 'model.safetensors')] == 1
  missing, _ = _predict(root, inputs, 'hf-hub:stand-in/missing', str(tmp_path / 'missing'), env)
  assert missing.returncode != 0 and 'Traceback' not in missing.stderr
  assert 'has no repository stand-in/missing' in missing.stderr.strip().splitlines()[-1]

  served.stop()
  offline, rows = _predict(root, inputs, f'hf-hub:{REPO}', str(tmp_path / 'offline'),
                           {**env, 'HF_HUB_OFFLINE': '1'})
  assert offline.returncode == 0, offline.stderr[-2000:]
  assert rows == expected
