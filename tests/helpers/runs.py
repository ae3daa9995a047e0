"""What a run leaves and how it is stopped: a checkpoint's arrays, the TensorBoard scalars of a
workdir, a training interrupted as by a SIGTERM, a free port for a coordinator or a server."""

import os
import signal
import socket

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from tensorboard.backend.event_processing import event_accumulator
import tensorflow as tf

from core import runtime
import train
from training import checkpointing
from training import run_spec


def saved(workdir, step=None):
  """(step, {leaf name: array}) of the state of a checkpoint (default: the latest)."""
  manager = ocp.CheckpointManager(os.path.join(workdir, checkpointing.CHECKPOINT_DIR))
  step = manager.latest_step() if step is None else step
  path = os.path.join(manager.directory, str(step), 'state')
  checkpointer = ocp.StandardCheckpointer()
  # Onto this process's first device, whatever devices and processes saved it.
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  tree = checkpointer.restore(path, jax.tree.map(
      lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
      checkpointer.metadata(path).item_metadata))
  return step, {jax.tree_util.keystr(path): np.asarray(
      jax.random.key_data(leaf) if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
      else leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def scalars(workdir):
  """{tag: [(step, value)]} of every scalar summary in the event files of `workdir`."""
  accumulator = event_accumulator.EventAccumulator(workdir, size_guidance={'tensors': 0})
  accumulator.Reload()
  return {tag: [(event.step, float(tf.make_ndarray(event.tensor_proto)))
                for event in accumulator.Tensors(tag)]
          for tag in accumulator.Tags()['tensors']
          if accumulator.SummaryMetadata(tag).plugin_data.plugin_name == 'scalars'}


def train_until_a_sigterm_at(stop_step: int, config, workdir: str, monkeypatch) -> None:
  """Trains `config` in `workdir` as if a SIGTERM arrived at `stop_step`: saved, interrupted."""
  def stop_at(signals, step):
    signals.received = signal.SIGTERM
    return step == stop_step
  with monkeypatch.context() as patch:
    patch.setattr(runtime.StopSignals, 'reached', stop_at)
    with pytest.raises(runtime.Interrupted):
      train.train_and_evaluate(run_spec.resolve(config), workdir)


def assert_resumes_bit_exactly(config, tmp_path, monkeypatch, stop_step: int,
                               last_step: int) -> dict:
  """Trains `config` whole, and again stopped at `stop_step` (as by a SIGTERM) then resumed:
  both end at `last_step` in the same state, which is returned ({leaf name: array})."""
  whole, halves = str(tmp_path / 'whole'), str(tmp_path / 'halves')
  train.train_and_evaluate(run_spec.resolve(config), whole)
  train_until_a_sigterm_at(stop_step, config, halves, monkeypatch)
  assert saved(halves)[0] == stop_step
  train.train_and_evaluate(run_spec.resolve(config), halves)
  (step, state), (resumed_step, resumed) = saved(whole), saved(halves)
  assert step == resumed_step == last_step
  for name, value in state.items():
    np.testing.assert_array_equal(resumed[name], value, err_msg=name)
  return state


def free_port() -> int:
  with socket.socket() as sock:
    sock.bind(('127.0.0.1', 0))
    return sock.getsockname()[1]
