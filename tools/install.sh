#!/usr/bin/env bash
# Installs megaloss (editable) and everything its tests, docs, lint and launch scripts need, at the
# exact versions of tools/constraints.txt. torch goes first and pinned (a CPU wheel lies on disk
# here; an unpinned torch pulls a multi-GB CUDA build).
# DeepSpeed ships as an sdist whose build imports torch: --no-build-isolation makes it build
# against the torch installed here instead of downloading another one into a build environment.
set -euo pipefail
cd "$(dirname "$0")/.."
C=tools/constraints.txt
python3 -m pip install -q -c "$C" torch
python3 -m pip install -q -c "$C" setuptools wheel
python3 -m pip install -q --no-build-isolation -c "$C" \
    -e ".[test,deepspeed,hf,wandb,tensorboard,st,lint,docs]"
python3 -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
