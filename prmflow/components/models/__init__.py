"""Models and tokenizers: loading, vision inputs, chat turns, the PRM and its heads, logprob math."""
