#!/usr/bin/env python3
"""What megaloss's losses send as the world grows: a model of their collectives, checked against
counts measured on real gloo processes, and the scaling table and plot of docs/communication.md.

    megaloss-comm-model                      # the scaling tables (model)
    megaloss-comm-model --measure            # measure at world 1-4, compare to the model
    megaloss-comm-model --measure --json docs/comm_measured.json --plot docs/comm_scaling.png
    megaloss-comm-model --markdown           # docs/communication.md's tables

(``python -m megaloss.cli.comm_model`` is the same.)

**The model** (:func:`vocab_parallel_ce`, :func:`calibration_step`, :func:`mnr_call`,
:func:`mnr_step`, :func:`lm_step`) gives, per rank, every collective a loss issues: its kind
(all-reduce, all-gather, reduce-scatter), the size of the group it runs over, the number of calls
and the *payload* (the bytes this rank hands to the collective: the all-reduce buffer, the
all-gather input, the reduce-scatter input), as ``tools/bench_vocab_parallel.py`` counts them.
It is exact, not asymptotic: the shape checks, the metadata exchanges, the padding of uneven
batches and the chunking are in it. Parameters: TP, DP, SP (DeepSpeed-Ulysses, the Topology's
``sp``: a rank holds ``1/SP`` of each sample's tokens), tokens or pairs per rank, hidden /
embedding size, chunk size, dtypes, options.

**Bytes on the wire** (:meth:`Traffic.wire_bytes`) are derived from the payloads with the ring
algorithms' costs (Thakur, Rabenseifner & Gropp 2005; NCCL's ring all-reduce): per rank, an
all-reduce of ``x`` bytes over ``p`` ranks sends ``2 (p-1)/p x``, an all-gather of an ``x``-byte
input ``(p-1) x``, a reduce-scatter of an ``x``-byte input ``(p-1)/p x``. That part is an
assumption about the backend (tree and hierarchical algorithms differ by constant factors), not
a measurement.

**The measurement** (:func:`measure`): ``world`` spawned gloo processes (``megaloss.testing``)
run every layout ``TP x DP x SP = world`` on small sizes, each loss through its public entry
point, counting with :class:`CollectiveCounter`, a ``TorchDispatchMode`` that sees every c10d
operator: the ``torch.distributed`` calls (``c10d::allreduce_``, ``c10d::_allgather_base_``) and
the functional collectives of the autograd gathers (``_c10d_functional::all_gather_into_tensor``
and, in backward, ``reduce_scatter_tensor``) -- the latter never pass through the
``torch.distributed`` functions that ``bench_vocab_parallel.py``'s counter wraps. The test
(``tests/tools/test_comm_model.py``) requires every count to equal the model's, per rank.

**GradCache** (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup"; sentence-transformers' ``CachedMultipleNegativesRankingLoss``): embed the step's
``G`` chunks without gradients, run the loss ONCE on all of them, then re-encode each chunk with
gradients and back-propagate the cached embedding gradients. :func:`gradcache_mnr_step` does it
on megaloss's ``mnr_loss`` (measured like the rest); its communication is one loss call over
``G x B`` pairs per step instead of ``G`` calls over ``B``.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from .comm_costs import (
    DTYPE_BYTES,
    KINDS,
    Traffic,
    calibration_step,
    gradient_allreduce,
    lm_step,
    mnr_call,
    mnr_step,
    train_step_logging,
    vocab_parallel_ce,
)
from .comm_measure import (
    CALIB_SHAPE,
    CE_CASES,
    MNR_CASES,
    STEP_GAS,
    CollectiveCounter,
    check,
    gradcache_mnr_step,
    layouts,
    measure,
    predict,
)
from .comm_scale import (
    MEASURED_WORLDS,
    TABLE_DP,
    TABLE_TP,
    Scenario,
    ce_crossing_tokens,
    crossings,
    human,
    lm_row,
    lm_table,
    markdown,
    mnr_crossing_dp,
    mnr_row,
    mnr_table,
    plot,
)

__all__ = ["KINDS", "DTYPE_BYTES", "Traffic", "vocab_parallel_ce", "calibration_step",
           "train_step_logging", "mnr_call", "mnr_step", "lm_step", "gradient_allreduce",
           "CollectiveCounter", "layouts", "CE_CASES", "MNR_CASES", "STEP_GAS", "CALIB_SHAPE",
           "predict", "gradcache_mnr_step", "measure", "check", "Scenario", "TABLE_TP", "TABLE_DP",
           "MEASURED_WORLDS", "lm_row", "mnr_row", "ce_crossing_tokens", "mnr_crossing_dp",
           "human", "lm_table", "mnr_table", "crossings", "plot", "markdown", "main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="megaloss-comm-model",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measure", action="store_true",
                   help="count the collectives on 1-4 gloo processes and compare to the model")
    p.add_argument("--worlds", type=int, nargs="+", default=list(MEASURED_WORLDS))
    p.add_argument("--json", metavar="PATH", help="write the measured records (with --measure)")
    p.add_argument("--records", metavar="PATH", help="read measured records (instead of "
                   "--measure) for the plot")
    p.add_argument("--plot", metavar="PATH", help="write the scaling plot (PNG)")
    p.add_argument("--markdown", action="store_true",
                   help="print the tables of docs/communication.md")
    args = p.parse_args(argv)

    records = None
    status = 0
    if args.measure:
        records = measure(args.worlds)
        problems = check(records)
        n = len(records)
        print(f"measured {n} (case, layout, rank) records at world {args.worlds}: "
              f"{'all equal to the model' if not problems else f'{len(problems)} differ'}")
        for line in problems[:20]:
            print("  " + line)
        status = 1 if problems else 0
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=0)
    elif args.records:
        with open(args.records) as f:
            records = json.load(f)
    if args.plot:
        plot(args.plot, records)
        print(f"wrote {args.plot}")
    if args.markdown or not (args.measure or args.plot):
        print(markdown())
    return status


if __name__ == "__main__":
    sys.exit(main())
