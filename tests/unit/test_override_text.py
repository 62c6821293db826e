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
from dit_train.config.override_text import override, override_value, parsed_value, shell_override
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
    assert parsed_value(shlex.split(said.rsplit(": ", 1)[1])[0]) == "a,b"
    check_sweep_needs_multirun(["--multirun"], ["run_dir=a,b"])
    check_sweep_needs_multirun([], ["hydra.mode=MULTIRUN", "run_dir=a,b"])
    check_sweep_needs_multirun([], ["run_dir=a\\,b", "optimizer.lr=1e-3"])


def test_a_syntax_error_names_its_argument_and_how_to_write_the_value():
    with pytest.raises(ConfigError) as e:
        parse_overrides(["experiment=debug", "run_dir=/sweep/lr=0.004"])
    said = str(e.value)
    assert said.startswith("run_dir=/sweep/lr=0.004: ") and "\n" not in said
    assert parsed_value(shlex.split(said.rsplit("written ", 1)[1])[0]) == "/sweep/lr=0.004"
