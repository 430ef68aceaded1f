"""The jobs that train a small Llama with a few SFT steps and then with another loss on the same
DeepSpeed engine (``launch/train_dpo.py``: preference training; ``launch/train_grpo.py``: GRPO):
:class:`SFTThen`, one run of the runner (:mod:`launch.jobs.runner`) whose steps are the
``--sft_steps`` SFT steps (:func:`launch.jobs.sft_step.sft_step`), then the ``--steps`` steps of
the second phase, counted over both (the checkpoints ``step_<k>``). At the first step of the
second phase (or of a run resumed past SFT) the held-out figures after SFT are taken, unless a
checkpoint holds them, and the frozen reference (the SFT model, when the loss has one) is
snapshotted into the job's state, so a checkpoint from then on carries it.

Held-out evaluations are ``{"phase", "step", ...}`` entries: ``init`` (step 0), ``sft`` (after
SFT), the second phase's at its own steps. Both jobs read the whole model on every rank
(:func:`launch.jobs.layouts.refuse_sharded_weights`) and train the LM jobs' Llama on the LM
jobs' tokenized text, data parallel. A job supplies its loss (``set_loss``), what it draws from
the text (``prepare_data``), its micro-batches of SFT, the second phase's steps, the held-out
figure its log lines show and its reports.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

from .checkpoints import LM_DATA_OPTIONS, DeepSpeedCheckpoints
from .layouts import refuse_sharded_weights
from .lm_data import load_data
from .models import build_llama
from .policy_model import CausalLMLogProbs
from .runner import Job

__all__ = ["SFTThen"]


class SFTThen(Job):
    """A job of SFT steps, then steps of a second phase (module docstring).

    Attributes:
        second: the second phase's name in rows and evaluations (``"dpo"``, ``"grpo"``).
        second_title: its name in log lines and tables (``"DPO"``, ``"GRPO"``).
        columns: ``metrics.csv``'s columns, in order (an SFT row leaves the second phase's
            empty).
        figure: ``(label, key)`` of the held-out figure the log lines show.
        task_key: the name of the job's state key that a resumed run must match (the pairs,
            the task), with :meth:`task` its value and ``task_flags`` the options setting it.
        whole_model: ``(lm_head, zero3)``, why the job refuses TP / SP and ZeRO-3
            (:func:`~launch.jobs.layouts.refuse_sharded_weights`).
        before_after: held-out figures the summary shows after SFT and after the second phase
            (``<key>_before``, ``<key>_after``).
        train_figure: ``(name, key)``: the summary's ``<name>_first`` / ``<name>_last``, the
            ``key`` of the second phase's first and last rows.
        policy_options: of the trained :class:`~launch.jobs.policy_model.CausalLMLogProbs`.
    """

    second = "second"
    second_title = "second"
    columns: Tuple[str, ...] = ()
    figure = ("held-out figure", "value")
    task_key, task_flags = "task", "--task"
    whole_model = ("the job reads the whole lm_head on every rank", "that the job reads whole")
    policy_options: Dict[str, Any] = {}
    before_after: Tuple[str, ...] = ()
    train_figure = ("train_loss", "loss")
    needs_reference = False

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        self.ref: Optional[Any] = None
        self.started = False

    @property
    def must_match(self) -> Mapping[str, str]:  # type: ignore[override]
        return {"sft_steps": "--sft_steps", self.task_key: self.task_flags}

    @property
    def total_steps(self) -> int:
        return self.args.sft_steps + self.args.steps

    def task(self) -> Any:
        raise NotImplementedError

    # the build
    def configure(self) -> dict:
        from megaloss.integrations.deepspeed import load_ds_config

        self.ds_config, self.ml = load_ds_config(self.args.deepspeed_config,
                                                 output_dir=str(self.out_dir))
        lm_head, zero3 = self.whole_model
        refuse_sharded_weights(self.ds_config, self.ml, self.args.deepspeed_config,
                               lm_head=lm_head, zero3=zero3)
        return self.ds_config

    def build(self) -> None:
        """Data parallel over the world; the loss (:meth:`set_loss`); the LM jobs' tokenized
        text and what the job draws from it (:meth:`prepare_data`, which returns the model's
        positions); the Llama of ``args`` and its engine."""
        from megaloss import Topology
        from megaloss.integrations.deepspeed import initialize

        args, ds_config = self.args, self.ds_config
        self.topo = topo = Topology.build(1)
        self.dp, self.dp_rank = topo.dp_size, topo.dp_rank
        self.micro = ds_config.get("train_micro_batch_size_per_gpu", 1)
        self.gas = ds_config.get("gradient_accumulation_steps", 1)
        self.set_loss()
        self.tok, train_stream, eval_stream, self.info, self.data_key = load_data(args)
        args.seq_len = self.prepare_data(train_stream, eval_stream)  # the model's positions
        self.vocab = self.tok.get_vocab_size()
        self.model, self.cfg = build_llama(args, self.vocab)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.policy = CausalLMLogProbs(self.model, **self.policy_options)
        self.me = me = initialize(self.policy, ds_config, topology=topo,
                                  output_dir=str(self.out_dir))
        self.engine, self.device = me.engine, me.engine.device
        self.run.log(f"engine ready: DP={self.dp}, ZeRO-{self.engine.zero_optimization_stage()}"
                     f", {self.n_params / 1e6:.2f} M params, measured engine loss multiplier "
                     f"{me.engine_scale.loss_multiplier:g}, {self.describe_loss()}")
        self.checkpoints = DeepSpeedCheckpoints(me, self.tok, {"data_key": self.data_key},
                                                LM_DATA_OPTIONS)

    def set_loss(self) -> None:
        """The second phase's loss from the ds_config and the command line."""

    def prepare_data(self, train_stream: Any, eval_stream: Any) -> int:
        """What the job draws from the text (held-out rows, its log line); returns the
        model's positions."""
        raise NotImplementedError

    def describe_loss(self) -> str:
        raise NotImplementedError

    def state(self) -> Dict[str, Any]:
        return {"sft_steps": self.args.sft_steps, self.task_key: self.task(), "reference": None}

    def record(self) -> Dict[str, Any]:
        return {"name": self.tag, "data_key": self.data_key, "seed": self.args.seed}

    def eval_point(self, step: int) -> Dict[str, Any]:
        sft = self.args.sft_steps
        return {"phase": "init", "step": 0} if step <= sft else {"phase": self.second,
                                                                  "step": step - sft}

    def on_eval(self, when: str, entry: Dict[str, Any]) -> None:
        label, key = self.figure
        if when == "before":
            self.run.log(f"at initialisation: {label} {entry[key]:.3f}")
        else:
            self.run.log(f"after {self.second_title}: {label} {entry[key]:.3f} (after SFT "
                         f"{self.run.evals[1][key]:.3f})")

    def progress(self, row: Dict[str, Any]) -> Dict[str, str]:
        return {"phase": row["phase"], "loss": f"{row['loss']:.3f}"}

    # the steps
    def step(self, step: int) -> Dict[str, Any]:
        sft = self.args.sft_steps
        if step <= sft:
            return self.sft(step)
        if not self.started:
            self.start_second()
        return self.second_step(step - sft)

    def row(self, phase: str, step: int, m: Mapping[str, Any], **figures: Any) -> Dict[str, Any]:
        """A ``metrics.csv`` row of :attr:`columns` (``""`` where ``figures`` has none)."""
        row = dict.fromkeys(self.columns, "")
        row.update(phase=phase, step=step, optimizer_step=m["step"], loss=m["loss"],
                   num_tokens=m["num_tokens"], lr=m["lr"], **figures)
        return row

    def sft_batches(self, step: int) -> List[Dict[str, Any]]:
        """SFT step ``step``'s micro-batches of ``input_ids`` and ``shift_labels``."""
        raise NotImplementedError

    def sft(self, step: int) -> Dict[str, Any]:
        from .sft_step import sft_step

        m = sft_step(self.me, self.sft_batches(step))
        if step % max(1, self.args.sft_steps // 5) == 0:
            self.run.log(f"SFT step {step}/{self.args.sft_steps}: loss {m['loss']:.4f}")
        return self.row("sft", step, m)

    def start_second(self) -> None:
        """After SFT: the held-out figures (unless a checkpoint holds them), the reference
        snapshot (read back from the checkpoint when resuming past this point), then the job's
        own set-up (:meth:`begin_second`)."""
        if not any(e["phase"] == "sft" for e in self.run.evals):
            label, key = self.figure
            self.run.log(f"after SFT: {label} {self.evaluate_at(phase='sft', step=0)[key]:.3f}")
        state = self.run.state
        if self.needs_reference and state["reference"] is None:
            state["reference"] = {k: v.detach().cpu().clone()
                                  for k, v in self.model.state_dict().items()}
        self.begin_second()
        self.started = True

    def begin_second(self) -> None:
        """What the second phase sets up (the reference module, its learning rate)."""

    def second_step(self, step: int) -> Dict[str, Any]:
        raise NotImplementedError

    def reference_module(self, **options: Any) -> Any:
        """The frozen reference policy from the job's state (``options``: of
        :class:`launch.jobs.policy_model.CausalLMLogProbs`), on the engine's device."""
        ref_model, _ = build_llama(self.args, self.vocab)
        ref_model.load_state_dict(self.run.state["reference"])
        ref_model.to(self.engine.device)
        return CausalLMLogProbs(ref_model.requires_grad_(False).eval(), return_entropy=False,
                                **options)

    # the reports
    def phase_summary(self) -> Dict[str, Any]:
        """The summary keys of both phases: held-out figures at initialisation, after SFT
        (``eval_before``) and after the second phase (``eval_after``; None when stopped) and
        their :attr:`before_after`, the steps of each phase, the SFT loss and the second
        phase's :attr:`train_figure`, the layout and model."""
        run, args, engine = self.run, self.args, self.engine
        evals, rows = run.evals, run.rows
        sft_rows = [r for r in rows if r["phase"] == "sft"]
        second, (name, key) = self.second_rows(), self.train_figure
        after_sft = next((e for e in evals if e["phase"] == "sft"), None)
        after = evals[-1] if run.stopped is None and evals[-1]["phase"] == self.second else None
        figures = {}
        for k in self.before_after:
            figures.update({f"{k}_before": after_sft and after_sft[k],
                            f"{k}_after": after and after[k]})
        return {
            "eval_init": evals[0], "eval_before": after_sft, "eval_after": after, **figures,
            f"{name}_first": second[0][key] if second else None,
            f"{name}_last": second[-1][key] if second else None,
            "evals": evals, "sft_steps": len(sft_rows), "steps": len(rows) - len(sft_rows),
            "sft_steps_requested": args.sft_steps,
            "sft_first_loss": sft_rows[0]["loss"] if sft_rows else None,
            "sft_last_loss": sft_rows[-1]["loss"] if sft_rows else None,
            "dp": self.dp, "zero_stage": engine.zero_optimization_stage(),
            "micro_batch": self.micro, "gas": self.gas, "vocab_size": self.vocab,
            "parameters": int(self.n_params),
            "engine_loss_multiplier": self.me.engine_scale.loss_multiplier,
            "model": f"Llama {self.cfg.num_hidden_layers}L x {self.cfg.hidden_size}",
            "data": "stdlib" if not args.train_data else "user files",
            "data_key": self.data_key, **self.info}

    def second_rows(self) -> List[Dict[str, Any]]:
        return [r for r in self.run.rows if r["phase"] != "sft"]

    @staticmethod
    def cells(summary: Mapping[str, Any], key: str, fmt: str = "{:.3f}") -> Tuple[str, ...]:
        """``key`` of the held-out evaluations at initialisation, after SFT and after the
        second phase, formatted (``-``: not taken)."""
        return tuple("-" if e is None else fmt.format(e[key]) for e in
                     (summary["eval_init"], summary["eval_before"], summary["eval_after"]))
