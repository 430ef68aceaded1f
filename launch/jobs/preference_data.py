"""The preference job's pairs (``launch/train_dpo.py``), built from the LM jobs' token streams
(:func:`launch.jobs.lm_data.load_data`: the standard library's text by default), deterministic
in ``(seed, step)``:

- a *prompt* is ``prompt_length`` consecutive tokens of the stream, at an offset drawn from the
  generator;
- *chosen* is the real continuation: the next ``completion_length`` tokens;
- *rejected* is a corruption of it, by ``kind``: ``"swap"`` (two neighbouring tokens at a
  random place exchanged: a local error in otherwise real text), ``"shuffle"`` (the same tokens
  in a random order), or ``"other"`` (the continuation at another random offset of the stream,
  most often of another file). A row that a swap or shuffle leaves unchanged (equal tokens)
  takes the ``"other"`` continuation instead. Chosen and rejected have the same length, so a
  pair needs no padding and length-normalisation changes no comparison.

Training pairs come from the training files' stream, held-out pairs from the held-out files'
(whole files held out by a crc32 of their path: :func:`launch.jobs.code_search.is_held_out`), so
held-out accuracy measures prompts and texts never trained on.

A micro-batch of ``P`` pairs is one ``[2P, T]`` batch (:func:`pair_batch`): rows ``0..P-1`` the
prompts with their chosen continuations, rows ``P..2P-1`` the same prompts with the rejected
ones; ``shift_labels`` hold the next token on the completion's positions and ``-100`` elsewhere
(the layout of :func:`megaloss.integrations.deepspeed.dpo_train_step`).
"""
from __future__ import annotations

from typing import Dict, NamedTuple

import torch

__all__ = ["REJECTED_KINDS", "Pairs", "draw_pairs", "completion_batch", "pair_batch",
           "sft_batch"]

REJECTED_KINDS = ("swap", "shuffle", "other")


class Pairs(NamedTuple):
    """``prompts [N, Lp]``, ``chosen [N, Lc]``, ``rejected [N, Lc]`` token ids (int64)."""

    prompts: torch.Tensor
    chosen: torch.Tensor
    rejected: torch.Tensor

    def rows(self, start: int, stop: int) -> "Pairs":
        return Pairs(self.prompts[start:stop], self.chosen[start:stop],
                     self.rejected[start:stop])

    def __len__(self) -> int:
        return self.prompts.shape[0]


def draw_pairs(stream: torch.Tensor, n: int, prompt_length: int, completion_length: int,
               kind: str, generator: torch.Generator) -> Pairs:
    """``n`` pairs from ``stream`` (1-D token ids), drawn from ``generator`` (module docstring).

    Raises:
        ValueError: unknown ``kind``; a stream shorter than one prompt and continuation.
    """
    if kind not in REJECTED_KINDS:
        raise ValueError(f"kind must be one of {REJECTED_KINDS}, got {kind!r}")
    window = prompt_length + completion_length
    if stream.numel() < window + 1:
        raise ValueError(f"the text holds {stream.numel()} tokens, fewer than one prompt and "
                         f"continuation ({window} + 1)")
    offsets = torch.randint(0, stream.numel() - window + 1, (n,), generator=generator)
    idx = offsets[:, None] + torch.arange(window)
    rows = stream[idx].long()
    prompts, chosen = rows[:, :prompt_length], rows[:, prompt_length:]
    other_at = torch.randint(0, stream.numel() - completion_length + 1, (n,), generator=generator)
    other = stream[other_at[:, None] + torch.arange(completion_length)].long()
    if kind == "other":
        return Pairs(prompts, chosen, other)
    if kind == "shuffle":
        order = torch.rand(n, completion_length, generator=generator).argsort(-1)
    else:  # swap: two neighbouring tokens at a random place
        j = torch.randint(0, completion_length - 1, (n,), generator=generator)
        order = torch.arange(completion_length).repeat(n, 1)
        rows_ = torch.arange(n)
        order[rows_, j], order[rows_, j + 1] = j + 1, j
    rejected = chosen.gather(1, order)
    same = (rejected == chosen).all(-1)
    rejected[same] = other[same]
    return Pairs(prompts, chosen, rejected)


def completion_batch(prompts: torch.Tensor, completions: torch.Tensor
                     ) -> Dict[str, torch.Tensor]:
    """``input_ids [N, T]`` (each prompt followed by its completion) and ``shift_labels [N, T]``
    (the next token on the completion's positions, ``-100`` elsewhere)."""
    p_len = prompts.shape[1]
    ids = torch.cat([prompts, completions], 1)
    labels = torch.full_like(ids, -100)
    labels[:, p_len - 1:-1] = ids[:, p_len:]
    return {"input_ids": ids, "shift_labels": labels}


def pair_batch(pairs: Pairs) -> Dict[str, torch.Tensor]:
    """One micro-batch of ``P`` pairs (:func:`completion_batch`): ``2P`` rows, the prompts with
    their chosen continuations, then the same prompts with the rejected ones."""
    return completion_batch(torch.cat([pairs.prompts, pairs.prompts]),
                            torch.cat([pairs.chosen, pairs.rejected]))


def sft_batch(pairs: Pairs) -> Dict[str, torch.Tensor]:
    """The SFT phase's micro-batch: the prompts with their chosen (real) continuations, the
    next-token NLL on every position (``shift_labels [P, T]``, ``-100`` on the last)."""
    ids = torch.cat([pairs.prompts, pairs.chosen], 1)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    return {"input_ids": ids, "shift_labels": labels}
