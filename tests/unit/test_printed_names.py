"""Names from files and folders as the commands print and tabulate them (dit_train/plain_text.py): a run's folder,
its saved model.name or optimizer.name may hold an ESC, a \\r or a \\n (a sweep made elsewhere), which drew escape
codes and fake "[fd]" lines; a label such as =HYPERLINK(...) in fd_results.csv ran as a spreadsheet formula."""

import csv
import json

from dit_train.plain_text import printable, spreadsheet_cell

EVIL = "adamw\x1b[2J\x1b]0;title\x07\r\n[fd] dit_s FD=0.0001\u202e"
ESCAPED = "adamw\\x1b[2J\\x1b]0;title\\x07\\r\\n[fd] dit_s FD=0.0001\\u202e"


def test_a_name_with_control_characters_prints_as_one_line_of_escapes(capsys, monkeypatch):
    import io
    import sys

    from dit_train.telemetry.progress import progress_bar, write

    assert printable(EVIL) == ESCAPED
    assert printable("dit_s muon K=3 lr=0.002 — é 日本") == "dit_s muon K=3 lr=0.002 — é 日本"  # printable as it is
    write(f"[fd] best {EVIL} (folder run\x1b[31m): FD=1.0000")  # how dit-fd and training's FD lines print
    assert capsys.readouterr().out == f"[fd] best {ESCAPED} (folder run\\x1b[31m): FD=1.0000\n"
    terminal = type("Terminal", (io.StringIO,), {"isatty": lambda self: True})()
    monkeypatch.setattr(sys, "stderr", terminal)  # bars are drawn on a terminal only
    with progress_bar(3, f"FD {EVIL} step 4") as bar:  # a bar's label: the run's label or folder
        bar.update(1)
    assert f"FD {ESCAPED} step 4" in terminal.getvalue() and "\x1b[2J" not in terminal.getvalue()


def test_fd_results_csv_cells_are_text_not_formulas_and_numbers_stay_numbers(tmp_path):
    from dit_train.evaluation.fd.job import COLUMNS, write_results

    row = {k: 1 for k in COLUMNS} | {"label": "=1+1", "run": '=HYPERLINK("http://x","y")', "encoder": "+cmd",
                                     "ref_id": "-2+3", "checkpoint": "@SUM(A1)", "scored_at": "\t=1", "fd": -1.5,
                                     "step": 3, "active_time_s": 0.25, "reference": "train:100"}
    write_results(tmp_path, [row])
    with open(tmp_path / "fd_results.csv", newline="") as f:
        (header, cells), = [list(csv.reader(f))]
    got = dict(zip(header, cells))
    assert {k: got[k] for k in ("label", "run", "encoder", "ref_id", "checkpoint", "scored_at")} == {
        "label": "'=1+1", "run": "'=HYPERLINK(\"http://x\",\"y\")", "encoder": "'+cmd", "ref_id": "'-2+3",
        "checkpoint": "'@SUM(A1)", "scored_at": "'\t=1"}
    assert (got["fd"], got["step"], got["active_time_s"], got["reference"]) == ("-1.5", "3", "0.25", "train:100")
    assert json.loads((tmp_path / "fd_results.json").read_text())["rows"] == [row]  # the data itself is unchanged
    assert spreadsheet_cell(-2) == -2 and spreadsheet_cell("dit_s") == "dit_s"


def test_every_command_prints_its_error_line_through_print_error():
    """The commands' refusals quote names from files (image, run and checkpoint names): one printer escapes them
    (print_error). A new `print(f"error: ...")` elsewhere would print them raw."""
    import pathlib

    import dit_train

    root = pathlib.Path(dit_train.__file__).parent
    raw = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if p.name != "plain_text.py"
           for i, line in enumerate(p.read_text().splitlines(), 1) if 'print(f"error:' in line]
    assert raw == []


def test_an_error_line_goes_out_in_one_write(monkeypatch):
    """Two ranks of a torchrun job refusing at once share one stderr: print() wrote the line and its newline apart
    (two writes under PYTHONUNBUFFERED), and CI's log held "... --outerror: ... --out" with one newline for both.
    One write per line (a pipe write under 4 KiB is atomic) keeps each rank's line whole."""
    import sys

    from dit_train.plain_text import print_error

    class Recorder:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)
            return len(text)

        def flush(self):
            pass

    err = Recorder()
    monkeypatch.setattr(sys, "stderr", err)
    print_error("--out /x is being written by another dit-encode-latents\x1b[2J")
    assert err.writes == ["error: --out /x is being written by another dit-encode-latents\\x1b[2J\n"]
