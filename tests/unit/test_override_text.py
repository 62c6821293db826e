"""Values written into Hydra overrides and into the commands printed for a user (dit_train/config/override_text.py).
A sweep's run folder is named by its overrides (`optimizer.lr=0.004,seed=43`): before, `run_dir=<that>` was a Hydra
syntax error, so the printed "rerun with" command failed and the resume's own compose of the saved run gave up
("judged as typed"), and a quoted run_dir made its folder under the quoted name."""

import random
import shlex

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from dit_train.__main__ import explicit_run_dir
from dit_train.config import ConfigError
from dit_train.config.command_line import check_sweep_needs_multirun, parse_overrides
from dit_train.config.override_text import (override, override_list, override_value, parsed_value, shell_command,
                                            shell_override, shell_word)
from dit_train.trainer.preemption import Preemption

HOSTILE = ["/runs/plain", "/sweep/optimizer.lr=0.004,seed=43", "/a b/c", "/it's", '/say "x"', "/back\\slash",
           "/trailing\\", "/ü/日本", "/[1]", "/{a}", "/(b)", "/c:d", "/$HOME", "/a!b", "x'", "'", '"', "null", "true",
           "1e3", "/~user", "/#tag", "", " lead", "trail ", "tab\tin", "new\nline", "it's \"both\"", "a\\'b",
           "1,2", "-dash", "/a/*?", "/%p", "/a@b"]


def hydra_reads(text: str):
    parsed = OverridesParser.create().parse_override(f"k={text}")
    assert not parsed.is_sweep_override()
    return parsed.value()


@pytest.mark.parametrize("value", HOSTILE)
def test_a_value_reads_back_exactly_from_the_override_and_from_the_shell(value):
    assert hydra_reads(override_value(value)) == value
    assert parsed_value(override("run_dir", value)) == value
    typed = shell_override("run_dir", value)
    assert shlex.split(typed) == [override("run_dir", value)]  # the shell hands Hydra exactly the override


def test_random_strings_of_hydras_and_the_shells_characters_read_back():
    rng = random.Random(0)
    alphabet = "ab/._-=,:[]{}()'\"\\ \t$!`#~*?%@ü\n0"
    for _ in range(400):
        value = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        assert hydra_reads(override_value(value)) == value, value
        assert shlex.split(shell_override("run_dir", value)) == [override("run_dir", value)], value


def test_a_plain_value_is_written_as_it_is():
    assert override("run_dir", "runs/my_run") == "run_dir=runs/my_run"
    assert shell_override("run_dir", "runs/my_run") == "run_dir=runs/my_run"
    assert override_value("/sweep/lr=0.004,seed=43") == "/sweep/lr\\=0.004\\,seed\\=43"
    assert shell_override("run_dir", "/sweep/lr=0.004") == "'run_dir=/sweep/lr\\=0.004'"
    assert shell_override("run_dir", "/data/bob's runs") == '"run_dir=\'/data/bob\\\\\'s runs\'"'  # not '"'"'


@pytest.mark.parametrize("value", ["/sweep/optimizer.lr=0.004,seed=43", "/it's", "/a b"])
def test_the_run_folder_of_a_quoted_or_escaped_run_dir_is_the_value_hydra_reads(value):
    """Before: the quotes were stripped by hand (a backslash-escaped folder was made under its escaped name)."""
    assert explicit_run_dir(["experiment=debug", override("run_dir", value)]) == value
    assert explicit_run_dir(["--multirun", override("run_dir", value)]) is None


@pytest.mark.parametrize("last_step", [False, True])
def test_the_preemption_message_names_a_command_that_reaches_the_same_folder(last_step):
    run_dir = "/sweep/model=dit_m,optimizer.lr=0.004,seed=43"
    message = str(Preemption().stop(12, run_dir, last_step=last_step))
    command = shlex.split(message.split("rerun with ", 1)[1])
    assert command[0] == "train.resume=auto" and parsed_value(command[1]) == run_dir
    assert [o.value() for o in parse_overrides(command[:2])] == ["auto", run_dir]


def test_a_sweep_without_multirun_is_refused_in_one_line_with_both_ways_out():
    with pytest.raises(ConfigError) as e:
        check_sweep_needs_multirun([], ["experiment=debug", "run_dir=a,b"])
    said = str(e.value)
    assert said.startswith("run_dir=a,b is a sweep") and "--multirun" in said and "\n" not in said
    assert hydra_reads(shlex.split(said.rsplit(": ", 1)[1])[0].split("=", 1)[1]) == "a,b"  # strict: no fallback
    check_sweep_needs_multirun(["--multirun"], ["run_dir=a,b"])
    check_sweep_needs_multirun([], ["hydra.mode=MULTIRUN", "run_dir=a,b"])
    check_sweep_needs_multirun([], ["run_dir=a\\,b", "optimizer.lr=1e-3"])


def test_a_syntax_error_names_its_argument_and_how_to_write_the_value():
    with pytest.raises(ConfigError) as e:
        parse_overrides(["experiment=debug", "run_dir=/sweep/lr=0.004"])
    said = str(e.value)
    assert said.startswith("run_dir=/sweep/lr=0.004: ") and "\n" not in said
    assert hydra_reads(shlex.split(said.rsplit("written ", 1)[1])[0].split("=", 1)[1]) == "/sweep/lr=0.004"


def test_a_printed_command_hands_the_program_exactly_its_words():
    """dit-study's trainer commands, the reports' "Built by" lines and the hints name paths of the user's choosing:
    pasted, they must reach the program as the same words (shell_override is shell_word of the override)."""
    words = ["dit-report", *HOSTILE, override("hydra.sweep.dir", "/x/a=1,b 2 it's ü")]
    assert shlex.split(shell_command(words)) == words
    assert shell_command(["dit-report", "sweeps/plain"]) == "dit-report sweeps/plain"  # as before where it can be
    for value in HOSTILE:
        assert shell_override("run_dir", value) == shell_word(override("run_dir", value))


def test_the_dit_export_hint_for_a_run_folder_pastes_as_that_folder(tmp_path):
    """DiT.from_pretrained / DiTTrainPipeline given a run folder name `dit-export <folder> OUT_DIR`: unquoted, a
    folder of a sweep (`lr=0.004,seed=43`) with a space or a quote was other words to the shell."""
    from dit_train.runs.folder_kind import run_folder_hint

    run = tmp_path / "sweep 1" / "optimizer.lr=0.004,seed=43 it's ü"
    (run / "checkpoints").mkdir(parents=True)
    command = run_folder_hint(str(run)).split("`")[1]
    assert shlex.split(command) == ["dit-export", str(run), "OUT_DIR"]


def test_the_refused_resumes_data_root_hint_pastes_as_the_root_it_was_trained_from(monkeypatch):
    """A resume on other data names the data.root the run was trained from, to resume with: as an override that the
    shell and Hydra read back as that folder."""
    from omegaconf import OmegaConf

    from dit_train.runs import resume_policy

    monkeypatch.setattr(resume_policy, "data_fingerprint", lambda data: {"now": 1})
    monkeypatch.setattr(resume_policy, "describe_fingerprint", lambda f: str(f))
    cfg = OmegaConf.create({"data": {"root": "/data/new"}, "train": {"resume": "auto"}, "run_dir": "/runs/r"})
    saved = "/data/fmnist=1,copy 2 it's ü"
    with pytest.raises(ConfigError) as e:
        resume_policy.check_same_data(cfg, "/runs/r/checkpoints/step_4.dcp", {"then": 1}, saved)
    hint = str(e.value).split("(it was trained from ", 1)[1].split("):", 1)[0]
    assert [OverridesParser.create().parse_override(w).value() for w in shlex.split(hint)] == [saved]


def test_a_list_of_any_strings_reads_back_exactly():
    """hydra.searchpath=[...] of a user's folders: a trailing backslash, fine at the top level, escapes the `,` or
    `]` after it in a list, so each item is checked where it stands."""
    rng = random.Random(1)
    alphabet = "ab/._-=,:[]{}()'\"\\ \t$!`#~*?%@ü\n0"
    lists = [[v] for v in HOSTILE] + [HOSTILE, ["/trailing\\", "pkg://x"]]
    lists += [["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(rng.randint(1, 3))]
              for _ in range(200)]
    for values in lists:
        parsed = OverridesParser.create().parse_override(override_list("hydra.searchpath", values))
        assert parsed.value() == values and not parsed.is_sweep_override(), values
    plain = override_list("hydra.searchpath", ["file:///a/b", "pkg://c.conf"])
    assert plain == "hydra.searchpath=[file:///a/b,pkg://c.conf]"
