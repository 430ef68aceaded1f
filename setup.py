"""megaloss: memory-cheap, layout-exact losses for large-scale training, wired into DeepSpeed."""
from setuptools import find_packages, setup

# torch is pinned: an unpinned `torch` (here or in a dependency's range) pulls a multi-GB CUDA build.
TORCH = "torch==2.13.0"

setup(
    name="megaloss",
    version="0.1.0",
    description="Chunked, vocab-parallel and globally calibrated losses for DeepSpeed training",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megaloss", "megaloss.*"]),
    python_requires=">=3.10",
    install_requires=[TORCH, "pydantic>=2.0", "numpy"],
    extras_require={
        # triton: the Triton epilogue's tests run its kernels on CPU through Triton's interpreter
        # (TRITON_INTERPRET=1). Pinned to one that works there: 3.6's interpreter fails with
        # numpy 2.4 (loop bounds); triton has no dependencies, so it pulls no torch.
        "test": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100",
                 "triton==3.8.0; sys_platform == 'linux'"],
        "deepspeed": ["deepspeed==0.19.8"],
        "hf": ["transformers>=4.46,<6", "tokenizers>=0.20", "rich>=13", "tqdm>=4.66",
               "matplotlib>=3.8"],
        # Monitors DeepSpeed writes megaloss's metrics to (ds_config "wandb" / "tensorboard"
        # sections); the tests read an offline W&B run back with `wandb leet inspect` (0.31+).
        # Neither depends on torch.
        "wandb": ["wandb>=0.31"],
        "tensorboard": ["tensorboard>=2.14"],
        # The sentence-transformers drop-in (megaloss.integrations.hf.sentence_transformers) and
        # the HF Trainer paths; sentence-transformers 6.2 + datasets + accelerate keep torch 2.13.
        "st": ["sentence-transformers>=6.2", "datasets>=3", "accelerate>=1.1"],
    },
)
