"""Pure parts of the gates: RULER scoring, prompts, and the result report (the stopping rule has its own file)."""

import json
from pathlib import Path

import pytest
from kvpolicy.gate_programs import niah, report


def test_string_match_all_is_the_fraction_found_case_insensitively() -> None:
    assert niah.string_match_all("The numbers are 1234567 and ABC.", ("1234567", "abc", "7654321")) == pytest.approx(
        2 / 3
    )
    assert niah.matches_per_needle("x 42", ("42", "43")) == (True, False)
    with pytest.raises(ValueError, match="at least one expected string"):
        niah.string_match_all("anything", ())


def test_samples_are_seeded_with_distinct_keys_spread_over_the_haystack() -> None:
    sample = niah.draw_sample(seed=9, index=4, num_needles=8, num_asked=3)
    assert sample == niah.draw_sample(seed=9, index=4, num_needles=8, num_asked=3)
    assert sample != niah.draw_sample(seed=9, index=5, num_needles=8, num_asked=3)
    assert len({needle.key for needle in sample.needles}) == 8
    assert len(sample.asked) == 3 and set(sample.asked) <= set(sample.needles)
    # One needle per eighth of the haystack.
    assert [int(depth * 8) for depth in sample.depths] == list(range(8))
    with pytest.raises(ValueError, match="num_asked must be between 1 and num_needles"):
        niah.draw_sample(seed=0, index=0, num_needles=2, num_asked=3)


def test_rendered_prompt_holds_every_needle_at_a_sentence_end_and_asks_its_keys() -> None:
    sample = niah.draw_sample(seed=1, index=2)
    prompt = niah.render(sample, 2400)
    needles, asked = niah.parse_prompt(prompt)
    assert needles == {needle.key: (needle.value,) for needle in sample.needles}
    assert asked == tuple(needle.key for needle in sample.asked)
    assert prompt.startswith(niah.HEADER)
    for needle in sample.needles:
        text = niah.NEEDLE.format(key=needle.key, value=needle.value)
        assert f". {text}" in prompt
    # The needle sits near its depth in the haystack.
    first = sample.needles[0]
    position = prompt.index(first.key) / len(prompt)
    assert abs(position - sample.depths[0]) < 0.1


def test_report_prints_json_writes_the_termination_log_and_maps_verdicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "log"
    monkeypatch.setenv(report.TERMINATION_LOG_ENV, str(log))
    result = {"gate": "accuracy", "verdict": "Fail", "message": "x" * 10000}
    assert report.emit(result) == 1
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(log.read_text())
    assert len(log.read_bytes()) <= 4096
    assert printed["message"].endswith("...") and printed["verdict"] == "Fail"
    assert [report.EXIT_CODES[v] for v in ("Pass", "Fail", "Breach", "Inconclusive")] == [0, 1, 1, 2]


def test_termination_log_defaults_to_the_kubernetes_path_only_if_it_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(report.TERMINATION_LOG_ENV, raising=False)
    monkeypatch.setattr(report, "DEFAULT_TERMINATION_LOG", tmp_path / "termination-log")
    assert report.termination_log_path() is None
    (tmp_path / "termination-log").touch()
    assert report.termination_log_path() == tmp_path / "termination-log"
