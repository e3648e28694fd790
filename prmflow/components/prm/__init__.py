"""The PRM stage: train a process reward model, label steps Math-Shepherd style, score, rerank."""
