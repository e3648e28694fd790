"""Advantage stage: token rewards, advantages and returns from scored rollouts (CPU, no model).

`stage.run(stage.Config(...))` is the entry point; estimators.ESTIMATORS and rewards.py hold the math.
"""
