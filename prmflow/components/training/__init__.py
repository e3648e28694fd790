"""Training: the engine (optimizer, ZeRO, precision), checkpoints and resume, the supervised loop."""
