"""The tiny model's cache (`models/tiny.py`): a run that finds its tiny model there copies the
files a fresh build writes, byte for byte; a change to the model section or the seed builds
another; "off" keeps nothing; a folder left half-written is not taken for a model."""

from __future__ import annotations

import dataclasses
import filecmp

import pytest

from dapo_mega.config import ModelConfig
from dapo_mega.models import tiny

SMALL = ModelConfig(tiny_hidden_size=32, tiny_intermediate_size=64, tiny_num_layers=1)


def _same_files(a, b) -> bool:
    names = sorted(p.name for p in a.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return names == sorted(p.name for p in b.iterdir()) and not mismatch and not errors


def test_a_cached_tiny_model_is_the_one_a_fresh_build_writes(tmp_path, monkeypatch):
    monkeypatch.setenv(tiny.TINY_CACHE_ENV, str(tmp_path / "cache"))
    fresh = tiny.build_tiny_model_dir(tmp_path / "fresh", SMALL, seed=3)
    first = tiny.build_tiny_model_in_place(tmp_path / "run1" / "base_model", SMALL, 3)
    cached = tiny.tiny_model_cache_dir(SMALL, 3)
    assert cached.parent == tmp_path / "cache" and _same_files(cached, fresh) and _same_files(first, fresh)

    def no_build(*args, **kwargs):
        raise AssertionError("built again although the cache holds it")

    monkeypatch.setattr(tiny, "build_tiny_model_dir", no_build)
    second = tiny.build_tiny_model_in_place(tmp_path / "run2" / "base_model", SMALL, 3)
    assert _same_files(second, fresh)
    # another seed or another size is another model: built, not copied
    for cfg, seed in ((SMALL, 4), (dataclasses.replace(SMALL, tiny_num_layers=2), 3)):
        assert tiny.tiny_model_cache_dir(cfg, seed) != cached
        with pytest.raises(AssertionError, match="built again"):
            tiny.build_tiny_model_in_place(tmp_path / f"other{seed}" / "base_model", cfg, seed)
    assert sorted(p.name for p in (tmp_path / "run1").iterdir()) == ["base_model"]  # no temporary left


def test_half_written_cache_folder_is_built_over_and_off_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(tiny.TINY_CACHE_ENV, str(tmp_path / "cache"))
    cached = tiny.tiny_model_cache_dir(SMALL, 0)
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{")  # a copy cut short before its marker file
    built = tiny.build_tiny_model_in_place(tmp_path / "run" / "base_model", SMALL, 0)
    assert (built / "model.safetensors").is_file() and (built / "dapo_mega_tiny.json").is_file()

    monkeypatch.setenv(tiny.TINY_CACHE_ENV, "off")
    assert tiny.tiny_model_cache_dir(SMALL, 0) is None
    tiny.build_tiny_model_in_place(tmp_path / "run_off" / "base_model", SMALL, 5)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [cached.name]
