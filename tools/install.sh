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
# torchtitan only as a test's peer, never a dependency: --no-deps keeps its datasets < 4.8 pin
# out (see the note above its pins in constraints.txt); its imported modules' few pure-Python
# dependencies are named here instead.
python3 -m pip install -q --no-deps -c "$C" torchtitan spmd-types tyro docstring-parser typeguard
python3 -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
