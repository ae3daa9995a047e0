"""Default config: the reference CNN on MNIST, SGD with momentum, 10 epochs."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # Data.
  # Where the data comes from: 'tfds', 'folder' (root/<split>/<class>/<image>), 'huggingface'
  # or 'torchvision'.
  config.data_source = 'tfds'
  # TFDS name (registered, or prepared in data_dir) or Hugging Face name (or local dir) of an
  # image-classification dataset, an image folder's root, or a torchvision.datasets class name.
  config.dataset = 'mnist'
  # TFDS data dir, Hugging Face cache dir or torchvision root; None = TFDS's (or Hugging Face's)
  # default, which honours $TFDS_DATA_DIR. A typed placeholder so that --config.data_dir=/path
  # can override it.
  config.data_dir = ml_collections.config_dict.placeholder(str)
  config.download = False  # torchvision only: download the dataset into data_dir if missing.
  config.train_split = 'train'  # TFDS split to train on (slices such as 'train[:90%]' work).
  config.eval_split = 'test'  # TFDS split evaluated in full after every epoch.
  # Scored once at the end, with the best checkpoint (best_metric on eval_split); None = off.
  # Recipes that select anything evaluate on a slice of the training data, e.g.
  # train_split='train[:55000]', eval_split='train[55000:]', test_split='test'.
  config.test_split = ml_collections.config_dict.placeholder(str)
  config.shuffle_buffer_size = 60_000  # Shuffle buffer; >= the split's size = a perfect shuffle.
  # Every image resized to image_size x image_size as it is decoded (train, eval and predict);
  # None = the dataset's own size, which must then be the same for all images.
  config.image_size = ml_collections.config_dict.placeholder(int)
  # 'always': decode each split into memory once; 'never': stream it from its files (TFDS and
  # image folders) every epoch, holding only shuffle_buffer_size examples; 'auto': in memory
  # when it fits a quarter of the machine's memory as float32, else streamed.
  config.in_memory = 'auto'
  # Training-batch augmentation, ops joined by '|' ('' = none): flip_lr,
  # random_crop(size, pad=0), translate(pixels), rotate(degrees);
  # e.g. 'random_crop(32, pad=4)|flip_lr'.
  config.augment = ''
  config.input_backend = 'tf'  # Training batches from 'tf' (tf.data) or 'torch' (DataLoader).
  config.steps_per_dispatch = 1  # Train steps run per jit call (unrolled in one dispatch).
  # Model.
  # A name in models.MODELS: 'cnn' (the flax MNIST example's), 'mlp' or 'resnet' (ResNet-20 for
  # 32x32 colour images, see configs/cifar10.py).
  config.model = 'cnn'
  # Each model's constructor options, by model name (the one of config.model is used).
  config.model_options = ml_collections.ConfigDict({
      'cnn': {'conv1_features': 32, 'conv2_features': 64, 'hidden_features': 256,
              'dropout_rate': 0.025},
      # input_scale multiplies the [0, 1] pixels; init_stddev: N(0, s^2) weights and biases
      # instead of Flax's default init (0).
      'mlp': {'hidden_features': (512, 512), 'input_scale': 1.0, 'init_stddev': 0.0},
      # Stage widths (a stage per width, each after the first at half the resolution) and
      # residual blocks per stage: 6 * blocks_per_stage + 2 layers.
      'resnet': {'widths': (16, 32, 64), 'blocks_per_stage': 3},
  })
  # 'auto': layers written for XLA:CPU (kernels/cpu.py) on the CPU backend, flax's stock layers
  # elsewhere; 'off': always the stock layers. Both compute the same function.
  config.cpu_kernels = 'auto'
  # 'float32' or 'bfloat16': the dtype the layers compute in, forward and backward. Parameters,
  # optimizer state, BatchNorm statistics and the loss stay float32. bfloat16 is the point on
  # GPU and TPU; on CPU it works, but is no faster.
  config.compute_dtype = 'float32'
  # Optimisation.
  config.optimizer = 'sgd'  # 'sgd' (with momentum), 'sgd_l2' (and weight decay), 'adam', 'adamw'.
  config.learning_rate = 0.1  # Peak learning rate.
  config.momentum = 0.9  # SGD momentum (0 = plain SGD); ignored by adam/adamw.
  config.weight_decay = 1e-4  # adamw: decoupled weight decay; sgd_l2: L2 on the gradients.
  config.schedule = 'constant'  # 'constant', 'cosine' or 'warmup_cosine' (decays to 0 at the end).
  config.warmup_epochs = 0.0  # Linear warm-up length for 'warmup_cosine', in epochs.
  config.batch_size = 128  # Training examples per step.
  # Steps whose mean gradient makes one optimizer update (optax.MultiSteps); 1 = off. With 2, a
  # batch_size of 64 updates as a batch of 128 would, except that BatchNorm normalises (and
  # updates its averages) with the statistics of each batch of 64. The learning-rate schedule
  # counts updates.
  config.grad_accum_steps = 1
  # Weight of the uniform distribution mixed into the training targets (optax.smooth_labels);
  # 0 = off. The logged train and eval losses stay the plain cross-entropy.
  config.label_smoothing = 0.0
  config.eval_batch_size = 1000  # Examples per eval step; the last batch is padded and masked.
  config.num_epochs = 10  # Passes over the training split.
  config.seed = 0  # Seeds parameter init, dropout and the per-epoch shuffle order.
  # Moving average of the weights (nnx.EMA), updated after every step; 0 = off. When on, eval,
  # the best checkpoint, the test score, export and predict use the averaged weights.
  config.ema_decay = 0.0
  # The eval metric that picks the best checkpoint (kept besides the newest ones) and drives
  # early stopping: 'eval_accuracy' (higher is better) or 'eval_loss' (lower is better).
  config.best_metric = 'eval_accuracy'
  config.early_stopping_patience = 0  # Epochs without a better best_metric before stopping; 0=off.
  # Logging.
  config.log_every_steps = 100  # Train metrics are written every this many steps.
  # Misclassified eval examples drawn in a TensorBoard grid (with a confusion matrix) at each
  # eval; 0 = no images.
  config.num_misclassified_images = 36
  # Steps traced (after a few warm-up steps) into <workdir>/plugins/profile/ for TensorBoard's
  # profile plugin; 0 = off.
  config.profile_steps = 0
  # Checkpoints (<workdir>/checkpoints; also saved at the end and on SIGTERM/SIGINT).
  config.checkpoint_every_steps = 500  # A checkpoint is saved every this many steps.
  # The newest this many are kept (and the best epoch-end one); older ones are deleted.
  config.max_checkpoints_to_keep = 3
  config.halt_on_nonfinite = True  # Stop with an error, saving nothing, when the loss is NaN/Inf.
  return config
