"""The GRPO job's verifiable task: reverse (or sort) a short list of words drawn from the data,
rendered as text, with a reward in [0, 1] that a program checks.

Items: the ``num_items`` most frequent tokens of the training stream that decode to one word
with a leading space (``" self"``, ``" return"``, ``" None"``, ...), so every item is one token
and a list of items encodes to exactly the concatenation of their ids. A prompt is
``"reverse: <w1> <w2> ... <wL> =>"`` and its answer the ``L`` items reversed (``"sort:"``: in
the order of the items' frequency rank); every prompt of a task has the same length, so
prompts and completions batch without padding.

Reward (:meth:`ListTask.reward`): the share of the ``L`` answer positions where the completion
holds the right token (partial credit, so the signal is dense even when few answers are
perfect), as the verifiable-reward tasks of DeepSeekMath's GRPO (Shao et al. 2024,
arXiv:2402.03300) score a completion by a program rather than a learned model.

Held-out lists: a list is held out when ``crc32`` of its item indices falls in the first
``eval_fraction`` of the range; training draws only the other lists, so the held-out reward
measures lists the model never saw.
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

__all__ = ["TASKS", "ListTask", "build_task"]

TASKS = ("reverse", "sort")
_WORD = re.compile(r" [A-Za-z]{2,}")


@dataclass(frozen=True)
class ListTask:
    """One list task over a tokenizer's ids.

    Attributes:
        kind: ``"reverse"`` or ``"sort"`` (:data:`TASKS`).
        items: the item token ids, most frequent first (``sort`` orders by this rank).
        prefix_ids, arrow_ids: the ids of ``"<kind>:"`` and ``" =>"``.
        length: items per list (the answer's length in tokens).
        eval_fraction: share of all lists held out.
    """

    kind: str
    items: Tuple[int, ...]
    prefix_ids: Tuple[int, ...]
    arrow_ids: Tuple[int, ...]
    length: int
    eval_fraction: float = 0.1

    @property
    def prompt_length(self) -> int:
        return len(self.prefix_ids) + self.length + len(self.arrow_ids)

    @property
    def sequence_length(self) -> int:
        """Tokens of a prompt and its answer."""
        return self.prompt_length + self.length

    def is_held_out(self, indices: Sequence[int]) -> bool:
        """Whether the list of item indices ``indices`` belongs to the held-out set."""
        key = zlib.crc32(bytes(int(i) for i in indices))
        return key % 1000 < self.eval_fraction * 1000

    def draw(self, n: int, generator: torch.Generator, *, held_out: bool) -> torch.Tensor:
        """``n`` lists of item indices, int64 ``[n, length]``, uniform over the training
        (``held_out=False``) or held-out lists."""
        out: List[torch.Tensor] = []
        while len(out) < n:
            cand = torch.randint(0, len(self.items), (max(2 * n, 16), self.length),
                                 generator=generator)
            out.extend(r for r in cand if self.is_held_out(r.tolist()) == held_out)
        return torch.stack(out[:n])

    def prompts(self, indices: torch.Tensor) -> torch.Tensor:
        """int64 ``[n, prompt_length]`` prompt ids of the lists ``indices [n, length]``."""
        items = torch.tensor(self.items)[indices]
        n = indices.shape[0]
        return torch.cat([torch.tensor(self.prefix_ids).expand(n, -1), items,
                          torch.tensor(self.arrow_ids).expand(n, -1)], dim=1)

    def answers(self, indices: torch.Tensor) -> torch.Tensor:
        """int64 ``[n, length]``: the right completion of each list."""
        order = indices.flip(1) if self.kind == "reverse" else indices.sort(dim=1).values
        return torch.tensor(self.items)[order]

    @staticmethod
    def reward(completions: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        """float32 ``[n]`` in [0, 1]: the share of answer positions where ``completions [n, >=
        length]`` (its first ``length`` tokens) holds the answer's token.

        Raises:
            ValueError: fewer completion tokens than the answer has, or another row count.
        """
        n, k = answers.shape
        if completions.dim() != 2 or completions.shape[0] != n or completions.shape[1] < k:
            raise ValueError(f"completions must be [{n}, >= {k}], got {tuple(completions.shape)}")
        return (completions[:, :k] == answers).float().mean(dim=1)


def build_task(tokenizer, train_stream: torch.Tensor, *, kind: str = "reverse",
               num_items: int = 16, length: int = 5, eval_fraction: float = 0.1) -> ListTask:
    """The :class:`ListTask` whose items are the ``num_items`` most frequent one-word tokens
    (a space and two or more ASCII letters) of ``train_stream``.

    Raises:
        ValueError: unknown ``kind``; ``num_items`` < 2 or ``length`` < 2; the data holds fewer
            than ``num_items`` such tokens (a smaller ``--vocab_size`` or less text).
    """
    if kind not in TASKS:
        raise ValueError(f"kind must be one of {TASKS}, got {kind!r}")
    if num_items < 2 or length < 2:
        raise ValueError(f"num_items and length must be >= 2, got {num_items} and {length}")
    counts = torch.bincount(train_stream, minlength=tokenizer.get_vocab_size())
    words = [i for i in counts.argsort(descending=True, stable=True).tolist()
             if counts[i] > 0 and _WORD.fullmatch(tokenizer.decode([i]))]
    if len(words) < num_items:
        raise ValueError(f"the training text has {len(words)} one-word tokens, fewer than "
                         f"--num_items {num_items}; give more text, a larger --vocab_size or a "
                         "smaller --num_items")
    return ListTask(kind=kind, items=tuple(words[:num_items]),
                    prefix_ids=tuple(tokenizer.encode(f"{kind}:").ids),
                    arrow_ids=tuple(tokenizer.encode(" =>").ids), length=length,
                    eval_fraction=eval_fraction)
