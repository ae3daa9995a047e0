"""The run: a config read once into a typed, frozen description, checked as it is built.

`resolve(config)` is the one place that reads a config's values: every value that can be judged
without the data is checked here, before any data is decoded or any code compiled, and each
plug-in (data source, model, loss, optimizer, schedule, preprocessing ops, evaluators) is bound
to its own options only (`Registry.bind`), so that no plug-in sees the config. `train.py`, the
modes and the sweep take the `Run`; what depends on the data (the batch size against the
training split) is checked by `Run.check_against_data` once the data's metadata is known.

Evaluations: the eval split ('eval', `config.eval_split` with `config.evaluators`, every
epoch), the test split ('test', `config.test_split` with `config.test_evaluators`, once at the
end with the best checkpoint) and those of `config.evaluations`, each
`{'split': ..., 'evaluators': ..., 'preprocess': ..., 'every': 'epoch' | 'end' | N steps}`.
"""

from collections.abc import Callable
import dataclasses
import json
import re

from absl import logging
import ml_collections
import optax

from core import config_values
from core import errors
from core import saved_config
import data_sources
from data_sources import base
import evaluators
import input_pipeline
import kernels
import models
import preprocessing
from preprocessing import crop
from training import evaluation
from training import init_from
from training import loggers
from training import losses
from training import optimizers

# config.eval_batch_size=None: this many training batches per eval step, at most the cap.
EVAL_BATCHES_PER_STEP, EVAL_BATCH_CAP = 4, 1000
_CHOICES = {'in_memory': input_pipeline.IN_MEMORY, 'input_backend': input_pipeline.INPUT_BACKENDS,
            'decoded_cache': input_pipeline.DECODED_CACHE,
            'nonfinite': optimizers.NONFINITE,
            'temperature_scaling': (False, True), 'linear_probe': (False, True),
            'linear_probe_cache': (False, True)}
_EVALUATION_KEYS = ('split', 'evaluators', 'preprocess', 'every', 'reference')
_require, _is_int = config_values.require, config_values.is_int
_EVALUATION_NAME = re.compile(r'[A-Za-z_][A-Za-z0-9_]*')


@dataclasses.dataclass(frozen=True)
class BestMetric:
  """The scalar that picks the best checkpoint and drives early stopping: '<evaluation>/<name>'
  of an evaluation that runs every epoch, higher better when `maximize`."""
  name: str
  maximize: bool


@dataclasses.dataclass(frozen=True)
class Run:
  """Everything a run needs, typed and checked; built by `resolve`."""
  # The config as JSON values, only as a record: saved in the workdir (compared on resume),
  # shown as HParams. Nothing reads it for behaviour: every value is a typed field below.
  settings: dict
  data_source: str  # The registered name, and the dataset it reads: the data's provenance.
  dataset: str
  input: input_pipeline.Input
  model: models.ModelSpec
  loss: Callable[..., losses.Loss]  # (num_classes, class_counts) -> loss.
  optimization: optimizers.Optimization
  evaluations: tuple[evaluation.Evaluation, ...]
  best: BestMetric
  batch_size: int
  num_epochs: int
  seed: int
  ema_decay: float
  nonfinite: str
  fsdp: int  # Devices that split the state (parallel.create_mesh).
  eval_batch_size: int
  eval_tta: str | None  # Test-time augmentation of --mode=eval (config_values.TTA_CHOICES).
  temperature_scaling: bool  # Fit a temperature after training; eval and predict apply it.
  precise_bn_batches: int
  log_every_steps: int
  checkpoint_every_steps: int
  max_checkpoints_to_keep: int
  profile_steps: int
  early_stopping_patience: int
  early_stopping_min_delta: float
  init_from: init_from.Source | None
  # A linear probe's cached views (feature_cache.compute; 0: as eval prepares the images), or
  # None: the whole model runs at every step.
  probe_views: int | None
  loggers: str  # Where metrics go ('tensorboard|jsonl|...': training/loggers.py).

  def evaluation(self, name: str) -> evaluation.Evaluation:
    """The evaluation called `name`; a `ConfigError` listing them if there is none."""
    for candidate in self.evaluations:
      if candidate.name == name:
        return candidate
    raise errors.ConfigError(
        f'This run has no evaluation {name!r}: its evaluations are '
        f'{[candidate.name for candidate in self.evaluations]}.', key='evaluations', value=name)

  def eval_splits(self) -> dict[str, input_pipeline.EvalSplit]:
    """Each evaluation's split by evaluation name, and the reference split of one with
    evaluators of features by '<name>/reference', for the data to check."""
    keys = {'eval': 'eval_split', 'test': 'test_split'}
    splits = {}
    for candidate in self.evaluations:
      key = keys.get(candidate.name, f'evaluations.{candidate.name}.split')
      splits[candidate.name] = input_pipeline.EvalSplit(key, candidate.split,
                                                        candidate.preprocess)
      if candidate.reference:
        reference_key = ('train_split' if candidate.reference == self.input.train_split
                         else f'evaluations.{candidate.name}.reference')
        splits[reference_name(candidate.name)] = input_pipeline.EvalSplit(
            reference_key, candidate.reference, candidate.preprocess)
    return splits

  def hparam_metrics(self) -> list[str]:
    """The metric columns of TensorBoard's HParams dashboard: every evaluation's scalars."""
    return [f'{candidate.name}/{name}' for candidate in self.evaluations
            for name in candidate.directions]

  def check_against_data(self, info: base.DatasetInfo, num_devices: int) -> None:
    """Checks the values that depend on the training split's size and the device count."""
    num_train_examples = info.num_train_examples
    _require(self.batch_size <= num_train_examples, 'batch_size', self.batch_size,
             f'config.batch_size={self.batch_size} is larger than the {num_train_examples} '
             f'examples of split {self.input.train_split!r}: use a batch size in '
             f'[1, {num_train_examples}].')
    steps_per_epoch = num_train_examples // self.batch_size
    accumulated = self.optimization.grad_accum_steps
    _require(accumulated <= steps_per_epoch, 'grad_accum_steps', accumulated,
             f'config.grad_accum_steps={accumulated} is more than the {steps_per_epoch} steps '
             f'of an epoch (batch_size={self.batch_size}): use at most {steps_per_epoch}.')
    _require(self.batch_size % num_devices == 0, 'batch_size', self.batch_size,
             f'config.batch_size={self.batch_size} does not divide by the {num_devices} devices '
             f'(jax.device_count()): use a multiple of {num_devices}, such as '
             f'{-(-self.batch_size // num_devices) * num_devices}.')


def _options(config: ml_collections.ConfigDict, key: str) -> dict:
  """The options of the plug-in that config.`key` names, from config.`key`_options.<name>."""
  section = config.get(f'{key}_options', {}).get(config[key])
  return section.to_dict() if isinstance(section, ml_collections.ConfigDict) else {}


def resolve(config: ml_collections.ConfigDict) -> Run:
  """The `Run` of `config`; a `ConfigError` (or `MissingPackage`) naming the first bad key."""
  for old in saved_config.RENAMED:
    if old in config:  # A config file written before the key was renamed.
      raise errors.ConfigError(f'config.{old} is now {saved_config.renamed(old)}: rename it in '
                               'the config file.', key=old, value=config[old])
  _check_values(config)
  source = init_from.parse(config.init_from, tuple(config.init_exclude), config.init_keep_head)
  model = _model(config)
  preprocess = _preprocessing(config, source)  # After the checks above: it may download.
  evaluations = _evaluations(config, preprocess)
  return Run(
      settings=json.loads(config.to_json_best_effort()),
      data_source=config.data_source, dataset=config.dataset,
      input=_input(config, preprocess),
      model=model,
      loss=losses.LOSSES.bind(config.loss, _options(config, 'loss')),
      optimization=_optimization(config),
      evaluations=evaluations,
      best=_best_metric(config.best_metric, evaluations),
      batch_size=config.batch_size, num_epochs=config.num_epochs, seed=config.seed,
      ema_decay=config.ema_decay, nonfinite=config.nonfinite, fsdp=config.fsdp,
      eval_batch_size=(config.eval_batch_size
                       or min(EVAL_BATCHES_PER_STEP * config.batch_size, EVAL_BATCH_CAP)),
      eval_tta=config.eval_tta,
      temperature_scaling=config.temperature_scaling,
      precise_bn_batches=config.precise_bn_batches,
      log_every_steps=config.log_every_steps,
      checkpoint_every_steps=config.checkpoint_every_steps,
      max_checkpoints_to_keep=config.max_checkpoints_to_keep,
      profile_steps=config.profile_steps,
      early_stopping_patience=config.early_stopping_patience,
      early_stopping_min_delta=config.early_stopping_min_delta,
      init_from=source,
      probe_views=_probe_views(config, preprocess),
      loggers=loggers.check(config.loggers))


def _preprocessing(config: ml_collections.ConfigDict,
                   source: init_from.Source | None) -> preprocessing.Preprocessing:
  """config.preprocess; unset (''), with init_from a backbone's pretrained weights, the
  preprocessing those weights were trained with (`Source.pretrained_cfg`: a Hub repository's
  own, torchvision's weights' own, else the model's timm pretrained_cfg), logged."""
  registered = models.MODELS.capability(config.model, 'pretrained')
  if (config.preprocess or not registered or source is None
      or (found := source.pretrained_cfg(registered)) is None):
    return preprocessing.parse(config.preprocess)
  pretrained, where = found
  spec = crop.pretrained_spec(pretrained)
  logging.info('config.preprocess is not set and config.init_from=%r holds pretrained %s '
               'weights: preprocessing as they were trained (%s: crop_pct %s, %s), %r; eval, '
               'predict and export take the centre crop.', config.init_from, config.model,
               where, pretrained['crop_pct'], pretrained['interpolation'], spec)
  return preprocessing.parse(spec)


def _probe_views(config: ml_collections.ConfigDict,
                 preprocess: preprocessing.Preprocessing) -> int | None:
  """config.linear_probe_views if a linear probe trains on cached features, else None; checks
  that the model, the mixing and the random ops allow them."""
  if not (config.linear_probe and config.linear_probe_cache):
    return None
  fix = 'or config.linear_probe_cache=False (the whole model at every step)'
  for key in ('mixup_alpha', 'cutmix_alpha'):
    _require(not config[key], key, config[key],
             f'config.{key}={config[key]!r} mixes the images of a batch, whose features a linear '
             f'probe cannot cache: set {key}=0, {fix}.')
  _require(getattr(models.MODELS.entry(config.model).factory, 'logits', None) is not None,
           'linear_probe_cache', True,
           f'A linear probe of cached features trains the classifier on pooled features, which '
           f'model {config.model!r} does not take (model.logits): set {fix}.')
  views = config.linear_probe_views
  _require(not views or preprocess.random_ops or preprocess.crop_op, 'linear_probe_views', views,
           f'config.linear_probe_views={views} caches augmented views, but config.preprocess '
           f'has no random ops to draw them: set linear_probe_views=0.')
  return views


def _check_values(config: ml_collections.ConfigDict) -> None:
  """Checks the app's own keys: the numbers (`config_values.check`, also run by main.py before
  the imports) and the choices."""
  config_values.check(config)
  for key, valid in _CHOICES.items():
    _require(config[key] in valid, key, config[key],
             f'Unknown {key} {config[key]!r}: config.{key} must be one of {list(valid)}.')


def _input(config: ml_collections.ConfigDict,
           preprocess: preprocessing.Preprocessing) -> input_pipeline.Input:
  """The data source (bound to its options) and how its splits are read and batched; checks
  that the source and backend can serve `in_memory` and the random ops."""
  source = data_sources.SOURCES.bind(config.data_source, _options(config, 'data_source'))
  can_stream = bool(data_sources.SOURCES.capability(config.data_source, 'can_stream'))
  if config.in_memory == 'never' and not can_stream:
    streaming = [name for name in data_sources.SOURCES.names()
                 if data_sources.SOURCES.capability(name, 'can_stream')]
    raise errors.ConfigError(
        f"config.in_memory='never' streams splits from their files, which data_source "
        f'{config.data_source!r} cannot: use in_memory=\'auto\' or \'always\', or a data source '
        f'that streams ({", ".join(streaming)}).', key='in_memory', value='never')
  if config.input_backend == 'torch':
    errors.require('torch', "config.input_backend='torch'", key='input_backend', value='torch')
    if config.in_memory == 'never' or preprocess.random_ops or preprocess.crop_op:
      raise errors.ConfigError(
          "config.input_backend='torch' takes in-memory splits without random ops: use "
          "input_backend='tf' for in_memory='never' or random ops (or a crop op) in "
          'config.preprocess.',
          key='input_backend', value=config.input_backend)
  return input_pipeline.Input(
      source=lambda: source(config.dataset, config.data_dir), can_stream=can_stream,
      preprocess=preprocess, train_split=config.train_split, in_memory=config.in_memory,
      decoded_cache=config.decoded_cache, shuffle_buffer_size=config.shuffle_buffer_size,
      backend=config.input_backend,
      seed=config.seed, num_epochs=config.num_epochs, mixup_alpha=config.mixup_alpha,
      cutmix_alpha=config.cutmix_alpha, unmixed_last_epochs=config.unmixed_last_epochs)


def _model(config: ml_collections.ConfigDict) -> models.ModelSpec:
  # Checks the values only: a named backend keeps JAX (and its accelerators) unstarted.
  kernels.select_layers(config.kernels, backend='cpu', compute_dtype=config.compute_dtype)
  name, options = models.resolve(config.model, config.model_options)
  if name != config.model:
    logging.warning("config.model=%r is the former name of %r, the same model: use %r.",
                    config.model, name, name)
  return models.ModelSpec(name, models.MODELS.bind(name, options),
                          kernels=config.kernels, compute_dtype=config.compute_dtype)


def _optimization(config: ml_collections.ConfigDict) -> optimizers.Optimization:
  """The optimizer and schedule bound to their options, each built once here so that a bad
  value is refused now (a constant schedule and a 100-update run stand in for the real ones)."""
  optimizer = optimizers.OPTIMIZERS.bind(config.optimizer, _options(config, 'optimizer'))
  schedule = optimizers.SCHEDULES.bind(config.schedule, _options(config, 'schedule'))
  optimizer(optax.constant_schedule(config.learning_rate))
  schedule(config.learning_rate, 100)
  layer_groups = models.MODELS.capability(config.model, 'layers')
  for key, on in (('layer_decay', config.layer_decay != 1.0), ('linear_probe', config.linear_probe)):
    if on and layer_groups is None:
      with_layers = [name for name in models.MODELS.names()
                     if models.MODELS.capability(name, 'layers')]
      raise errors.ConfigError(
          f'config.{key}={config[key]!r} needs a model that declares its layers, which model '
          f'{config.model!r} does not: use one of {with_layers}, or {key}='
          f'{1.0 if key == "layer_decay" else False}.', key=key, value=config[key])
  # A linear probe trains the head alone: every other parameter (and BatchNorm) is frozen.
  freeze = tuple(config.freeze) + ((f'^(?!(?:{layer_groups.head}))',) if config.linear_probe
                                   else ())
  return optimizers.Optimization(
      optimizer=optimizer, schedule=schedule, learning_rate=config.learning_rate,
      warmup_epochs=config.warmup_epochs, num_epochs=config.num_epochs,
      grad_accum_steps=config.grad_accum_steps, grad_clip_norm=config.grad_clip_norm,
      freeze=freeze, lr_multipliers=tuple(config.lr_multipliers.items()),
      layer_decay=config.layer_decay, layer_groups=layer_groups, nonfinite=config.nonfinite)


@dataclasses.dataclass(frozen=True)
class _EvaluationConfig:
  """One evaluation as the config describes it, with the config key of each value (for the
  errors that name it); the test split's is checked even when unset."""
  name: str
  split: str | None
  split_key: str
  evaluators: str
  evaluators_key: str
  preprocess: str | None = None  # None: the run's.
  preprocess_key: str = 'preprocess'
  every: str | int = evaluation.EVERY_EPOCH
  reference: str | None = None  # For evaluators of features; None: the training split.


def _evaluations(config: ml_collections.ConfigDict,
                 preprocess: preprocessing.Preprocessing) -> tuple[evaluation.Evaluation, ...]:
  """The run's evaluations: 'eval', 'test' (with a test split) and `config.evaluations`."""
  test_key = 'test_evaluators' if config.test_evaluators else 'evaluators'
  configured = [_EvaluationConfig('eval', config.eval_split, 'eval_split', config.evaluators,
                                  'evaluators'),
                _EvaluationConfig('test', config.test_split, 'test_split', config[test_key],
                                  test_key, every=evaluation.AT_END)]
  configured += [_extra_evaluation(config, name, section)
                 for name, section in config.get('evaluations', {}).items()]
  evaluations = []
  for described in configured:
    built = evaluators.create(described.evaluators, described.evaluators_key)
    own = described.preprocess
    _require(not evaluators.reads_features(built) or hasattr(models.MODELS.entry(config.model).factory,
                                           'pre_logits'),
             described.evaluators_key, described.evaluators,
             f'config.{described.evaluators_key}={described.evaluators!r} scores pooled '
             f'features, which model {config.model!r} does not have: use them with a backbone '
             '(resnet18, vit_small_patch16_224, ...).')
    if described.split:
      evaluations.append(evaluation.Evaluation(
          described.name, described.split, built,
          preprocess if own is None else preprocessing.parse(own, described.preprocess_key),
          every=described.every, reference=described.reference or config.train_split))
  return tuple(evaluations)


def _extra_evaluation(config: ml_collections.ConfigDict, name: str,
                      section: ml_collections.ConfigDict) -> _EvaluationConfig:
  """config.evaluations.`name` checked: its split, evaluators (default config.evaluators),
  preprocessing (default the run's) and cadence (default every epoch)."""
  key = f'evaluations.{name}'
  _require(bool(_EVALUATION_NAME.fullmatch(name)) and name not in ('eval', 'test'), key, name,
           f'config.{key}: an evaluation name is an identifier other than eval and test (they '
           'are config.eval_split and config.test_split).')
  _require(isinstance(section, ml_collections.ConfigDict), key, section,
           f"config.{key} must be a dict such as {{'split': 'train[:1000]', 'every': 200}}.")
  for option in section:
    _require(option in _EVALUATION_KEYS, f'{key}.{option}', section[option],
             f'config.{key}.{option} is not an option of an evaluation; its options: '
             f'{", ".join(_EVALUATION_KEYS)}.')
  split = section.get('split')
  _require(isinstance(split, str) and bool(split), f'{key}.split', split,
           f'config.{key}.split={split!r} is invalid: give a split, such as \'train[:1000]\'.')
  every = section.get('every', evaluation.EVERY_EPOCH)
  _require(every in (evaluation.EVERY_EPOCH, evaluation.AT_END) or (_is_int(every) and every > 0),
           f'{key}.every', every,
           f"config.{key}.every={every!r} is invalid: it must be 'epoch', 'end' or a number of "
           'steps >= 1.')
  reference = section.get('reference')
  _require(reference is None or (isinstance(reference, str) and bool(reference)),
           f'{key}.reference', reference,
           f"config.{key}.reference={reference!r} is invalid: give the split that evaluators of "
           "features (knn, fewshot) are fitted on, such as 'train[:90%]'.")
  return _EvaluationConfig(
      name, split, f'{key}.split', section.get('evaluators') or config.evaluators,
      f'{key}.evaluators', section.get('preprocess'), f'{key}.preprocess', every, reference)


def reference_name(evaluation_name: str) -> str:
  """The name of an evaluation's reference split in `Run.eval_splits` and `Data.eval_sizes`."""
  return f'{evaluation_name}/reference'


def _best_metric(name: str, evaluations: tuple[evaluation.Evaluation, ...]) -> BestMetric:
  """Checks config.best_metric against the evaluations that run every epoch."""
  candidates = {f'{candidate.name}/{metric}': higher for candidate in evaluations
                if candidate.every == evaluation.EVERY_EPOCH
                for metric, higher in candidate.directions.items()}
  _require(name in candidates, 'best_metric', name,
           f'config.best_metric={name!r} is invalid: it must be a scalar of an evaluation that '
           f'runs every epoch: one of {sorted(candidates)}.')
  return BestMetric(name, candidates[name])
