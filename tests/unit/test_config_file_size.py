"""Every config or record file read from a folder a user may have received (a VAE, DINOv2 or exported model
folder, a run folder's saved config and train state, study records, fd_results.json, a primary config given to
Hydra) is bounded before it is read: a huge config.json was read whole by the JSON parser (or by transformers /
diffusers). Each is one line naming the file, its size and the limit; the file is never opened."""

import builtins
import json

import pytest

from dit_train.runs.json_file import MAX_BYTES

SIZE = MAX_BYTES + (1 << 20)


def huge(path):
    """A sparse file over the limit (no disk used): its bytes are never meant to be read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(SIZE)
    return path


def train_state(tmp_path):
    from dit_train.runs.checkpoint import read_train_state

    huge(tmp_path / "step_00000003.dcp" / "train_state.json")
    return lambda: read_train_state(str(tmp_path / "step_00000003.dcp")), "step_00000003.dcp/train_state.json"


def exported_model(tmp_path):
    from dit_train.model.dit import DiT

    huge(tmp_path / "m" / "config.json")
    return lambda: DiT.from_pretrained(str(tmp_path / "m")), "m/config.json"


def vae_folder(tmp_path):
    from dit_train.diffusion.vae_shapes import check_vae_folder

    huge(tmp_path / "vae" / "config.json")
    (tmp_path / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    return lambda: check_vae_folder(str(tmp_path / "vae")), "vae/config.json"


def pipeline_index(tmp_path):
    pytest.importorskip("diffusers")
    from dit_train.diffusers_pipeline import DiTTrainPipeline

    huge(tmp_path / "export" / "model_index.json")
    return lambda: DiTTrainPipeline.from_pretrained(str(tmp_path / "export")), "export/model_index.json"


def scheduler_config(tmp_path):
    pytest.importorskip("diffusers")
    from dit_train.diffusers_pipeline import DiTTrainPipeline

    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "model_index.json").write_text(json.dumps({
        "_class_name": "DiTTrainPipeline",
        "transformer": ["dit_train.diffusers_pipeline", "DiTTrainTransformer2DModel"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "vae": [None, None]}))
    huge(tmp_path / "export" / "scheduler" / "scheduler_config.json")
    return lambda: DiTTrainPipeline.from_pretrained(str(tmp_path / "export")), "export/scheduler/scheduler_config.json"


def dinov2_folder(tmp_path):
    from dit_train.evaluation.fd.features import build_extractor

    huge(tmp_path / "dino" / "config.json")
    (tmp_path / "dino" / "model.safetensors").write_bytes(b"")
    return lambda: build_extractor("dinov2", tmp_path / "dino"), "dino/config.json"


def latents_info(tmp_path):
    from dit_train.config.latents import read_latents_info

    huge(tmp_path / "latents" / "latents_info.json")
    return lambda: read_latents_info(str(tmp_path / "latents")), "latents/latents_info.json"


def run_config_yaml(tmp_path):
    from dit_train.study.report import read_run

    huge(tmp_path / "run" / "config.yaml")

    def status():  # dit-report shows a run it cannot read as damaged, with the reason
        raise ValueError(read_run(str(tmp_path / "run"), "run").status)
    return status, "run/config.yaml"


def study_record(tmp_path):
    from dit_train.study.record import read_study

    huge(tmp_path / "sweep" / "study.json")
    return lambda: read_study(str(tmp_path / "sweep" / "study.json")), "sweep/study.json"


def fd_results(tmp_path):
    from dit_train.evaluation.fd.job import load_results

    huge(tmp_path / "run" / "fd_results.json")
    return lambda: load_results(tmp_path / "run"), "run/fd_results.json"


def primary_config(tmp_path):
    from dit_train.config import check_command_line

    huge(tmp_path / "conf" / "mine.yaml")

    def check():
        try:
            check_command_line(["--config-dir", str(tmp_path / "conf"), "--config-name", "mine"])
        except SystemExit as stop:
            raise ValueError(f"exit {stop.code}") from None
    return check, "conf/mine.yaml"


@pytest.mark.parametrize("reader", [train_state, exported_model, vae_folder, pipeline_index, scheduler_config,
                                    dinov2_folder, latents_info, run_config_yaml, study_record, fd_results,
                                    primary_config])
def test_a_huge_config_file_is_refused_unread_in_one_line(tmp_path, reader, monkeypatch, capsys):
    read, name = reader(tmp_path)
    opened = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda file, *a, **k: opened.append(str(file)) or real_open(file, *a, **k))
    with pytest.raises(ValueError) as e:
        read()
    said = capsys.readouterr().err.strip() if str(e.value) == "exit 2" else str(e.value)
    whole = f"{tmp_path / name} is {SIZE:,} bytes, more than the {MAX_BYTES:,}-byte limit of a config or record file"
    # dit-report's status of a damaged run names the file within its run folder (the row names the run)
    shown = whole.replace(f"{tmp_path / 'run'}/", "") if reader is run_config_yaml else whole
    assert shown in said and "\n" not in said, said
    assert str(tmp_path / name) not in opened
