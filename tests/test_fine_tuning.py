"""Fine-tuning and real-world training options: init_from with a new head, frozen layers and
learning-rate multipliers, class weights, Mixup/CutMix, any optax optimizer, clipping,
schedules."""

import dataclasses
import json
import os
import shutil

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorflow as tf

from configs import default
from configs import finetune
from backbones import resnet
from backbones import vit
from backbones import weights
from core import errors
import input_pipeline
import models
import preprocessing
from preprocessing import mix
import train
from training import checkpointing
from training import init_from
from training import losses
from training import optimizers
from training import state as state_lib
from training import run_spec
from tests.helpers.plugins import stripes_config
from tests.helpers.build import INFO
from tests.helpers.build import create
from tests.helpers.build import random_batch
from tests.helpers.runs import assert_resumes_bit_exactly
from tests.helpers import build
import image_folders


def _weights(model):
  return {name: np.array(variable[...]) for name, variable in weights.model_variables(model)}


@pytest.mark.slow  # Compiles several training programs.
def test_init_from_loads_matching_weights_and_reinitialises_a_new_head(tmp_path):
  source = stripes_config()
  source.update(model='cnn', loss='cross_entropy', optimizer='sgd', preprocess='', num_epochs=1,
                evaluators='loss|accuracy', best_metric='eval/accuracy', ema_decay=0.5)
  source.model_options.cnn.update(conv1_features=4, conv2_features=8, hidden_features=16)
  train.train_and_evaluate(run_spec.resolve(source), str(tmp_path / 'source'))
  saved = checkpointing.read_state(checkpointing.checkpoint_path(str(tmp_path / 'source')))

  # The same model with 3 classes: everything but the head comes from the EMA of the source.
  target = default.get_config()
  target.model_options.cnn.update(conv1_features=4, conv2_features=8, hidden_features=16)
  info = INFO.__class__(**{**INFO.__dict__, 'image_shape': (8, 8, 1), 'num_classes': 3})
  state = build.create_state(target, info, 10)
  source_checkpoint = os.path.dirname(checkpointing.checkpoint_path(str(tmp_path / 'source')))
  loaded, fresh = init_from.load_checkpoint(state.model, source_checkpoint)
  assert sorted(fresh) == ['linear2.bias ((3,), (2,) there)',
                           'linear2.kernel ((16, 3), (16, 2) there)']
  assert 'conv1.kernel' in loaded and 'batch_norm1.mean' in loaded and len(loaded) == 14
  _, fresh = init_from.load_checkpoint(  # A head excluded by name.
      state.model, source_checkpoint, ('linear',))
  assert len(fresh) == 4 and all('init_exclude' in name for name in fresh)
  now = _weights(state.model)
  np.testing.assert_array_equal(now['conv1.kernel'], saved['ema.params.conv1.kernel'])
  # The workdir's best checkpoint is found by its record alone: the config it was trained with
  # is not read, so keys this version no longer knows do not matter.
  with open(tmp_path / 'source' / 'config.json', 'w', encoding='utf-8') as file:
    json.dump({'model': 'a_removed_model', 'best_metric': 'eval/a_removed_metric'}, file)
  loaded, _ = init_from.load_checkpoint(state.model, str(tmp_path / 'source'))
  assert len(loaded) == 14
  # Nothing matching: one line naming init_from.
  mlp = default.get_config()
  mlp.update(model='mlp', init_from=str(tmp_path / 'source'), data_source='stripes_for_test',
             dataset='s', eval_split='test', batch_size=16, num_epochs=1)
  mlp.data_source_options.stripes_for_test = {'size': 8}
  with pytest.raises(errors.ConfigError) as error:
    train.train_and_evaluate(run_spec.resolve(mlp), str(tmp_path / 'mlp'))
  assert error.value.key == 'init_from'


@pytest.mark.parametrize('class_names,keep_head,head_loaded', [
    (('left', 'right'), False, False),  # Other classes: the head starts fresh.
    (('left', 'right'), True, True),  # ... unless config.init_keep_head.
    (('horizontal', 'vertical'), False, True)])  # The source's own classes: loaded.
def test_a_head_trained_on_other_class_names_starts_fresh(tmp_path_factory, class_names,
                                                         keep_head, head_loaded):
  source_dir = tmp_path_factory.getbasetemp() / 'stripes_source'
  if not source_dir.exists():  # One source run for the three cases.
    source = stripes_config()  # Two classes: 'horizontal' and 'vertical'.
    source.update(model='cnn', loss='cross_entropy', optimizer='sgd', preprocess='',
                  num_epochs=1, evaluators='loss|accuracy', best_metric='eval/accuracy')
    source.model_options.cnn.update(conv1_features=4, conv2_features=8, hidden_features=16)
    train.train_and_evaluate(run_spec.resolve(source), str(source_dir))
  saved = checkpointing.read_state(checkpointing.checkpoint_path(str(source_dir)))
  target = default.get_config()
  target.model_options.cnn.update(conv1_features=4, conv2_features=8, hidden_features=16)
  target.update(init_from=str(source_dir), init_keep_head=keep_head)
  info = dataclasses.replace(INFO, image_shape=(8, 8, 1), num_classes=2,
                             class_names=class_names)
  state = build.create_state(target, info, 10)
  initial = _weights(state.model)
  run = run_spec.resolve(target)
  init_from.load(run.init_from, state, run.model, info)
  now = _weights(state.model)
  np.testing.assert_array_equal(now['conv1.kernel'], saved['model.conv1.kernel'])
  np.testing.assert_array_equal(now['linear1.kernel'], saved['model.linear1.kernel'])
  for name in ('linear2.kernel', 'linear2.bias'):
    expected = saved[f'model.{name}'] if head_loaded else initial[name]
    np.testing.assert_array_equal(now[name], expected)
  assert not np.array_equal(saved['model.linear2.kernel'], initial['linear2.kernel'])


@pytest.mark.slow  # Compiles several training programs.
def test_frozen_parameters_and_batch_norm_statistics_do_not_move():
  state, train_step = create(freeze=('conv1', 'batch_norm1'), lr_multipliers={'linear2': 10.0})
  before = _weights(state.model)
  for seed in range(3):
    train_step(state, random_batch(32, seed))
  after = _weights(state.model)
  for name in before:
    frozen = name.startswith(('conv1.', 'batch_norm1.'))
    assert np.array_equal(before[name], after[name]) == frozen, name
  assert state.model.batch_norm1.use_running_average  # Normalises with its own statistics.
  assert not state.model.batch_norm2.use_running_average
  # The multiplier scales the head's update: 10x the plain run's first step.
  plain, plain_step = create()
  scaled, scaled_step = create(lr_multipliers={'linear2': 10.0})
  starts = [_weights(s.model)['linear2.kernel'] for s in (plain, scaled)]
  plain_step(plain, random_batch(32))
  scaled_step(scaled, random_batch(32))
  np.testing.assert_allclose(_weights(scaled.model)['linear2.kernel'] - starts[1],
                             10 * (_weights(plain.model)['linear2.kernel'] - starts[0]),
                             rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('ema_decay', [0.0, 0.9])
def test_frozen_batch_norm_statistics_stay_as_loaded_through_precise_batch_norm(ema_decay):
  """What eval normalises with: a frozen BatchNorm's statistics as loaded, bit for bit, after
  training steps and the precise-BN recompute before the eval (of the EMA's model when there
  is one); an unfrozen BatchNorm's recomputed."""
  state, train_step = create(freeze=('conv', 'batch_norm1'), ema_decay=ema_decay)
  rng = np.random.default_rng(0)
  # Statistics as a checkpoint would give them: not the initial 0 and 1, which averaging keeps.
  loaded = {name: rng.uniform(0.1, 2.0, (32,)).astype(np.float32) for name in ('mean', 'var')}
  for model in {state.model, state.eval_model()}:
    for name, value in loaded.items():
      getattr(model.batch_norm1, name)[...] = jnp.asarray(value)
  for seed in range(3):
    train_step(state, random_batch(32, seed))
  unfrozen_before = np.array(state.eval_model().batch_norm2.mean[...])
  state_lib.recompute_batch_statistics(state.eval_model(),
                                       [random_batch(32, seed) for seed in range(3, 8)])
  for model in (state.model, state.eval_model()):
    for name, value in loaded.items():
      np.testing.assert_array_equal(np.array(getattr(model.batch_norm1, name)[...]), value)
  assert not np.allclose(np.array(state.eval_model().batch_norm2.mean[...]), unfrozen_before)


def test_balanced_class_weights_follow_the_counts():
  counts = np.array([90, 10, 50])
  weights = losses.class_weight_vector('balanced', 3, lambda: counts)
  np.testing.assert_allclose(weights, 150 / (3 * counts))
  loss = losses.cross_entropy(3, lambda: counts, class_weights='balanced')
  logits = np.zeros((3, 3), np.float32)
  np.testing.assert_allclose(loss(logits, np.array([0, 1, 2])), np.log(3) * weights, rtol=1e-6)
  for bad in ('inverse', [1.0, 2.0], [1.0, -1.0, 1.0]):
    with pytest.raises(ValueError):
      losses.class_weight_vector(bad, 3, lambda: counts)


def test_mixup_and_cutmix_targets_match_the_pixels():
  images = tf.constant(np.stack([np.full((8, 8, 1), k, np.float32) for k in range(4)]))
  labels = tf.constant([0, 1, 2, 3])
  for mixup_alpha, cutmix_alpha in ((1.0, 0.0), (0.0, 1.0), (1.0, 1.0)):
    mixed, targets = mix.mix(images, labels, 4, tf.constant([3, 4], tf.int64), mixup_alpha,
                             cutmix_alpha)
    targets = targets.numpy()
    np.testing.assert_allclose(targets.sum(axis=1), 1, rtol=1e-6)
    # Each image's mean pixel is the target-weighted mean of the classes' pixel values.
    np.testing.assert_allclose(mixed.numpy().mean(axis=(1, 2, 3)), targets @ np.arange(4),
                               rtol=1e-5, atol=1e-5)
    again, _ = mix.mix(images, labels, 4, tf.constant([3, 4], tf.int64), mixup_alpha,
                       cutmix_alpha)
    np.testing.assert_array_equal(again.numpy(), mixed.numpy())  # Seeded.


def test_mixed_batches_carry_soft_targets_and_train():
  config = default.get_config()
  config.update(mixup_alpha=0.2, cutmix_alpha=1.0, batch_size=8, num_epochs=1,
                shuffle_buffer_size=8)
  rng = np.random.default_rng(0)
  split = input_pipeline.InMemory(images=rng.integers(0, 256, (32, 28, 28, 1), np.uint8),
                                 labels=rng.integers(0, 10, 32).astype(np.int32))
  data = input_pipeline.Data(None, preprocessing.parse(''), INFO)
  batch = next(input_pipeline.train_batches(split, data, run_spec.resolve(config).input, 8))
  assert batch['target'].shape == (8, 10)
  np.testing.assert_allclose(batch['target'].sum(1), 1, rtol=1e-6)
  state, train_step = create(mixup_alpha=0.2, cutmix_alpha=1.0,
                             loss_options={'cross_entropy': {'label_smoothing': 0.1,
                                                             'class_weights': None}})
  train_step(state, batch)
  assert np.isfinite(state.window.results()['train/loss'])


def test_train_metrics_of_mixed_images_are_taken_against_their_targets():
  sums = state_lib.MetricSums()
  logits = jnp.log(jnp.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]]))
  targets = jnp.array([[0.9, 0.1, 0.0], [0.6, 0.0, 0.4]])  # Larger classes 0 and 0.
  sums.add(logits, targets)
  sums.add(logits, jnp.array([0, 2]))
  np.testing.assert_allclose(
      sums.results()['train/loss'],
      (-(targets * logits).sum() - jnp.log(0.7) - jnp.log(0.6)) / 4, rtol=1e-6)
  assert sums.results()['train/accuracy'] == 3 / 4


def test_the_last_epochs_train_on_unmixed_images_with_one_hot_targets():
  config = default.get_config()
  config.update(mixup_alpha=1.0, cutmix_alpha=1.0, batch_size=8, num_epochs=3,
                unmixed_last_epochs=1, shuffle_buffer_size=32, preprocess='translate(2)')
  rng = np.random.default_rng(0)
  split = input_pipeline.InMemory(images=rng.integers(0, 256, (16, 28, 28, 1), np.uint8),
                                 labels=rng.integers(0, 10, 16).astype(np.int32))
  data = input_pipeline.Data(None, preprocessing.parse(config.preprocess), INFO)
  batches = list(input_pipeline.train_batches(split, data, run_spec.resolve(config).input, 8))
  config.update(mixup_alpha=0.0, cutmix_alpha=0.0)
  unmixed = list(input_pipeline.train_batches(split, data, run_spec.resolve(config).input, 8))
  assert len(batches) == len(unmixed) == 6
  for number, (batch, plain) in enumerate(zip(batches, unmixed)):
    one_hot = np.eye(10)[batch['label']]
    if number < 4:  # Epochs 0 and 1: mixed.
      assert not np.array_equal(batch['image'], plain['image'])
      assert not np.array_equal(batch['target'], one_hot)
    else:  # The last epoch: the augmented images as without mixing (there uint8, here float32
      # in [0, 1], as mixed batches travel), one-hot targets.
      np.testing.assert_array_equal(batch['image'],
                                    plain['image'].astype(np.float32) / np.float32(255))
      np.testing.assert_array_equal(batch['target'], one_hot)


def test_any_optax_optimizer_by_name_clipping_and_schedules():
  state, train_step = create(optimizer='lamb', learning_rate=1e-3, grad_clip_norm=1.0,
                             optimizer_options={'lamb': {'b1': 0.8}})
  before = _weights(state.model)['linear1.kernel']
  train_step(state, random_batch(32))
  assert not np.array_equal(before, _weights(state.model)['linear1.kernel'])
  config = default.get_config()
  config.update(optimizer='lamb', learning_rate=1e-3)
  config.optimizer_options.lamb = {'beta': 0.5}
  with pytest.raises(errors.ConfigError) as error:
    run_spec.resolve(config)
  assert error.value.key == 'optimizer_options.lamb.beta'
  config = default.get_config()
  config.update(num_epochs=4, learning_rate=1.0, schedule='step')
  schedule = run_spec.resolve(config).optimization.learning_rate_schedule(steps_per_epoch=10)
  assert [float(schedule(step)) for step in (0, 19, 20, 30, 39)] == pytest.approx(
      [1.0, 1.0, 0.1, 0.01, 0.01])
  config.schedule = 'linear'
  schedule = run_spec.resolve(config).optimization.learning_rate_schedule(steps_per_epoch=10)
  assert float(schedule(20)) == pytest.approx(0.5)
  # Weight decay spares biases and normalisation scales.
  mask = optimizers.decay_mask(nnx.state(state.model, nnx.Param))
  assert jax.tree.leaves(mask) == [leaf.ndim > 1 for leaf in jax.tree.leaves(
      nnx.state(state.model, nnx.Param))]


def _first_updates(**options) -> dict[str, np.ndarray]:
  """The first plain-SGD (rate 1) updates of a small resnet18 whose gradients are all ones."""
  config = default.get_config()
  config.update(model='resnet18', optimizer='sgd', learning_rate=1.0, **options)
  config.optimizer_options.sgd.momentum = 0.0
  run = run_spec.resolve(config)
  model = nnx.eval_shape(lambda: run.model.build((32, 32, 3), 3, nnx.Rngs(0)))
  params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                        nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  transform = run.optimization.transform(optax.constant_schedule(1.0), params)
  updates, _ = transform.update(jax.tree.map(jnp.ones_like, params), transform.init(params),
                                params)
  return {optimizers.path_name(path): np.asarray(update)
          for path, update in jax.tree_util.tree_leaves_with_path(updates)}


def test_layer_decay_scales_each_layer_as_timm_numbers_them():
  # resnet18's layers: the stem 0, its 8 blocks 1-8 in order, the head 9.
  updates = _first_updates(layer_decay=0.5)
  for name, layer in (('conv1.kernel', 0), ('bn1.scale', 0), ('layer1.0.conv1.kernel', 1),
                      ('layer2.0.downsample_conv.kernel', 3), ('layer4.1.bn2.bias', 8),
                      ('fc.kernel', 9), ('fc.bias', 9)):
    np.testing.assert_allclose(updates[name], -(0.5 ** (9 - layer)), rtol=1e-6, err_msg=name)


def test_linear_probe_trains_the_head_alone():
  updates = _first_updates(linear_probe=True)
  moved = sorted(name for name, update in updates.items() if np.any(update))
  assert moved == ['fc.bias', 'fc.kernel']
  assert len(updates) > 60  # Every other parameter is there, not updated.
  config = default.get_config()
  config.update(model='resnet18', linear_probe=True)
  assert run_spec.resolve(config).optimization.frozen('layer1.0.bn1')  # BatchNorms keep stats.


@pytest.mark.parametrize('key,value', [('layer_decay', 0.75), ('linear_probe', True)])
def test_layer_options_need_a_model_that_declares_its_layers(key, value):
  config = default.get_config()  # The cnn declares no layers.
  config[key] = value
  with pytest.raises(errors.ConfigError) as error:
    run_spec.resolve(config)
  assert (error.value.key, error.value.value) == (key, value)


@pytest.mark.parametrize('key,value', [('freeze', ('conv[',)), ('lr_multipliers', {'x': -1.0}),
                                       ('grad_clip_norm', -1.0), ('mixup_alpha', -0.5),
                                       ('unmixed_last_epochs', 11), ('layer_decay', 0.0),
                                       ('layer_decay', 1.5)])
def test_bad_values_name_the_key(key, value):
  config = default.get_config()
  config[key] = value
  with pytest.raises(errors.ConfigError) as error:
    run_spec.resolve(config)
  assert error.value.key == key


@models.MODELS.register('vit_two_blocks_for_test', key_map=vit.KEY_MAP, layers=vit.LAYERS)
class ViTTwoBlocks(vit.VisionTransformer):
  """ViT-Ti/16's code at 2 of its 12 blocks: the same training path, a sixth of the compiling."""
  features, depth, num_heads = 192, 2, 3


def _vit_photos(root: str, **overrides):
  """configs/finetune.py with a 2-block ViT-Ti/16 (drop-path and dropout on, the EMA) on a tiny
  folder of 32-px colour images (2x2 patches: fast), batches of 8."""
  image_folders.make_shapes_folder(root, {'train': 16, 'test': 4}, image_sizes=(32, 48),
                                   corrupt=False)
  config = finetune.get_config()
  config.update({'dataset': root, 'train_split': 'train', 'eval_split': 'test',
                 'model': 'vit_two_blocks_for_test',
                 'preprocess': 'random_resized_crop(32)|flip_lr',
                 'batch_size': 8, 'eval_batch_size': 12, 'num_epochs': 2, 'ema_decay': 0.9,
                 'layer_decay': 0.75, 'checkpoint_every_steps': 1000,
                 'evaluators': 'loss|accuracy', **overrides})
  config.model_options.vit_two_blocks_for_test = {'drop_path_rate': 0.1, 'dropout_rate': 0.1}
  return config


@pytest.mark.slow
def test_a_resumed_vit_run_ends_bit_exactly_like_an_uninterrupted_one(tmp_path, monkeypatch):
  """Stopped mid-epoch (as by a SIGTERM) and resumed, a ViT fine-tuning run (random resized
  crops, drop-path, dropout, layer-wise decay, the EMA) ends in the uninterrupted state."""
  state = assert_resumes_bit_exactly(_vit_photos(str(tmp_path / 'photos')), tmp_path,
                                     monkeypatch, 9, 12)  # 6 steps an epoch.
  assert any('ema' in name for name in state) and any('blocks' in name for name in state)


@models.MODELS.register('resnet10_for_test', key_map=resnet.KEY_MAP, layers=resnet.LAYERS)
class ResNet10(resnet.ResNet):
  """ResNet-18's code at one basic block a stage: the same training path, half the compiling."""
  block, depths = resnet.BasicBlock, (1, 1, 1, 1)


def _probe_config(root: str, **overrides):
  """configs/finetune.py with a ResNet-10 on a tiny folder of 32-48 px colour images, resized
  to 32."""
  config = finetune.get_config()
  config.update({'dataset': root, 'train_split': 'train', 'eval_split': 'test',
                 'model': 'resnet10_for_test', 'preprocess': 'resize(32)', 'batch_size': 16,
                 'eval_batch_size': 32, 'learning_rate': 1e-3, 'warmup_epochs': 0.0,
                 'num_epochs': 6, 'evaluators': 'loss|accuracy', **overrides})
  config.model_options.resnet10_for_test = {'drop_path_rate': 0.05}
  return config


@pytest.mark.slow
def test_a_linear_probe_uses_the_imported_features(tmp_path):
  """Pretrained on one generated task (where a noisy image is bright: 3 classes), a ResNet-10's
  features linearly separate another (2 classes, other images, a new head): its linear probe
  beats a linear probe on the random features of the same architecture."""
  image_folders.make_shapes_folder(str(tmp_path / 'source'), {'train': 32, 'test': 8},
                                   image_sizes=(32, 48), corrupt=False)
  pretrained = str(tmp_path / 'pretrained')
  train.train_and_evaluate(run_spec.resolve(_probe_config(str(tmp_path / 'source'))), pretrained)
  target = str(tmp_path / 'target')
  image_folders.make_shapes_folder(target, {'train': 24, 'test': 16}, seed=1,
                                   image_sizes=(32, 48), corrupt=False)
  for split in ('train', 'test'):  # Two of the three classes: a new task, a new head.
    shutil.rmtree(os.path.join(target, split, 'centre'))
  probe = {'linear_probe': True, 'learning_rate': 0.01, 'num_epochs': 4}
  imported = train.train_and_evaluate(
      run_spec.resolve(_probe_config(target, init_from=pretrained, **probe)),
      str(tmp_path / 'imported'))
  random = train.train_and_evaluate(run_spec.resolve(_probe_config(target, **probe)),
                                    str(tmp_path / 'random'))
  print(f"probe on imported features {imported['eval/accuracy']:.3f}, on random features "
        f"{random['eval/accuracy']:.3f}")
  assert imported['eval/accuracy'] >= random['eval/accuracy'] + 0.15, (imported, random)


@pytest.mark.slow  # Compiles several training programs.
def test_the_step_of_cached_features_updates_the_head_as_the_step_of_images(tmp_path):
  """A linear probe's step on cached features (the backbone's, as eval computes them) makes the
  update its step on the images makes (without drop-path): the head's alone."""
  config = _probe_config(str(tmp_path), linear_probe=True, learning_rate=0.1)
  config.model_options.resnet10_for_test = {}
  run = run_spec.resolve(config)
  info = dataclasses.replace(INFO, image_shape=(32, 32, 3), num_classes=3)
  loss = run.loss(info.num_classes)
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (8, 32, 32, 3), dtype=np.uint8)
  labels = rng.integers(0, 3, 8).astype(np.int32)
  of_images, of_features = (build.create_state(config, info, 1) for _ in range(2))
  before = _params(of_images)
  state_lib.make_train_step(loss, run.input.preprocess)(of_images,
                                                       {'image': images, 'label': labels})
  with state_lib.eval_mode(of_features.model):
    features = state_lib.features_of(of_features.model, run.input.preprocess, images)
  state_lib.make_train_step(loss, run.input.preprocess, features=True)(
      of_features, {'features': features, 'label': labels})
  after_images, after_features = _params(of_images), _params(of_features)
  assert {name for name, value in after_images.items()
          if not np.array_equal(value, before[name])} == {'fc.kernel', 'fc.bias'}
  for name, value in after_images.items():
    np.testing.assert_allclose(after_features[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def _params(state) -> dict[str, np.ndarray]:
  return {optimizers.path_name(path): np.asarray(value) for path, value in
          jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(state.model,
                                                                         nnx.Param)))}


@pytest.mark.parametrize('overrides,key', [
    ({'mixup_alpha': 0.2}, 'mixup_alpha'),
    ({'model': 'deit_small_distilled_patch16_224'}, 'linear_probe_cache'),
    ({'linear_probe_views': 2, 'preprocess': 'resize(32)'}, 'linear_probe_views'),
    ({'linear_probe_views': -1}, 'linear_probe_views')])
def test_a_cached_linear_probe_refuses_what_it_cannot_cache(tmp_path, overrides, key):
  config = _probe_config(str(tmp_path), linear_probe=True, **overrides)
  with pytest.raises(errors.ConfigError) as error:
    run_spec.resolve(config)
  assert error.value.key == key
  config.linear_probe_cache = False  # The whole model at every step takes them all.
  if key != 'linear_probe_views' or config.linear_probe_views >= 0:
    run_spec.resolve(config)


@pytest.mark.slow
@pytest.mark.parametrize('views', [0, 2])
def test_a_resumed_cached_linear_probe_ends_bit_exactly_like_an_uninterrupted_one(
    tmp_path, monkeypatch, views):
  """Stopped mid-epoch (as by a SIGTERM) and resumed, a linear probe of cached features (of the
  eval images, or of 2 augmented views) ends in the uninterrupted run's state."""
  root = str(tmp_path / 'photos')
  image_folders.make_shapes_folder(root, {'train': 32, 'test': 8}, image_sizes=(32, 48),
                                   corrupt=False)
  config = _probe_config(root, linear_probe=True, linear_probe_views=views, num_epochs=3,
                         learning_rate=0.01, preprocess='resize(32)|flip_lr', ema_decay=0.9)
  assert_resumes_bit_exactly(config, tmp_path, monkeypatch, 9, 18)  # 6 steps an epoch.
