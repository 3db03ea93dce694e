"""speculators' and SpecForge's own training entry points run for a few steps on a CPU (test support for
``tests/workflow/test_train_drafter.py``; README step 9 shows the commands, which train on GPUs).

Each entry runs in this process with the trainer's own command-line arguments. Only what the trainer's code
assumes of an accelerator is changed, and only here:

- speculators 0.9.0, ``speculators.train.cli.main`` (what ``speculators train`` and ``python -m speculators.train``
  call): its ``Trainer`` moves the model and every batch to ``LOCAL_RANK`` taken as a device index (``.to(0)``,
  the first accelerator) and synchronizes the accelerator around every logged step (``speculators/train/
  trainer.py``). Here the trainer's device is ``"cpu"`` and ``torch.accelerator.synchronize`` does nothing.
- speculators reads ``--hidden-states-backend eagle3_data`` (the ``speculators_inplace`` layout) as
  ``python -m eagle3_data.export.inplace`` does: that module is imported first, which registers the backend.
- SpecForge 0.2.0, ``specforge.cli.main`` (the ``specforge`` command), through ``python -m
  eagle3_data.export.inplace_specforge``'s ``main`` (SpecForge's command with this package's in-place feature
  store installed for a ``specforge_inplace`` manifest; any other run is SpecForge's alone): its EAGLE-3 KL loss is a Triton kernel
  (``LogSoftmaxLoss`` in ``specforge/core/loss.py``, a module that imports ``triton``). Here that module is
  replaced by one whose ``LogSoftmaxLoss.apply`` is the same file's PyTorch reference, ``_compute_loss``
  (``-sum(position_mask * target_p * log_softmax(logits), -1).mean()``, without its ``torch.compile``).

The trainer's own per-step metrics are collected: speculators' ``train`` records from its metric logger
(``speculators.metrics``), SpecForge's ``StepResult`` of each optimizer step (``TrainerCore.train_step`` in
``specforge/training/controller.py``).

Command line (one trainer run per process: both trainers set process-wide state such as logging and the
``torch.distributed`` environment)::

    python -m eagle3_data.testing.cpu_training {speculators|specforge} METRICS_JSON TRAINER_ARGS...

It writes ``METRICS_JSON``: ``{"trainer": str, "steps": [{"loss": float, ...}, ...]}``, one dict per optimizer
step in order.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

__all__ = ["reference_kl_loss", "run_speculators", "run_specforge", "main"]


def reference_kl_loss(logits, target_p, position_mask):
    """SpecForge's PyTorch reference of its Triton KL loss (``_compute_loss``, ``specforge/core/loss.py``).

    Args: ``logits`` [B, T, V] (any float dtype; computed in float32), ``target_p`` [B, T, V] target
    probabilities, ``position_mask`` [B, T, 1] (1: supervised). Returns the scalar loss, float32.
    """
    import torch

    logp = torch.log_softmax(logits.float(), dim=2)
    return -torch.sum(position_mask * target_p * logp, 2).mean()


def run_speculators(argv: list[str]) -> list[dict]:
    """``speculators train ARGV`` on the CPU (the module docstring says what differs). Returns the metrics of
    each training step as speculators logs them (``loss``, ``loss_<k>``, ``full_acc_<k>``, ...), in order.
    Raises what speculators raises (e.g. ValueError for a bad flag)."""
    import logging

    import torch
    import speculators.train.trainer as trainer
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    import eagle3_data.export.inplace  # noqa: F401 - registers --hidden-states-backend eagle3_data

    steps: list[dict] = []

    class _Metrics(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.msg
            if isinstance(msg, dict) and isinstance(msg.get("train"), dict):
                steps.append({"global_step": msg.get("global_step"), **msg["train"]})

    trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda device=None: None
    # on the root logger: speculators' logging setup (dictConfig) replaces the handlers of its own loggers
    logging.getLogger().addHandler(_Metrics())
    train_main(TrainConfig.resolve(list(argv)))
    return steps


def run_specforge(argv: list[str]) -> list[dict]:
    """``specforge ARGV`` (e.g. ``train --config run.yaml key=value ...``) on the CPU (the module docstring says
    what differs). Returns each optimizer step's ``loss``, ``grad_norm`` and scalar metrics, in order. Raises
    RuntimeError when the command returns a non-zero code, else what SpecForge raises."""
    loss_module = types.ModuleType("specforge.core.loss")

    class LogSoftmaxLoss:
        """Stands for the Triton ``torch.autograd.Function`` of the same name; autograd differentiates the
        reference."""

        apply = staticmethod(reference_kl_loss)

    loss_module.LogSoftmaxLoss = LogSoftmaxLoss
    loss_module._compute_loss = reference_kl_loss
    import specforge.core  # noqa: F401 - the package the replaced module belongs to

    sys.modules["specforge.core.loss"] = loss_module

    from specforge.training import controller

    from eagle3_data.export.inplace_specforge import main as specforge_main

    steps: list[dict] = []
    train_step = controller.TrainerCore.train_step

    def recorded(self, batch, ctx=None):
        result = train_step(self, batch, ctx)
        if result.optimizer_stepped:
            numeric = {k: float(v) for k, v in result.metrics.items() if isinstance(v, (int, float))}
            steps.append({**numeric, "loss": float(result.loss), "grad_norm": result.grad_norm})
        return result

    controller.TrainerCore.train_step = recorded
    rc = specforge_main(list(argv))
    if rc:
        raise RuntimeError(f"specforge {' '.join(argv)} returned {rc}")
    return steps


def main(argv: list[str] | None = None) -> int:
    """``{speculators|specforge} METRICS_JSON TRAINER_ARGS...``: run the trainer, write its steps' metrics."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] not in ("speculators", "specforge"):
        print(__doc__.split("Command line")[1].split("It writes")[0].strip(), file=sys.stderr)
        return 2
    trainer, out, rest = args[0], Path(args[1]), args[2:]
    steps = run_speculators(rest) if trainer == "speculators" else run_specforge(rest)
    out.write_text(json.dumps({"trainer": trainer, "steps": steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
