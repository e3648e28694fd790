"""Advantage stage: token rewards, advantages and returns from scored rollouts (CPU, no model).

`stage.run(stage.Config(...))` is the entry point. config.py holds the Config and the plan it
resolves to; streaming_passes.py streams the rollouts in passes; batch.py computes one batch; the math is in
token_rewards.py (token rewards) and estimators.py (estimators.ESTIMATORS).
"""
