"""Default config: the reference CNN on MNIST, SGD with momentum, 10 epochs.

Plug-ins (data source, model, loss, optimizer, schedule) are chosen by name; each takes its
options from its own section, `<key>_options.<name>`, e.g. `model_options.cnn.dropout_rate`.
A plug-in without a section here takes its defaults; add a section (in your own config file)
to set them.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # Data.
  # Where the data comes from: 'tfds', 'folder' (root/<split>/<class>/<image>), 'csv' (a CSV
  # of file,label[,split] rows), 'huggingface' or 'torchvision' (data_sources/).
  config.data_source = 'tfds'
  # TFDS name (registered, or prepared in data_dir) or Hugging Face name (or local dir) of an
  # image-classification dataset, an image folder's root, a CSV file, or a torchvision.datasets
  # class name.
  config.dataset = 'mnist'
  # TFDS data dir, Hugging Face cache dir or torchvision root; None = TFDS's (or Hugging Face's)
  # default, which honours $TFDS_DATA_DIR. A typed placeholder so that --config.data_dir=/path
  # can override it.
  config.data_dir = ml_collections.config_dict.placeholder(str)
  # torchvision.download: download the dataset into data_dir if missing. csv: the folder of
  # the images (relative to the CSV's), the columns, and an extension for bare ids ('.png').
  config.data_source_options = ml_collections.ConfigDict({
      'torchvision': {'download': False},
      'csv': {'images': '', 'file_column': 'file', 'label_column': 'label',
              'split_column': 'split', 'extension': ''}})
  config.train_split = 'train'  # TFDS split syntax for every source: 'train[:90%]', 'a+b'.
  config.eval_split = 'test'  # Evaluated in full after every epoch (metrics 'eval/...').
  # Scored once at the end, with the best checkpoint (best_metric on eval_split); None = off.
  # Recipes that select anything evaluate on a slice of the training data, e.g.
  # train_split='train[:55000]', eval_split='train[55000:]', test_split='test'.
  config.test_split = ml_collections.config_dict.placeholder(str)
  # How images reach the model, ops joined by '|' (preprocessing/): first resize(size,
  # method='stretch'|'crop'|'pad'), resize_small(size) or central_crop(size) for images of
  # varying sizes, then at most one per-image crop from the decoded image
  # (random_resized_crop(size, crop_pct=0.875)), then random training ops (flip_lr,
  # random_crop(size, pad), translate(pixels), rotate(degrees)), then at most one scaling
  # (normalize(mean, std), normalize('imagenet'), value_range(low, high) or standardize(
  # per_channel, polarity), per image; default: pixels in [0, 1]), run inside the compiled
  # step. More random ops: inception_crop(size), color_jitter(...), randaugment(n, m),
  # random_erasing(p) (preprocessing/strong_augment.py).
  # Eval, predict and the exported model apply the resize, the crop op's centre crop and the
  # scaling. E.g. 'resize(32)|random_crop(32, pad=4)|flip_lr'.
  # Unset ('') with init_from a backbone's pretrained weights: the model's own (timm's
  # pretrained_cfg), e.g. "random_resized_crop(224, crop_pct=0.95, interpolation='bicubic')|
  # flip_lr|normalize('imagenet')" for resnet50.
  config.preprocess = ''
  # 'always': decode each split into memory once; 'never': stream it from its files (TFDS and
  # image folders) every epoch, holding only shuffle_buffer_size examples; 'auto': in memory
  # when its uint8 images fit a quarter of the machine's memory, else streamed.
  config.in_memory = 'auto'
  # A streamed training split with a crop op (photos of varying sizes): decoded once, shrunk to
  # a shorter side of 1.15 x the input size, and cropped from that copy in every epoch:
  # 'memory', 'auto' (when it fits in memory, as in_memory does) or 'off' (every epoch decodes
  # the files again).
  config.decoded_cache = 'auto'
  config.shuffle_buffer_size = 60_000  # Shuffle buffer; >= the split's size = a perfect shuffle.
  config.input_backend = 'tf'  # Training batches from 'tf' (tf.data) or 'torch' (DataLoader).
  # Model.
  # A registered model (models.py): 'cnn' (the flax MNIST example's), 'mlp', 'cifar_resnet'
  # (ResNet-20 for 32x32 colour images, see configs/cifar10.py; 'resnet' is its former name) or
  # a backbone of backbones/ ('resnet18', 'vit_small_patch16_224', ..., see configs/finetune.py).
  config.model = 'cnn'
  config.model_options = ml_collections.ConfigDict({
      'cnn': {'conv1_features': 32, 'conv2_features': 64, 'hidden_features': 256,
              'dropout_rate': 0.025},
      # input_scale multiplies the input pixels; init_stddev: N(0, s^2) weights and biases
      # instead of Flax's default init (0).
      'mlp': {'hidden_features': (512, 512), 'input_scale': 1.0, 'init_stddev': 0.0},
      # Stage widths (a stage per width, each after the first at half the resolution) and
      # residual blocks per stage: 6 * blocks_per_stage + 2 layers.
      'cifar_resnet': {'widths': (16, 32, 64), 'blocks_per_stage': 3},
  })
  # 'auto': the layers written for the backend (kernels/: cpu.py on XLA:CPU, gpu.py on a CUDA
  # GPU, tpu.py on a TPU), flax's stock layers elsewhere; 'stock': always flax's stock layers.
  # Both compute the same function. (Formerly config.cpu_kernels, 'off' for 'stock'.)
  config.kernels = 'auto'
  # 'float32' or 'bfloat16': the dtype the layers compute in, forward and backward. Parameters,
  # optimizer state, BatchNorm statistics and the loss stay float32.
  config.compute_dtype = 'float32'
  # Optimisation.
  config.loss = 'cross_entropy'  # training/losses.py.
  # label_smoothing: weight of the uniform distribution mixed into the targets; 0 = off.
  # class_weights: None, 'balanced' (inverse class frequency in the training split) or one
  # weight per class, multiplying each example's loss.
  config.loss_options = ml_collections.ConfigDict({
      'cross_entropy': {'label_smoothing': 0.0,
                        'class_weights': ml_collections.config_dict.placeholder(object)}})
  # Mixup and CutMix of training batches (soft targets; one of the two per batch when both are
  # on): the alpha of the Beta distribution of the mixing weight; 0 = off.
  config.mixup_alpha = 0.0
  config.cutmix_alpha = 0.0
  # The last epochs train on unmixed images (YOLOX's no_aug_epochs, for mixing only): the
  # weights settle on the images they are evaluated on while the learning rate is lowest.
  config.unmixed_last_epochs = 0
  config.optimizer = 'sgd'  # training/optimizers.py: 'sgd', 'sgd_l2', 'adam', 'adamw'.
  config.optimizer_options = ml_collections.ConfigDict({
      'sgd': {'momentum': 0.9},  # 0 = plain SGD.
      'sgd_l2': {'momentum': 0.9, 'weight_decay': 1e-4},  # L2 weight decay on the gradients.
      # Decoupled weight decay; mu_dtype='bfloat16' keeps Adam's first moment in bfloat16.
      'adamw': {'weight_decay': 1e-4, 'mu_dtype': 'float32'},
  })
  # Any other optax optimizer whose first argument is the learning rate also works by name
  # ('lamb', 'lion', 'adafactor', ...), its keyword arguments in optimizer_options.<name>.
  # Weight decay (sgd_l2, adamw) applies to kernels, not to biases and normalisation scales.
  config.learning_rate = 0.1  # Peak learning rate.
  # 'constant', 'cosine' (to 0 at the end), 'linear' (to end_factor x) or 'step' (x factor at
  # each boundary, a fraction of the run).
  config.schedule = 'constant'
  config.schedule_options = ml_collections.ConfigDict({
      'linear': {'end_factor': 0.0}, 'step': {'boundaries': (0.5, 0.75), 'factor': 0.1}})
  config.warmup_epochs = 0.0  # Linear warm-up from 0 before the schedule, in epochs.
  config.grad_clip_norm = 0.0  # Gradients clipped to this global norm; 0 = off.
  # Fine-tuning: a workdir (its best checkpoint, else its latest) or checkpoint directory of
  # this app whose weights start the model; parameters of another path or shape (a new head)
  # start fresh. The optimizer, step and EMA start fresh; a rerun resumes from its own workdir.
  config.init_from = ml_collections.config_dict.placeholder(str)
  # Path patterns (regular expressions) of parameters that start fresh even where init_from has
  # them, e.g. ('linear2',) for a new head when the classes differ but not their number.
  config.init_exclude = ()
  # A workdir of init_from trained on other class names (as many) loads all but its head, which
  # starts fresh; True keeps its head too.
  config.init_keep_head = False
  # Parameters whose path ('conv1.kernel', 'batch_norm1.scale', ...) matches one of these
  # regular expressions are not trained; a matching BatchNorm keeps its statistics as loaded.
  config.freeze = ()
  # {path pattern: factor}: the learning rate of the matching parameters, times the factor.
  config.lr_multipliers = ml_collections.ConfigDict()
  # Linear probing: train the model's head alone (the rest frozen, BatchNorm statistics kept).
  # Models that declare their layers (the backbones: resnet18, vit_*, convnext_tiny, ...).
  config.linear_probe = False
  # A linear probe's fast path: the frozen backbone's pooled features of each training image are
  # computed once and cached, and the head trains on them (training/feature_cache.py); False runs
  # the whole model at every step (as Mixup and CutMix need).
  config.linear_probe_cache = True
  # The cached views of each training image: 0 = the image as eval prepares it; N = N views
  # through config.preprocess's random ops (epoch e trains on view e mod N).
  config.linear_probe_views = 0
  # Layer-wise learning-rate decay: layer i of 0..L (stem, blocks, head) learns at
  # layer_decay ** (L - i) times the rate (timm's --layer-decay, e.g. 0.75); 1 = off. Needs a
  # model that declares its layers, as linear_probe.
  config.layer_decay = 1.0
  config.batch_size = 128  # Training examples per step, over all devices and processes.
  # Steps whose mean gradient makes one optimizer update (optax.MultiSteps); 1 = off. With 2, a
  # batch_size of 64 updates as a batch of 128 would, except that BatchNorm normalises (and
  # updates its averages) with the statistics of each batch of 64. The schedule counts updates.
  config.grad_accum_steps = 1
  # Devices that split the parameters and optimizer state among them (FSDP, training/
  # parallel.py), for a model too large for one device's memory; 1 = each device holds all.
  config.fsdp = 1
  config.num_epochs = 10  # Passes over the training split.
  config.seed = 0  # Seeds parameter init, dropout, the per-epoch shuffle order and augmentation.
  # Moving average of the weights (nnx.EMA), updated after every step; 0 = off. When on, eval,
  # the best checkpoint, the test score, export and predict use the averaged weights.
  config.ema_decay = 0.0
  # 'halt': stop with an error, saving nothing, when the training loss or state is NaN/Inf;
  # 'skip': skip updates whose gradients are not finite (optax.apply_if_finite).
  config.nonfinite = 'halt'
  # Evaluation.
  # What the eval split measures after every epoch, joined by '|' (evaluators/):
  # loss, accuracy, top_k(k), per_class (macro precision/recall/F1), balanced_accuracy,
  # confusion_matrix and misclassified(count) (pictures in TensorBoard).
  config.evaluators = 'loss|accuracy|confusion_matrix|misclassified(36)'
  # What the test split (scored once, at the end) measures; None = the same as evaluators.
  config.test_evaluators = ml_collections.config_dict.placeholder(str)
  # More evaluations, by name (the eval and test splits above are 'eval' and 'test'): each
  # {'split': TFDS split syntax, 'evaluators': (default: config.evaluators), 'preprocess':
  # (default: config.preprocess; its resize and scaling apply), 'every': 'epoch' (default),
  # 'end' (once, with the best checkpoint) or a number of steps}. Their scalars are
  # '<name>/<scalar>', e.g. {'holdout': {'split': 'train[55000:]', 'every': 200}}.
  config.evaluations = ml_collections.ConfigDict()
  # Examples per eval step; the last batch is padded and masked. None = 4 x batch_size, at most
  # 1000: an eval step keeps no activations for a backward pass, so four training batches take
  # less memory than the training step already does (docs/performance.md, "Memory at 224 px").
  config.eval_batch_size = ml_collections.config_dict.placeholder(int)
  # Test-time augmentation of --mode=eval (predict: --tta): 'flip' averages the softmax over each
  # image and its left-right mirror; None = off. Training's evaluations score the images alone.
  config.eval_tta = ml_collections.config_dict.placeholder(str)
  # After training, fit one temperature dividing the logits (minimum NLL on the eval split, best
  # checkpoint) into <workdir>/temperature.json: probabilities that match the accuracy, the
  # classes unchanged. Eval, predict and export apply it while this is on.
  config.temperature_scaling = False
  # Before every eval, BatchNorm's statistics are recomputed with the current weights over the
  # epoch's last this many training batches ("precise BN"); 0 = the running averages as
  # trained, which lag the weights (docs/training_options.md).
  config.precise_bn_batches = 20
  # The scalar that picks the best checkpoint (kept besides the newest ones) and drives early
  # stopping: '<evaluation>/<scalar>' of an evaluation that runs every epoch, e.g.
  # 'eval/accuracy' or 'eval/loss' (its direction comes from its evaluator).
  config.best_metric = 'eval/accuracy'
  # Epochs without a better best_metric (by more than min_delta) before stopping; 0 = off.
  config.early_stopping_patience = 0
  config.early_stopping_min_delta = 0.0
  # Logging.
  # Where metrics go, joined by '|' (training/loggers.py): 'tensorboard' (event files),
  # 'jsonl' (metrics.jsonl, always written: the run reads it), 'csv' (metrics.csv), 'mlflow'
  # ($MLFLOW_TRACKING_URI) and 'wandb' ($WANDB_MODE), the last two optional extras; e.g.
  # 'tensorboard|jsonl|mlflow(experiment="mnist")'. A resumed run continues the same tracked run.
  config.loggers = 'tensorboard|jsonl'
  config.log_every_steps = 100  # Train metrics are written every this many steps.
  # Steps traced (after a few warm-up steps) into <workdir>/plugins/profile/ for TensorBoard's
  # profile plugin; 0 = off.
  config.profile_steps = 0
  # Checkpoints (<workdir>/checkpoints; also saved at epoch ends, at the end and on
  # SIGTERM/SIGINT/SIGUSR1).
  config.checkpoint_every_steps = 500  # A checkpoint is saved every this many steps.
  # The newest this many are kept (and the best epoch-end one); older ones are deleted.
  config.max_checkpoints_to_keep = 3
  return config
