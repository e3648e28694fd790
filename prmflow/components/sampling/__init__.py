"""Sampling responses: the `sampling` section, the HF and vLLM engines, text in and text out."""
