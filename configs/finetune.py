"""A recipe for fine-tuning a pretrained backbone on your own photo folder.

  python main.py --config=configs/finetune.py --workdir=runs/photos \
    --config.dataset=/path/to/root --config.init_from=resnet18.safetensors

`root/train/<class name>/<image>` (any size, JPEG/PNG/BMP/GIF); the last 10% of `train` (files
ordered by a hash of their path, so every class is in both parts) is held out and evaluated
after every epoch, as in configs/images.py. `init_from` takes the weights users have: a timm or
torchvision state_dict (`.safetensors`, or `.pth`/`.bin` read with weights_only), a Hugging
Face Hub name (`hf-hub:timm/resnet18.a1_in1k`, downloaded on first use, then read from the
cache), or a workdir of this app (docs/fine_tuning.md). The head is new for your classes (one log line says so).

With pretrained weights and `preprocess` left empty, the run takes the preprocessing the
weights were trained with (the model's timm `pretrained_cfg`): training a random resized crop
of the original image to the model's size, flipped, eval/predict/export the shorter side
resized to size / crop_pct and the centre crop; both normalised with the weights' statistics.

The recipe is timm's for fine-tuning (AdamW, warm-up then cosine, label smoothing, an EMA of
the weights), for batches of 32 on one machine. Two ways to use it:
  * linear probe, the backbone frozen: `--config.linear_probe=True --config.learning_rate=0.01`
    (fast: only the head learns; enough when the photos look like the pre-training data);
  * full fine-tuning (this config): every layer learns, the lower ones less with
    `--config.layer_decay=0.75` (layer-wise decay, for ViTs above all).
On an accelerator, `--config.compute_dtype=bfloat16` halves the activations' memory.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.data_source = 'folder'  # --config.dataset=/path/to/root
  config.train_split = 'train[:90%]'
  config.eval_split = 'train[90%:]'
  config.model = 'resnet18'  # Any backbone of backbones/: resnet50, vit_small_patch16_224, ...
  config.model_options.resnet18 = {'drop_path_rate': 0.05}
  config.preprocess = ''  # The weights' own (see above).
  config.batch_size = 32
  config.eval_batch_size = 64  # 224-px images: a few hundred MB a batch.
  config.num_epochs = 10
  config.optimizer = 'adamw'
  config.optimizer_options.adamw.weight_decay = 0.05
  config.learning_rate = 3e-4
  config.schedule = 'cosine'
  config.warmup_epochs = 1.0
  config.loss_options.cross_entropy.label_smoothing = 0.1
  config.ema_decay = 0.99  # Averages ~100 steps: short runs on small folders lag less.
  config.evaluators = 'loss|accuracy|per_class|confusion_matrix|misclassified(36)'
  return config
