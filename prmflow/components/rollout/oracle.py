"""The oracle PRM: step rewards from the task's exact checker instead of a trained model.

`prm: oracle` labels every step of an arithmetic-task response 1 up to its first wrong step and 0
from it on (`arithmetic.step_labels`, the same labels the PRM is trained on). It is the ceiling of
what step rewards can give an RL run, the reference a trained PRM is measured against, and a way to
test the process-reward path without training a PRM first. Prompts of any other task have no exact
step checker: they are refused naming the first one.
"""

from __future__ import annotations

from ..data import steps as steps_lib
from ...errors import ConfigError
from ...tasks import arithmetic

ORACLE = "oracle"


def step_rewards(sources: list[str], prompts: list[str], responses: list[str], separator: str) -> list[list[float]]:
    """0/1 per step of each response (steps as `steps.steps` cuts them with `separator`, so the count
    matches the rows' step_ends)."""
    out: list[list[float]] = []
    for k, (source, prompt, response) in enumerate(zip(sources, prompts, responses)):
        if source != "arithmetic" or arithmetic.parse_problem(prompt) is None:
            raise ConfigError(f"prm=oracle: row {k} (source {source!r}) is not an arithmetic-task prompt, and only the "
                              f"arithmetic task has an exact step checker. Use a trained PRM directory for prm.")
        steps = steps_lib.steps(response, separator)
        out.append([float(y) for y in arithmetic.step_labels(prompt, arithmetic.STEP_SEPARATOR.join(steps))])
    return out
