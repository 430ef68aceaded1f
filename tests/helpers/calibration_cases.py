"""Shared cases for the calibration tests: a global step's batch, its float64 single-device
reference, and the per-rank training loop under any engine.

The reference is written independently of megaloss: it walks each sample's token list in Python
and applies XTuner's definitions (token / sample / square) to the whole global batch.
"""
import math

import torch
import torch.nn.functional as F

H, V, T = 4, 5, 7  # T odd: SP=2 needs a padded slice
IGNORE = -100


def make_step(dp: int, gas: int, seed: int = 0):
    """The global batch of one optimizer step: ``batches[r][i]`` for DP rank r, micro-batch i,
    a dict with ``x [B, T, H]`` float64, ``labels [B, T]`` and optional ``cu_seqlens`` /
    ``position_ids``, plus ``samples``: list of flat token-index lists (for the reference)."""
    g = torch.Generator().manual_seed(1000 + 97 * dp + 13 * gas + seed)
    batches = []
    for r in range(dp):
        row = []
        for i in range(gas):
            kind = (r + i) % 3
            b = 2 if kind == 0 else 1
            labels = torch.randint(0, V, (b, T), generator=g)
            labels[torch.rand(b, T, generator=g) < 0.3] = IGNORE
            if (r, i) == (dp - 1, gas - 1) and dp * gas > 1:
                labels[:] = IGNORE  # a micro-batch without any valid token
            mb = {"x": torch.randn(b, T, H, generator=g, dtype=torch.float64), "labels": labels,
                  "cu_seqlens": None, "position_ids": None}
            if kind == 0:
                samples = [list(range(k * T, (k + 1) * T)) for k in range(b)]
            else:
                cuts = sorted(torch.randperm(T - 1, generator=g)[:2].add(1).tolist())
                bounds = [0] + cuts + [T]
                samples = [list(range(bounds[k], bounds[k + 1])) for k in range(len(bounds) - 1)]
                if kind == 1:
                    mb["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
                else:
                    pos = torch.cat([torch.arange(bounds[k + 1] - bounds[k])
                                     for k in range(len(bounds) - 1)])
                    mb["position_ids"] = pos.reshape(1, T)
            mb["samples"] = samples
            row.append(mb)
        batches.append(row)
    return batches


def init_weight() -> torch.Tensor:
    return torch.randn(V, H, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def reference(batches, reduction: str):
    """float64 single-device loss and d loss / d W on the whole global batch."""
    w = init_weight().requires_grad_(True)
    num, den = 0.0, 0.0
    for row in batches:
        for mb in row:
            logits = mb["x"].reshape(-1, H) @ w.t()
            y = mb["labels"].reshape(-1)
            for tokens in mb["samples"]:
                valid = [t for t in tokens if int(y[t]) != IGNORE]
                n = len(valid)
                if n == 0:
                    continue
                u = {"token": 1.0, "sample": 1.0 / n, "square": 1.0 / math.sqrt(n)}[reduction]
                for t in valid:
                    num = num + u * F.cross_entropy(logits[t:t + 1], y[t:t + 1])
                    den += u
    loss = num / den if den > 0 else w.sum() * 0.0
    loss.backward()
    return loss.detach(), w.grad


class TinyLM(torch.nn.Module):
    """The whole loss is computed inside forward (DeepSpeed's contract: gradients reach the
    output hooks, and ZeRO-3 gathers the weight)."""

    def __init__(self, dtype):
        super().__init__()
        self.head = torch.nn.Linear(H, V, bias=False, dtype=dtype)
        with torch.no_grad():
            self.head.weight.copy_(init_weight().to(dtype))

    def forward(self, x, labels, weights):
        logits = self.head(x).reshape(-1, V)
        per_token = F.cross_entropy(logits, labels.reshape(-1), ignore_index=IGNORE,
                                    reduction="none")
        return (per_token * weights.reshape(-1)).sum()


def train_step(micro_step, batches_of_rank, calibrator, dtype):
    """Run one calibrated optimizer step on this rank.

    ``micro_step(inputs, finalize, is_last)`` runs the engine's forward on ``inputs`` (``x,
    labels, weights``), passes the local weighted sum through ``finalize`` (the calibrator's
    ``loss_for_backward``) and backwards the result the engine's way. Returns the step's global
    loss and valid-token count."""
    from megaloss.calibration.weights import split_for_sequence_parallel
    topo = calibrator.topology
    step = calibrator.begin_step([mb["labels"] for mb in batches_of_rank],
                                 cu_seqlens=[mb["cu_seqlens"] for mb in batches_of_rank],
                                 position_ids=[mb["position_ids"] for mb in batches_of_rank])
    for i, mb in enumerate(batches_of_rank):
        x = split_for_sequence_parallel(mb["x"], topo.sp_rank, topo.sp_size, 0.0, dim=1)
        inputs = (x.to(dtype), step.local_labels(i), step.weights(i).to(dtype))
        micro_step(inputs, step.loss_for_backward, i == len(batches_of_rank) - 1)
    return step.global_loss(), step.num_tokens


def make_groups(dp: int, sp: int):
    """Topology of rank = dp_rank * sp + sp_rank on WORLD (every rank enters every new_group)."""
    import torch.distributed as dist

    from megaloss import Topology
    rank = dist.get_rank()
    dp_groups = [dist.new_group([d * sp + s for d in range(dp)]) for s in range(sp)]
    sp_groups = [dist.new_group([d * sp + s for s in range(sp)]) for d in range(dp)]
    world = dist.group.WORLD
    return Topology(dp_group=dp_groups[rank % sp], sp_group=sp_groups[rank // sp],
                    dp_sp_group=world)


def make_tp_groups(dp: int, tp: int):
    """Topology of rank = dp_rank * tp + tp_rank: TP replicas hold the same tokens, so the
    calibration group (dp x sp) is the DP group."""
    import torch.distributed as dist

    from megaloss import Topology
    rank = dist.get_rank()
    dp_groups = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
    tp_groups = [dist.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
    dp_group = dp_groups[rank % tp]
    return Topology(dp_group=dp_group, tp_group=tp_groups[rank // tp], dp_sp_group=dp_group)


def toy_batches():
    """Issue 4's toy case: per DP rank, 2 micro-batches of per-token coefficients a_t."""
    return [[torch.tensor([4.0]), torch.tensor([0.0, 0.0, 0.0])],
            [torch.tensor([2.0]), torch.tensor([2.0])]]


TOY_EXPECTED = {"token": 8.0 / 6.0, "sample": 2.0, "square": 8.0 / (3.0 + math.sqrt(3.0))}


class Toy(torch.nn.Module):
    """``l_t = a_t * theta``; returns ``sum_t w_t * l_t`` (inside forward)."""

    def __init__(self):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.ones(1))

    def forward(self, a, w):
        return (w * a * self.theta).sum()


def run_toy(calibrator, dp_rank, micro_step, dtype=torch.float64):
    """One toy step on this rank (``micro_step`` as in :func:`train_step`, inputs ``a, w``);
    returns the global loss (theta = 1)."""
    coeffs = toy_batches()[dp_rank]
    step = calibrator.begin_step([torch.zeros(len(a), dtype=torch.long) for a in coeffs])
    for i, a in enumerate(coeffs):
        micro_step((a.to(dtype), step.weights(i).to(dtype)), step.loss_for_backward,
                   i == len(coeffs) - 1)
    return step.global_loss()


def plain_micro_step(model):
    def micro_step(inputs, finalize, is_last):
        finalize(model(*inputs)).backward()
    return micro_step


# single process, no engine ------------------------------------------------------------------
