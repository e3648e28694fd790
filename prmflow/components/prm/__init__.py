"""The PRM stages: train a process reward model (`prm`) and label steps Math-Shepherd style
(`prm-label`). The PRM itself lives in `components/models/`, its scoring and best-of-N in
`components/scoring/`, which rollout and evaluate use too."""
