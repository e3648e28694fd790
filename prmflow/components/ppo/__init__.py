"""The ppo stage: clipped policy-gradient updates (and a critic) on one batch of advantages."""
