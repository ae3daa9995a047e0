#!/usr/bin/env bash
# The prepared GPU run of benchmarks/backbones.py: resnet50 and vit_small_patch16_224 in
# bfloat16 (what a GPU trains in), batch 128 at 224 px, this app on JAX's GPU backend
# (cpu_kernels off) against timm in PyTorch on CUDA (eager and torch.compile). 6 children, each
# printing its row when done: 207 s on one H200 (the torch.compile children compile for 20-40 s
# each), cut at 6 minutes; then the inference rows at batch 256, cut at 3, so that a lent
# machine's 10-minute call holds both with the install. docs/backbone_speed.md has its table.
#
#   benchmarks/backbones_gpu.sh [OUT_DIR]      (default: $OUT, else the current directory)
#
# Needs, installed beforehand (the GPU machine may have no network): jax with its CUDA plugin
# (`pip install "jax[cuda13]==<the venv's jax version>"`) and torch with CUDA, plus timm
# (requirements-extras.txt). Writes OUT_DIR/backbones_gpu.json and .log,
# OUT_DIR/inference_gpu.json and .log.
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir="${1:-${OUT:-.}}"
mkdir -p "$out_dir"
python="${PYTHON:-.venv/bin/python}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# Refuse now, in one line, rather than benchmark the CPU under the GPU's name.
JAX_PLATFORMS=cuda "$python" -c 'import jax; print("jax", jax.__version__, jax.devices())' ||
  { echo "JAX sees no CUDA GPU: install jax[cuda13] matching the venv's jax first." >&2; exit 1; }
"$python" -c 'import torch, timm; assert torch.cuda.is_available(); print("torch", torch.__version__, torch.cuda.get_device_name(0), "timm", timm.__version__)' ||
  { echo "PyTorch sees no CUDA GPU (or timm is missing): install the CUDA torch and timm first." >&2; exit 1; }

# Under 10 minutes in all: the train steps, then the inference rows (predict's program, timm
# under torch.inference_mode(), eager and compiled).
timeout 360 "$python" -m benchmarks.backbones --device=cuda --dtypes=bfloat16 --batch_size=128 \
  --image_size=224 --warmup=3 --steps=10 --rounds=1 --json="$out_dir/backbones_gpu.json" \
  2>&1 | tee "$out_dir/backbones_gpu.log"
timeout 180 "$python" -m benchmarks.backbones --task=inference --device=cuda --dtypes=bfloat16 \
  --batch_size=256 --image_size=224 --warmup=3 --steps=10 --rounds=1 \
  --json="$out_dir/inference_gpu.json" 2>&1 | tee "$out_dir/inference_gpu.log"
