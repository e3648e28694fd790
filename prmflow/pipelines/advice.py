"""Notes on a pipeline config that is valid but runs against what was measured: printed to stderr by the commands
that load a config (compile, submit --config, run-local), never an error.

Each note names the keys that cause it, why (with the docs section that has the evidence), and the keys that avoid it.
"""

from __future__ import annotations

from .settings import PipelineSpec, resolved


def frozen_step_credit(spec: PipelineSpec) -> str | None:
    """A note where grpo_progress's step credit reads a PRM that prm-update does not keep on this policy's outcomes.

    The step credit moves credit to where the PRM's scores drop. A PRM that predicts outcomes well but drops one step
    late (the checker with every merged line scored 1) took it well below outcome-only, and the calibration cannot
    see that (docs/process-rewards.md#5-the-evidence). A trained PRM with that bias, kept on-policy, shed it; the
    baseline credit cannot be bent in expectation. The task's own checker (rollout.prm: oracle) is exact,
    so it gets no note."""
    adv = resolved(spec, "advantage")
    if adv is None or adv.estimator != "grpo_progress" or adv.process_credit != "step" or adv.process_weight == 0:
        return None
    roll = resolved(spec, "rollout")
    if spec.pipeline.prm_update or (roll is not None and roll.prm == "oracle"):
        return None
    return ("note: advantage.process_credit is step and pipeline.prm_update is false, so the step credit follows a "
            "PRM that is never checked against this policy's own outcomes. A PRM that predicts outcomes well but "
            "drops one step late took this credit well below outcome-only (docs/process-rewards.md#5-the-evidence). "
            "Set pipeline.prm_update: true to keep the PRM on-policy, or advantage.process_credit: baseline.")


def notes(spec: PipelineSpec) -> list[str]:
    """Every note for `spec`, in a fixed order."""
    return [n for n in (frozen_step_credit(spec),) if n]
