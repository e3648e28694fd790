"""Rollout stage: sample responses (HF or vLLM engine), score them (old/ref logprobs, values, PRM
step rewards, outcome reward recipes) and write the rollouts hand-off."""
