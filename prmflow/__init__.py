"""prmflow: RL fine-tuning with step-level process rewards, as re-runnable pipeline stages."""

__version__ = "0.1.0"
