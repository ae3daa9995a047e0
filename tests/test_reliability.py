"""Faults a real run meets: corrupt checkpoints, two runs on one workdir, a changed config on
resume, a full disk, preemption of one of several processes, and user mistakes (one line each).

The in-process runs train the CNN for 8 steps (batch 32 of 'train[:256]'), checkpointing every
4 steps, so a workdir holds checkpoints 4 and 8.
"""

import errno
import gc
import glob
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from configs import default
from core import errors
from core import runtime
from data_sources import base
import train
from training import checkpointing
from training import summaries
from training import workdirs
from training import run_spec
from tests.helpers.build import create
from tests.helpers.runs import saved as _saved
from tests.helpers.runs import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {'train_split': 'train[:256]', 'eval_split': 'test[:256]', 'batch_size': 32,
             'num_epochs': 1, 'checkpoint_every_steps': 4, 'log_every_steps': 4,
             'evaluators': 'loss|accuracy'}


def _config(data_dir, **overrides):
  config = default.get_config()
  config.update({**OVERRIDES, 'data_dir': data_dir, **overrides})
  return config


def _main_command(workdir, data_dir, *flags):
  return [sys.executable, 'main.py', '--config=configs/default.py', f'--workdir={workdir}',
          *(f'--config.{key}={value}' for key, value in {**OVERRIDES, 'data_dir': data_dir}.items()),
          *flags]


def _assert_one_line_error(result, prefix):
  """main.py failed with one line of the given prefix as its last words, and no traceback."""
  assert result.returncode == 1, result.stderr[-3000:]
  return _assert_last_line(result.stderr, prefix)


def _assert_last_line(log, prefix):
  """`log` has no traceback and ends with one line of the given prefix; returns that line."""
  assert 'Traceback' not in log, log[-3000:]
  last = log.strip().splitlines()[-1]
  assert last.startswith(prefix), log[-3000:]
  return last


@pytest.fixture(scope='module')
def trained(tfds_data_dir, tmp_path_factory):
  """A workdir after an uninterrupted 8-step run: checkpoints 4 and 8."""
  workdir = str(tmp_path_factory.mktemp('trained'))
  train.train_and_evaluate(run_spec.resolve(_config(tfds_data_dir)), workdir)
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['4', '8']
  return workdir


def _copy(workdir, tmp_path):
  copy = str(tmp_path / 'run')
  shutil.copytree(workdir, copy)
  return copy


def _damage(checkpoint, how):
  if how == 'truncated data file':
    data = max(glob.glob(os.path.join(checkpoint, 'state', 'ocdbt.process_0', 'd', '*')),
               key=os.path.getsize)
    os.truncate(data, os.path.getsize(data) // 2)
  else:
    os.remove(os.path.join(checkpoint, {'deleted progress metadata': 'progress/metadata',
                                        'deleted manifest': 'state/manifest.ocdbt',
                                        'deleted state metadata': 'state/_METADATA'}[how]))


@pytest.mark.slow
@pytest.mark.parametrize('how', ['truncated data file', 'deleted progress metadata',
                                 'deleted manifest', 'deleted state metadata'])
def test_a_damaged_latest_checkpoint_is_moved_aside_and_the_previous_one_resumes(
    trained, tfds_data_dir, tmp_path, caplog, how):
  workdir = _copy(trained, tmp_path)
  checkpoints = os.path.join(workdir, 'checkpoints')
  _damage(os.path.join(checkpoints, '8'), how)
  with caplog.at_level(logging.WARNING):  # A second epoch: the run resumes (not finished).
    train.train_and_evaluate(run_spec.resolve(_config(tfds_data_dir, num_epochs=2)), workdir)
  warnings = [record.getMessage() for record in caplog.records
              if 'does not restore' in record.getMessage()]
  assert len(warnings) == 1 and warnings[0].startswith('The checkpoint at step 8 does not '
                                                       'restore ('), warnings
  assert f'moved to {checkpoints}/corrupt/8' in warnings[0]
  assert os.path.isdir(os.path.join(checkpoints, 'corrupt', '8'))  # Kept, never deleted.
  # Resumed from step 4, the run ends where the uninterrupted one ended, bit for bit.
  _, resumed = _saved(workdir, 8)
  _, uninterrupted = _saved(trained, 8)
  for name, value in uninterrupted.items():
    np.testing.assert_array_equal(resumed[name], value, err_msg=name)


@pytest.mark.slow
def test_main_falls_back_from_a_damaged_checkpoint_without_a_traceback(trained, tfds_data_dir,
                                                                       tmp_path):
  """As a user sees it: the rerun of main.py prints one warning for the damaged checkpoint and
  no Python traceback (Orbax's threads' reports of the failed read are not printed)."""
  workdir = _copy(trained, tmp_path)
  _damage(os.path.join(workdir, 'checkpoints', '8'), 'truncated data file')
  result = subprocess.run(_main_command(workdir, tfds_data_dir, '--config.num_epochs=2'),
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  assert result.stderr.count('does not restore') == 1
  assert 'Restored checkpoint at step 4 ' in result.stderr


@pytest.mark.slow
def test_when_no_checkpoint_restores_the_run_stops_with_one_line(trained, tfds_data_dir,
                                                                  tmp_path):
  workdir = _copy(trained, tmp_path)
  checkpoints = os.path.join(workdir, 'checkpoints')
  for step in ('4', '8'):
    _damage(os.path.join(checkpoints, step), 'deleted manifest')
  with pytest.raises(errors.CheckpointError) as error:
    train.train_and_evaluate(run_spec.resolve(_config(tfds_data_dir, num_epochs=2)), workdir)
  assert error.value.directory == checkpoints
  assert '(steps 8, 4)' in str(error.value) and f'{checkpoints}/corrupt' in str(error.value)
  assert sorted(os.listdir(os.path.join(checkpoints, 'corrupt'))) == ['4', '8']


def test_a_second_run_on_a_held_workdir_is_refused(tmp_path):
  with workdirs.hold(str(tmp_path)):
    holder = json.loads((tmp_path / workdirs.LOCK_FILE).read_text())
    assert holder['pid'] == os.getpid() and holder['host'] == socket.gethostname()
    with pytest.raises(errors.WorkdirBusy) as error:
      with workdirs.hold(str(tmp_path)):
        pass
    assert error.value.workdir == str(tmp_path)
    assert error.value.holder.startswith(f'pid {os.getpid()} on host {socket.gethostname()}, '
                                         'started ')
  assert not (tmp_path / workdirs.LOCK_FILE).exists()  # Released at the end.


def test_a_run_whose_workdir_was_replaced_leaves_the_new_lock_alone(tmp_path):
  """Deleted and recreated under a stopping run (rm -rf, then a new run on the same path):
  the stopping run ends cleanly and does not remove the new run's lock."""
  workdir = tmp_path / 'run'
  workdir.mkdir()
  with workdirs.hold(str(workdir)):
    shutil.rmtree(workdir)
    workdir.mkdir()
    (workdir / workdirs.LOCK_FILE).write_text('{"pid": 1, "host": "h", "started": "s"}')
  assert (workdir / workdirs.LOCK_FILE).read_text().startswith('{"pid": 1,')
  with workdirs.hold(str(workdir)):
    (workdir / workdirs.LOCK_FILE).unlink()  # Gone: nothing to remove, no error.


def test_the_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path, caplog):
  killed = subprocess.run(
      [sys.executable, '-c', textwrap.dedent(f'''
          import os, signal
          from training import workdirs
          with workdirs.hold({str(tmp_path)!r}):
            print(os.getpid(), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)''')],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  pid = int(killed.stdout)
  with caplog.at_level(logging.WARNING):
    with workdirs.hold(str(tmp_path)):
      assert json.loads((tmp_path / workdirs.LOCK_FILE).read_text())['pid'] == os.getpid()
  assert any(f'Taking over the lock of workdir {tmp_path} from a run that ended without '
             f'releasing it (pid {pid} on host ' in record.getMessage()
             for record in caplog.records)


@pytest.mark.slow
def test_two_runs_on_one_workdir_the_second_is_refused(tfds_data_dir, tmp_path):
  workdir = tmp_path / 'run'
  first = subprocess.Popen(_main_command(workdir, tfds_data_dir, '--config.learning_rate=0.05'),
                           cwd=ROOT, stderr=subprocess.PIPE, text=True)
  try:
    log = []
    for line in first.stderr:  # Wait until the first run holds the workdir and trains.
      log.append(line)
      if 'Training for' in line:
        break
    # Paused while the second run tries, so that it cannot end first however short it is or
    # however loaded the machine (a stopped process keeps its lock).
    first.send_signal(signal.SIGSTOP)
    try:
      second = subprocess.run(_main_command(workdir, tfds_data_dir,
                                            '--config.learning_rate=0.2'),
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
      first.send_signal(signal.SIGCONT)
    log.extend(first.stderr)
    first.wait(timeout=300)
  finally:
    first.kill()
  assert first.returncode == 0, ''.join(log)[-3000:]
  last = _assert_one_line_error(second, f"Workdir busy: Workdir '{workdir}' is in use by another "
                                        f'run (pid {first.pid} on host {socket.gethostname()}')
  assert 'wait for it to end or stop it, or pass another --workdir' in last
  # Nothing of the second run reached the workdir: the config and summaries are the first's.
  assert json.loads((workdir / workdirs.CONFIG_FILE).read_text())['learning_rate'] == 0.05
  event_file_pids = {path.name.split('.')[-3] for path in workdir.glob('events.out.tfevents.*')}
  assert event_file_pids == {str(first.pid)}
  assert not (workdir / workdirs.LOCK_FILE).exists()


@pytest.mark.slow
def test_resuming_with_a_changed_learning_rate_warns_and_a_changed_batch_size_is_refused(
    trained, tfds_data_dir, tmp_path, caplog):
  workdir = _copy(trained, tmp_path)
  with pytest.raises(errors.ConfigError) as error:
    train.train_and_evaluate(run_spec.resolve(_config(tfds_data_dir, batch_size=64)), workdir)
  assert (error.value.key, error.value.value) == ('batch_size', 64)
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(run_spec.resolve(_config(tfds_data_dir, learning_rate=0.05, num_epochs=2)), workdir)
  assert 'eval/accuracy' in summaries.read_metrics(workdir)[16]  # Trained the second epoch.
  assert any('with a changed config: config.learning_rate (0.1 -> 0.05), config.num_epochs '
             '(1 -> 2).' in record.getMessage() for record in caplog.records)
  saved = json.loads(open(os.path.join(workdir, workdirs.CONFIG_FILE)).read())
  assert (saved['learning_rate'], saved['num_epochs']) == (0.05, 2)
  [previous] = glob.glob(os.path.join(workdir, 'config.*T*.json'))
  assert json.loads(open(previous).read())['learning_rate'] == 0.1


def test_io_failure_reads_the_os_reason_from_every_library():
  assert checkpointing.io_failure(OSError(errno.ENOSPC, 'x')) == 'No space left on device'
  orbax = ValueError('RESOURCE_EXHAUSTED: Error writing "a" in OCDBT database: Failed to write '
                     "12 bytes to file 8: No space left on device [os_error_code='28']")
  assert checkpointing.io_failure(orbax) == 'No space left on device'
  try:
    try:
      raise PermissionError(errno.EACCES, 'denied')
    except PermissionError as cause:
      raise RuntimeError('wrapped') from cause
  except RuntimeError as wrapped:
    assert checkpointing.io_failure(wrapped) == 'Permission denied'
  assert checkpointing.io_failure(ValueError('a bug')) is None


def test_io_failure_leaves_errors_that_are_not_the_disks():
  """A host name that does not resolve (errno -2) under a library's connection error, and a
  missing file, are not a full disk: they stay tracebacks or their own errors."""
  try:
    try:
      raise socket.gaierror(socket.EAI_NONAME, 'Name or service not known')
    except socket.gaierror as cause:
      raise ConnectionError('metadata.google.internal') from cause
  except ConnectionError as wrapped:
    assert checkpointing.io_failure(wrapped) is None
  assert checkpointing.io_failure(FileNotFoundError(errno.ENOENT, 'gone')) is None
  assert checkpointing.io_failure(ValueError("failed [os_error_code='2']")) is None


@pytest.mark.slow
def test_a_save_that_fails_for_space_keeps_the_earlier_checkpoints_and_no_leftover(
    trained, tfds_data_dir, tmp_path, monkeypatch):
  """A simulated ENOSPC from Orbax's save; the real full disk is in the test below."""
  workdir = _copy(trained, tmp_path)
  real_save = checkpointing.ocp.CheckpointManager.save

  def save_filling_the_disk(manager, step, *args, **kwargs):
    if step < 12:
      return real_save(manager, step, *args, **kwargs)
    os.makedirs(os.path.join(manager.directory, f'{step}.orbax-checkpoint-tmp', 'state'))
    raise ValueError("RESOURCE_EXHAUSTED: Failed writing: No space left on device "
                     "[os_error_code='28']")

  monkeypatch.setattr(checkpointing.ocp.CheckpointManager, 'save', save_filling_the_disk)
  checkpoints = os.path.join(workdir, 'checkpoints')
  with pytest.raises(errors.StorageError) as error:
    train.train_and_evaluate(run_spec.resolve(_config(tfds_data_dir, num_epochs=2)), workdir)
  assert (error.value.path, error.value.reason) == (checkpoints, 'No space left on device')
  assert 'The earlier checkpoints (steps 4, 8) are kept' in str(error.value)
  assert sorted(os.listdir(checkpoints)) == ['4', '8']


def _can_mount_tmpfs() -> bool:
  if not shutil.which('unshare'):
    return False
  probe = subprocess.run(['unshare', '-rm', 'sh', '-c', 'mount -t tmpfs -o size=1m tmpfs /mnt'],
                         capture_output=True, check=False)
  return probe.returncode == 0


def _train_on_a_small_disk(data_dir, tmp_path, megabytes: int, then):
  """main.py on a real tmpfs of `megabytes` (in a user namespace), then the shell command
  `then(mount, workdir, main_command)`; stdout: 'rc=N', the checkpoints, the temporary files and
  directories left in the workdir, '----', then's output; stderr: main.py's, '----', then's.
  Skips where user namespaces or tmpfs mounts are not allowed."""
  if not _can_mount_tmpfs():
    pytest.skip('needs `unshare -rm` and tmpfs mounts (user namespaces) to make a small disk; '
                'the simulated ENOSPC test above covers the save path')
  mount = tmp_path / 'disk'
  mount.mkdir()
  workdir = mount / 'run'
  command = ' '.join(f"'{arg}'" for arg in _main_command(workdir, data_dir,
                                                         '--config.train_split=train[:512]'))
  script = (f'mount -t tmpfs -o size={megabytes}m tmpfs {mount} && {{ {command}; echo "rc=$?"; '
            f'ls {workdir}/checkpoints; find {workdir} -name "*tmp*"; echo "----"; '
            f'echo "----" >&2; {then(mount, workdir, command)}; }}')
  return workdir, subprocess.run(['unshare', '-rm', 'sh', '-c', script], cwd=ROOT,
                                 capture_output=True, text=True, timeout=600)


def _assert_ended_for_space(listed, log, kept):
  """The run on a full disk: exit code 1, only `kept` checkpoints and no temporary file or
  directory anywhere in the workdir (in `listed`), and one line as its last words, naming what
  is kept."""
  assert listed.split()[0] == 'rc=1', log[-3000:]
  assert listed.split()[1:] == kept  # Nothing but the kept checkpoints: no leftover.
  last = _assert_last_line(log, 'I/O error: ')
  assert 'No space left on device' in last, last
  assert (('The earlier checkpoints (steps 4, 8) are kept' in last) if kept
          else ('No earlier checkpoint was saved' in last)), last
  return last


@pytest.mark.slow
def test_a_full_disk_ends_in_one_line_and_the_rerun_resumes_after_space_is_freed(
    tfds_data_dir, tmp_path):
  """On a real 16 MB tmpfs (in a user namespace): a checkpoint is 6.6 MB, the third does not
  fit; the run leaves no temporary file, and the rerun with more space resumes."""
  workdir, result = _train_on_a_small_disk(
      tfds_data_dir, tmp_path, 16, lambda mount, workdir, command: (
          f'mount -o remount,size=64m {mount} && {command}; echo "rc=$?"; '
          f'ls {workdir}/checkpoints'))
  full, freed = result.stdout.split('----')
  full_log, freed_log = result.stderr.split('----\n')
  last = _assert_ended_for_space(full, full_log, ['4', '8'])
  assert last.startswith(f'I/O error: Could not save the checkpoint at step 12 in '
                         f'{workdir}/checkpoints'), last
  assert 'a save may fail for lack of space' in full_log  # The start-up warning.
  assert freed.split()[0] == 'rc=0' and freed.split()[1:] == [
      '12', '16', '8'], freed_log[-3000:]
  assert 'Restored checkpoint at step 8 ' in freed_log


@pytest.mark.slow
def test_a_disk_that_takes_no_checkpoint_leaves_no_temporary_file(tfds_data_dir, tmp_path):
  """A 4 MB disk (one checkpoint is 6.6 MB): the run ends in one line saying that no
  checkpoint was saved, and leaves no temporary file or directory anywhere in the workdir
  (16 MB, after two checkpoints, is the test above)."""
  _, result = _train_on_a_small_disk(tfds_data_dir, tmp_path, 4, lambda *_: 'true')
  listed, _ = result.stdout.split('----')
  _assert_ended_for_space(listed, result.stderr.split('----\n')[0], [])


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step(tfds_data_dir, tmp_path):
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  env.pop('XLA_FLAGS', None)
  coordinator = f'--coordinator_address=127.0.0.1:{free_port()}'
  runs = [subprocess.Popen(
      _main_command(tmp_path, tfds_data_dir, '--config.train_split=train[:4096]',
                    '--config.checkpoint_every_steps=1000', coordinator, '--num_processes=2',
                    f'--process_id={i}'),
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  try:
    # Process 0 writes the train metrics every 4 steps: once step 8's are there, process 1
    # gets a SIGTERM.
    deadline = time.time() + 300
    while 8 not in summaries.read_metrics(tmp_path) and time.time() < deadline:
      time.sleep(0.2)
    runs[1].send_signal(signal.SIGTERM)
    logs = [run.communicate(timeout=300)[0].splitlines(True) for run in runs]
  finally:
    for run in runs:
      run.kill()
  assert [run.returncode for run in runs] == [128 + signal.SIGTERM] * 2, ''.join(logs[0])[-3000:]
  saved = [{int(step) for step in re.findall(r'Saved checkpoint at step (\d+)',
                                                            ''.join(log))} for log in logs]
  assert saved[0] == saved[1] and len(saved[0]) == 1, saved
  [step] = saved[0]
  assert 8 < step < 128
  assert os.listdir(tmp_path / 'checkpoints') == [str(step)]
  for log in logs:
    assert f'Received SIGTERM: saved a checkpoint at step {step}' in ''.join(log)
    assert 'Reached preemption sync point' not in ''.join(log)  # Orbax's, 3-4 times a process.


def _trained_nothing(workdir) -> bool:
  """Nothing of a training run is in `workdir`: no checkpoint, no metrics."""
  checkpoints = os.path.join(workdir, checkpointing.CHECKPOINT_DIR)
  return not (os.path.isdir(checkpoints) and os.listdir(checkpoints)) and not os.path.exists(
      os.path.join(workdir, summaries.METRICS_FILE))


@pytest.mark.slow
@pytest.mark.parametrize('flags,line', [
    (['--config.train_split=trian'],
     "Config error: config.train_split='trian' is not a split of mnist: Unknown split 'trian'. "
     "Should be one of ['train', 'test']."),
    (['--config=CONFIG_DIR/syntax.py'],
     'Config error: the config file CONFIG_DIR/syntax.py has a syntax error at line 1'),
    (['--config=CONFIG_DIR/no_get_config.py'],
     "Config error: the config file 'CONFIG_DIR/no_get_config.py' has no get_config() function"),
])
def test_user_mistakes_end_in_one_line_before_training(tfds_data_dir, tmp_path, flags, line):
  """As main.py prints them: a config file it cannot read, and a mistake found in the data (the
  other data mistakes' typed errors are the test below's)."""
  (tmp_path / 'syntax.py').write_text('def get_config(:\n  pass\n')
  (tmp_path / 'no_get_config.py').write_text('CONFIG = {}\n')
  flags = [flag.replace('CONFIG_DIR', str(tmp_path)) for flag in flags]
  command = (_main_command(tmp_path / 'run', tfds_data_dir, *flags)
             if flags[0].startswith('--config.') else
             [sys.executable, 'main.py', *flags, f'--workdir={tmp_path / "run"}'])
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
  _assert_one_line_error(result, line.replace('CONFIG_DIR', str(tmp_path)))
  assert _trained_nothing(tmp_path / 'run')


@pytest.mark.parametrize('overrides,error_type,fields', [
    ({'train_split': 'trian'}, errors.ConfigError, {'key': 'train_split', 'value': 'trian'}),
    ({'eval_split': 'test[:0]'}, errors.ConfigError, {'key': 'eval_split', 'value': 'test[:0]'}),
    # No internet here (only package registries): an empty data dir has nothing to prepare from.
    ({'data_dir': 'EMPTY'}, errors.DataError, {'what': 'EMPTY/downloads/manual'}),
])
def test_data_mistakes_are_typed_errors_before_training(tfds_data_dir, tmp_path, overrides,
                                                        error_type, fields):
  empty = str(tmp_path / 'empty')
  overrides = {key: value.replace('EMPTY', empty) for key, value in overrides.items()}
  workdir = str(tmp_path / 'run')
  with pytest.raises(error_type) as error:
    train.train_and_evaluate(run_spec.resolve(_config(**{'data_dir': tfds_data_dir,
                                                         **overrides})), workdir)
  assert error.value.fields == {key: value.replace('EMPTY', empty)
                                for key, value in fields.items()}
  assert _trained_nothing(workdir)


def test_split_mistakes_are_config_errors_before_any_data_is_read():
  source = base.RangeSource('tiny', {'train': 10, 'test': 5}, 2,
                            lambda split, part: pytest.fail('data was read'))
  for split in ('train[:0]', 'tset'):
    with pytest.raises(errors.ConfigError) as error:
      source.split_size('eval_split', split)
    assert (error.value.key, error.value.value) == ('eval_split', split)


def test_asyncio_reports_of_orbax_tasks_are_not_printed():
  """The unretrieved exception of an Orbax task, logged by asyncio when it is collected after a
  failed restore, is dropped by the log filter set at start-up; asyncio's other records and
  the app's own are kept."""
  raiser = {}
  exec(compile("def read():\n  raise Exception('Encountered error while reading array index')\n",
               os.path.join('site-packages', 'orbax', 'checkpoint', 'serialization.py'), 'exec'),
       raiser)
  try:
    raiser['read']()
  except Exception:  # pylint: disable=broad-except
    exc_info = sys.exc_info()
  def record(name, exc_info):
    return logging.LogRecord(name, logging.ERROR, f'{name}/base_events.py', 1,
                             'Task exception was never retrieved', (), exc_info)
  assert not runtime._not_reported_by_the_app(record('asyncio', exc_info))
  assert runtime._not_reported_by_the_app(record('asyncio', None))
  assert runtime._not_reported_by_the_app(record('absl', exc_info))


def test_the_quiet_console_drops_the_info_lines_of_installed_packages():
  """Libraries' INFO lines are hidden whether pip put them in a virtualenv (also one inside the
  app's directory) or in Debian's dist-packages (the system Python of Colab and Cloud TPU
  VMs); the app's own lines, a user's config file's, clu's and every warning are shown."""
  app = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  def shown(path, level=logging.INFO):
    return runtime._app_or_warning(logging.LogRecord('absl', level, path, 1, 'x', (), None))
  for library in ('/venv/lib/python3.11/site-packages/orbax/checkpoint/a.py',
                  '/usr/local/lib/python3.10/dist-packages/orbax/checkpoint/a.py',
                  os.path.join(app, '.venv', 'lib', 'site-packages', 'tensorflow_datasets', 'a.py')):
    assert not shown(library), library
    assert shown(library, logging.WARNING), library
  assert shown(os.path.join(app, 'training', 'hooks.py'))
  assert shown('/home/me/experiments/my_config.py')
  assert shown('/usr/local/lib/python3.10/dist-packages/clu/parameter_overview.py')


def _two_checkpoints(directory):
  """Checkpoints of steps 1 and 2 of the MLP in `directory`, the second one damaged."""
  state, _ = create(model='mlp')
  checkpoints = checkpointing.Checkpoints(directory)
  progress = {'epoch': 0, 'step_in_epoch': 1, 'steps_per_epoch': 10, 'hooks': {}}
  checkpoints.save(1, state, progress)
  checkpoints.save(2, state, progress)
  _damage(os.path.join(checkpoints.directory, '2'), 'truncated data file')
  return state, checkpoints


def test_a_failed_restore_leaves_no_read_behind_to_report_later(tmp_path, capfd):
  """Nothing of the damaged checkpoint's failed read reaches stderr, then or later (Orbax's
  abandoned reads used to end in 'Event loop is closed' and 'Exception ignored in' reports)."""
  state, checkpoints = _two_checkpoints(str(tmp_path))
  assert checkpoints.restore_newest(state, move_aside=True)[0] == 1
  checkpoints.close()
  gc.collect()
  time.sleep(1)  # Reads TensorStore would still have in flight end meanwhile.
  assert 'Traceback' not in capfd.readouterr().err


def test_a_damaged_checkpoint_to_initialise_from_is_one_checkpoint_error(tmp_path):
  _, checkpoints = _two_checkpoints(str(tmp_path))
  checkpoints.close()
  damaged = os.path.join(checkpoints.directory, '2', 'state')
  with pytest.raises(errors.CheckpointError) as error:
    checkpointing.read_state(damaged)
  assert error.value.directory == os.path.dirname(damaged)
  assert checkpointing.read_state(os.path.join(checkpoints.directory, '1', 'state'))


def test_reports_of_other_threads_during_saves_and_a_failed_restore_reach_the_hooks(
    tmp_path, monkeypatch):
  """Saves and restores leave the process's hooks alone: an unrelated thread that fails
  meanwhile is reported through threading.excepthook, also while a save fails for space and
  while a damaged checkpoint's restore fails and falls back to the one before."""
  reports = []
  monkeypatch.setattr(threading, 'excepthook', lambda report: reports.append(
      str(report.exc_value)))
  hooks = (sys.excepthook, sys.unraisablehook, threading.excepthook)

  def unrelated_thread_fails(name):
    def fail():
      raise RuntimeError(name)
    thread = threading.Thread(target=fail)
    thread.start()
    thread.join()

  manager = checkpointing.ocp.CheckpointManager
  real_save, real_restore = manager.save, manager.restore

  def save(self, step, *args, **kwargs):
    unrelated_thread_fails(f'save {step}')
    if step == 3:
      raise ValueError("RESOURCE_EXHAUSTED: No space left on device [os_error_code='28']")
    return real_save(self, step, *args, **kwargs)

  def restore(self, step, *args, **kwargs):
    unrelated_thread_fails(f'restore {step}')
    return real_restore(self, step, *args, **kwargs)

  real_verify = checkpointing.verify_readable

  def verify_readable(path):
    unrelated_thread_fails(f'read {os.path.basename(os.path.dirname(path))}')
    return real_verify(path)

  monkeypatch.setattr(manager, 'save', save)
  monkeypatch.setattr(manager, 'restore', restore)
  monkeypatch.setattr(checkpointing, 'verify_readable', verify_readable)
  state, _ = create(model='mlp')
  checkpoints = checkpointing.Checkpoints(str(tmp_path))
  progress = {'epoch': 0, 'step_in_epoch': 1, 'steps_per_epoch': 10, 'hooks': {}}
  checkpoints.save(1, state, progress)
  checkpoints.save(2, state, progress)
  with pytest.raises(errors.StorageError):
    checkpoints.save(3, state, progress)
  _damage(os.path.join(checkpoints.directory, '2'), 'truncated data file')
  assert checkpoints.restore_newest(state, move_aside=True)[0] == 1
  checkpoints.close()
  assert reports == ['save 1', 'save 2', 'save 3', 'read 2', 'read 1', 'restore 1']
  assert (sys.excepthook, sys.unraisablehook, threading.excepthook) == hooks
