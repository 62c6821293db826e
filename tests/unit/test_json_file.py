"""Records from elsewhere that a JSON or YAML parser cannot take: an integer of more digits than Python converts
(a ValueError that is not a JSONDecodeError) and arrays nested deeper than the recursion limit (a RecursionError,
which no `except ValueError` catches). A record file (a checkpoint's train_state.json, a run's config.yaml) is
one line naming the file; a metrics.jsonl row is skipped like a torn one."""

import json

import pytest

from dit_train.runs.json_file import DamagedJSONFile, read_yaml

NESTED = "[" * 100_000
HUGE_INT = '{"step": 1' + "9" * 5000 + "}"


@pytest.mark.parametrize("text, why", [(NESTED, "nested deeper than the parser's recursion limit"),
                                       (HUGE_INT, "Exceeds the limit (4300 digits) for integer string conversion")])
def test_a_train_state_beyond_the_parser_is_one_line_naming_the_file(tmp_path, text, why):
    """It was a traceback (RecursionError) or a bare line naming no file (the digit limit), from resume, sampling,
    export and FD alike."""
    from dit_train.runs.checkpoint import read_train_state

    (tmp_path / "step_00000003.dcp").mkdir()
    (tmp_path / "step_00000003.dcp" / "train_state.json").write_text(text)
    with pytest.raises(DamagedJSONFile) as refused:
        read_train_state(str(tmp_path / "step_00000003.dcp"))
    message = str(refused.value)
    assert "step_00000003.dcp/train_state.json is not JSON dit_train reads" in message and why in message, message
    assert "\n" not in message


@pytest.mark.parametrize("text", ["[" * 100_000, "a: " + "9" * 5000])
def test_a_yaml_record_beyond_the_parser_is_one_line_naming_the_file(tmp_path, text):
    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(DamagedJSONFile, match="config.yaml is not YAML dit_train reads"):
        read_yaml(str(tmp_path / "config.yaml"))


def test_metrics_rows_beyond_the_parser_are_skipped_like_torn_ones(tmp_path):
    """dit-report marked the whole run damaged ('Exceeds the limit ...', naming no file) or stopped with a
    traceback (RecursionError); a resume setting aside later rows (runs/timeline.py) stopped with the traceback."""
    from dit_train.runs.timeline import _split_metrics
    from dit_train.study.report import read_metrics

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "train/loss": 1.0}, {"step": 2, "train/loss": 0.5}]
    path.write_text("\n".join([json.dumps(rows[0]), NESTED, HUGE_INT, json.dumps(rows[1])]) + "\n")
    assert read_metrics(str(path)) == rows
    keep, later, steps = _split_metrics(str(path), 1)
    assert steps == [2] and later == (json.dumps(rows[1]) + "\n").encode() and NESTED.encode() in keep
