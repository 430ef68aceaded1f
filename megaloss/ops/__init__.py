"""Single-device math: no process groups, no autograd Functions."""
from .cross_entropy_chunk import CrossEntropyOptions, ChunkResult, chunk_cross_entropy

__all__ = ["CrossEntropyOptions", "ChunkResult", "chunk_cross_entropy"]
