"""The PRM stages: train a process reward model (`prm`) and label steps Math-Shepherd style
(`prm-label`). The PRM itself, its scoring and best-of-N live in `components/common`, which rollout and
evaluate use too."""
