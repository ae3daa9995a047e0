#!/usr/bin/env bash
# The prepared GPU run of benchmarks/backbones.py: resnet50 and vit_small_patch16_224, float32
# and bfloat16, batch 32 at 224 px, this app on JAX's GPU backend (cpu_kernels off) against
# timm in PyTorch on CUDA (eager and torch.compile). 12 children, each printing its row when
# done; estimated 6-9 minutes on one H100/H200-class GPU (the torch.compile children compile
# for 1-2 minutes each), cut at 9.5 minutes so that the whole call stays within 10.
# Not run yet: written on a machine without a GPU (docs/backbone_speed.md).
#
#   benchmarks/backbones_gpu.sh [OUT_DIR]      (default: $OUT, else the current directory)
#
# Needs, installed beforehand (the GPU machine may have no network): jax with its CUDA plugin
# (`pip install "jax[cuda13]==<the venv's jax version>"`) and torch with CUDA, plus timm
# (requirements-extras.txt). Writes OUT_DIR/backbones_gpu.json and OUT_DIR/backbones_gpu.log.
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

timeout 570 "$python" -m benchmarks.backbones --device=cuda --batch_size=32 --image_size=224 \
  --warmup=3 --steps=20 --rounds=1 --json="$out_dir/backbones_gpu.json" \
  2>&1 | tee "$out_dir/backbones_gpu.log"
