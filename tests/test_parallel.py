"""Data parallelism and FSDP: 8 simulated devices in one process (several processes:
test_launch.py)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import default
from core import errors
from data_sources import base
import evaluators
import input_pipeline
from tests.helpers import build
from training import run_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs in a subprocess with 8 CPU devices: 3 train steps on real MNIST (global batch 128) and an
# eval of the whole test split, on a 1-device mesh, on all 8 devices with data parallelism
# (config.fsdp=1) and with FSDP (config.fsdp=4: a (2, 4) mesh). Prints JSON: the metrics of
# each, the largest parameter difference from the 1-device run's, the state and batch
# shardings, and how many compilations the later train dispatches needed.
_EIGHT_DEVICE_SCRIPT = r'''
import json, sys
from core import runtime  # First, as in main.py: a later triton import segfaults (its docstring).
import jax, numpy as np
from flax import nnx
import input_pipeline
import evaluators
from training import evaluation, parallel, run_spec, state as state_lib
from configs import default

config = default.get_config()
config.data_dir = sys.argv[1]
config.eval_batch_size = 1001  # Rounded up to 1008 on 8 devices: padding must stay masked.
run = run_spec.resolve(config)
data = input_pipeline.open_data(run.input, run.eval_splits())
split = data.source.load_split('train[:384]')
batches = {'image': split.images.reshape(3, 128, 28, 28, 1).astype(np.float32) / 255,
           'label': split.labels.reshape(3, 128)}
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kwargs: compiles.append(event)
    if event == '/jax/core/compile/backend_compile_duration' else None)
auto = (jax.sharding.AxisType.Auto,) * 2
out = {}
for name, mesh in (('one', jax.make_mesh((1, 1), ('data', 'fsdp'), axis_types=auto,
                                         devices=jax.devices()[:1])),
                   ('data', parallel.create_mesh()), ('fsdp', parallel.create_mesh(fsdp=4))):
  with jax.set_mesh(mesh):
    state = state_lib.create(run.model, data.info, run.optimization,
                             run.optimization.learning_rate_schedule(3), seed=run.seed)
    train_step = state_lib.make_train_step(run.loss(10), run.input.preprocess)
    for step in range(3):
      if step == 1:
        compiles.clear()
      batch = parallel.shard(jax.tree.map(lambda x: x[step], batches), mesh)
      train_step(state, batch)
    later_compiles = len(compiles)
    result = evaluation.Evaluation(
        'eval', config.eval_split, evaluators.create('loss|accuracy|per_class'),
        data.preprocess).run(state.eval_model(), input_pipeline.open_eval_batches(
            data, run.input, config.eval_split, 10_000,
            parallel.round_up(run.eval_batch_size, mesh), place=lambda b: parallel.shard(b, mesh)),
            data.info)
  out[name] = {**state.epoch.results(), **result.scalars,
               'support': int(result.per_class['support'].sum()),
               'later_train_compiles': later_compiles,
               'batch_spec': str(batch['image'].sharding.spec),
               'state_specs': sorted({str(x.sharding.spec) for x in jax.tree.leaves(
                   nnx.state(state))}),
               'state_devices': len(jax.tree.leaves(nnx.state(state.model))[0].sharding.device_set),
               'largest_kernel_shard': max(
                   x.addressable_shards[0].data.shape for x in jax.tree.leaves(
                       nnx.state(state.model, nnx.Param)) if x.ndim == 2)}
  out[name + '_params'] = jax.tree.map(np.asarray, nnx.state(state.model, nnx.Param,
                                                             nnx.BatchStat))
for name in ('data', 'fsdp'):
  differences = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))),
                             out['one_params'], out[name + '_params'])
  out[name]['max_param_difference'] = max(jax.tree.leaves(differences))
del out['one_params'], out['data_params'], out['fsdp_params']
print('RESULT', json.dumps(out))
'''


@pytest.mark.slow
def test_data_parallelism_and_fsdp_on_eight_devices_match_one_device(tfds_data_dir):
  env = {**os.environ, 'XLA_FLAGS': '--xla_force_host_platform_device_count=8',
         'JAX_PLATFORMS': 'cpu'}
  result = subprocess.run([sys.executable, '-c', _EIGHT_DEVICE_SCRIPT, tfds_data_dir],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.split('RESULT ')[-1])
  one = out['one']
  for name in ('data', 'fsdp'):
    run = out[name]
    assert run['batch_spec'] == "P(('data', 'fsdp'),)", name
    assert run['state_devices'] == 8, name
    # Steps 2 and 3 reuse the executable that step 1 compiled: the updated state keeps the
    # shardings it came in with.
    assert run['later_train_compiles'] == 0, name
    assert run['max_param_difference'] < 1e-5, name
    assert run['support'] == 10_000  # Every example once, padding masked.
    for key in ('train/loss', 'train/accuracy', 'eval/loss', 'eval/accuracy', 'eval/macro_f1'):
      # Sums over 8 devices add in another order; after 3 steps many test images sit near a
      # decision boundary, where that may flip the argmax of an example or two.
      tolerance = 3e-4 if key in ('eval/accuracy', 'eval/macro_f1') else 0
      assert run[key] == pytest.approx(one[key], rel=1e-5, abs=tolerance), (name, key)
  assert out['data']['state_specs'] == ['P()']  # Data parallelism: every array whole.
  # FSDP: the large arrays split over the 4 devices of each 'fsdp' row (the (3136, 256) dense
  # kernel into (784, 256) pieces), the small ones whole.
  assert out['fsdp']['state_specs'] == ["P('fsdp',)", 'P()']
  assert out['fsdp']['largest_kernel_shard'] == [784, 256]
  assert out['data']['largest_kernel_shard'] == [3136, 256]


def test_batch_size_must_divide_by_the_device_count():
  config = default.get_config()
  config.batch_size = 130
  info = base.DatasetInfo('mnist', (28, 28, 1), 10, 60_000, 10_000)
  with pytest.raises(errors.ConfigError) as error:
    run_spec.resolve(config).check_against_data(info, num_devices=4)
  assert (error.value.key, error.value.value) == ('batch_size', 130)
  assert 'such as 132' in str(error.value)
  run_spec.resolve(config).check_against_data(info, num_devices=2)


@pytest.mark.slow
def test_bad_process_flags_exit_with_the_fix(tmp_path):
  result = subprocess.run(
      [sys.executable, 'main.py', '--config=configs/default.py', f'--workdir={tmp_path}',
       '--coordinator_address=127.0.0.1:1', '--num_processes=2', '--process_id=2'],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  assert 'Flag error: --coordinator_address=127.0.0.1:1 --num_processes=2 --process_id=2' in (
      result.stderr)
  assert 'a distinct --process_id in [0, num_processes)' in result.stderr


def test_a_cluster_jax_cannot_read_leaves_a_single_process_and_a_warning():
  """A process that JAX's detection takes for part of a cluster it then fails to read (here an
  Open MPI address it cannot parse; on a TPU host, a metadata server out of reach) still trains
  alone on its own devices, as a JAX program that never calls `initialize` would."""
  def initialized(arguments: str) -> str:
    """The stderr of a process that calls `parallel.initialize(arguments)` there, once it
    printed one process with all its devices."""
    program = (f'from training import parallel; parallel.initialize({arguments}); '
               'import jax; print(jax.process_count(), jax.device_count())')
    result = subprocess.run(
        [sys.executable, '-c', program], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, 'JAX_PLATFORMS': 'cpu', 'OMPI_MCA_orte_hnp_uri': '1.0;no-address'})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ['1', str(jax.device_count())]
    return result.stderr

  assert ('JAX found signs of a cluster but could not read it (RuntimeError'
          in initialized('None, None, None'))
  # --num_processes=1: the same process, without asking JAX's detection (no warning).
  assert 'JAX found signs of a cluster' not in initialized('None, 1, None')


def test_eval_batches_pad_to_the_requested_number_of_batches():
  split = input_pipeline.InMemory(images=np.ones((7, 2, 2, 1), np.uint8),
                               labels=np.arange(7, dtype=np.int32))
  batches = input_pipeline.eval_batches(split, batch_size=3,
                                       num_batches=4)
  assert [len(batch['label']) for batch in batches] == [3, 3, 3, 3]
  mask = np.concatenate([batch['mask'] for batch in batches])
  assert mask.sum() == 7 and not mask[7:].any()


def test_two_processes_count_every_example_of_an_odd_split_once(tfds_data_dir, monkeypatch):
  """eval/num_examples, counted from the masks of each process's padded slice, sums to the
  split's size; the real examples of the two slices are the split's, each once, in order."""
  split, size = 'test[:101]', 101
  config = default.get_config()
  config.update(data_dir=tfds_data_dir, train_split='train[:128]', eval_split=split)
  run = run_spec.resolve(config)
  data = build.open_data(config)
  assert data.eval_sizes['eval'] == size

  def process_slice(index, count, batch_size):
    """What process `index` of `count` feeds the eval steps: its batches, its count."""
    monkeypatch.setattr(jax, 'process_index', lambda: index)
    monkeypatch.setattr(jax, 'process_count', lambda: count)
    batches = list(input_pipeline.open_eval_batches(data, run.input, split, size, batch_size))
    counter = evaluators.Count()
    state = counter.init(data.info)
    for batch in batches:
      state = counter.update(state, None, batch)
    real = np.concatenate([batch['image'][batch['mask']] for batch in batches])
    return len(batches), counter.results(state, data.info)[counter.name], real

  whole = process_slice(0, 1, 16)[2]
  (batches_0, count_0, real_0), (batches_1, count_1, real_1) = [
      process_slice(index, 2, 16) for index in (0, 1)]
  assert (count_0, count_1) == (51, 50)  # The slices differ by one; the smaller is padded more.
  assert batches_0 == batches_1 == 7  # 7 local batches of 8 each: the same number of steps.
  assert count_0 + count_1 == size
  np.testing.assert_array_equal(np.concatenate([real_0, real_1]), whole)


# Builds ViT-Ti's fine-tuning state (AdamW, EMA) on 4 CPU devices, over the devices and on the
# host (as on an accelerator: `Planned.build(on_host=True)`), replicated and with FSDP. Prints
# JSON: whether values and shardings are equal, the devices of the host's arrays, and whether
# the mesh in force is the same after.
_HOST_BUILD_SCRIPT = r'''
import json
from core import runtime
import jax, numpy as np
from flax import nnx
from configs import finetune
from data_sources import base
from training import parallel, run_spec, state as state_lib

config = finetune.get_config()
config.model = 'vit_tiny_patch16_224'
run = run_spec.resolve(config)
info = base.DatasetInfo('random', (32, 32, 3), 10, 80, 0)
host_devices = []
device_put = jax.device_put
jax.device_put = lambda x, s: (host_devices.extend(
    len(leaf.sharding.device_set) for leaf in jax.tree.leaves(x)), device_put(x, s))[1]
key_data = lambda x: (jax.random.key_data(x)
                      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
out = {}
for fsdp in (1, 2):
  mesh = parallel.create_mesh(fsdp=fsdp)
  with jax.set_mesh(mesh):
    planned = state_lib.plan(run.model, info, run.optimization,
                             run.optimization.learning_rate_schedule(10), seed=0,
                             ema_decay=run.ema_decay)
    on_devices, on_host = planned.build(), planned.build(on_host=True)
    mesh_after = jax.sharding.get_mesh()
  pairs = list(zip(jax.tree.leaves(nnx.state(on_devices)), jax.tree.leaves(nnx.state(on_host))))
  out[fsdp] = {'arrays': len(pairs),
               'equal': all(np.array_equal(key_data(a), key_data(b)) for a, b in pairs),
               'same_shardings': all(a.sharding == b.sharding for a, b in pairs),
               'split_arrays': sum(a.sharding.spec != b.sharding.spec or
                                   not a.sharding.is_fully_replicated for a, b in pairs),
               'mesh_kept': mesh_after == mesh}
out['host_devices'] = sorted(set(host_devices))
print('RESULT', json.dumps(out))
'''


@pytest.mark.slow
def test_a_state_built_on_the_host_equals_one_built_over_the_devices():
  env = {**os.environ, 'XLA_FLAGS': '--xla_force_host_platform_device_count=4',
         'JAX_PLATFORMS': 'cpu'}
  result = subprocess.run([sys.executable, '-c', _HOST_BUILD_SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.split('RESULT ')[-1])
  assert out['host_devices'] == [1]  # Computed on the host's one device, then placed.
  for fsdp in ('1', '2'):
    assert out[fsdp]['arrays'] > 100
    assert out[fsdp]['equal'] and out[fsdp]['same_shardings'] and out[fsdp]['mesh_kept']
  assert out['1']['split_arrays'] == 0 and out['2']['split_arrays'] > 0
