#!/usr/bin/env bash
# Installs megaloss and everything its tests and launch scripts need on a fresh machine.
# torch goes first and pinned (a CPU wheel lies on disk here; unpinned torch pulls a CUDA build).
# DeepSpeed ships as an sdist whose build imports torch: --no-build-isolation makes it build
# against the torch installed here instead of downloading another one into a build environment.
set -euo pipefail
cd "$(dirname "$0")/.."
# The test extra brings triton (no dependencies of its own: the CPU torch stays), whose
# interpreter runs the Triton epilogue's tests on CPU.
# The wandb and tensorboard extras: the monitors the LM job's tests read back (no torch either).
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q --no-build-isolation -e ".[test,deepspeed,hf,wandb,tensorboard,st]"
python3 -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
