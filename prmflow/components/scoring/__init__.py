"""Scoring with a PRM: per-step scores, step metrics, best-of-N reranking."""
