"""`python -m dit_train --help` and tab completion as a user meets them: only selectable options, each key with its
one-line doc (subprocesses)."""

import os
import re
import subprocess
import sys

from omegaconf import OmegaConf

from conftest import ROOT, compose
from dit_train.config import load_option

OPTIMIZERS = ["adamw", "mud", "muon", "periodic_rowwise", "rownorm"]


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "dit_train", *args], cwd="/tmp", capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})


def config_part(help_text: str) -> list[str]:
    return help_text.split("== Config ==")[1].split("Powered by Hydra")[0].strip().splitlines()[1:]


def test_help_offers_only_optimizers_and_documents_every_key():
    r = cli("--help", "optimizer=periodic_rowwise")
    assert r.returncode == 0, r.stderr
    assert "optimizer: adamw, mud, muon, periodic_rowwise, rownorm" in r.stdout.splitlines()
    assert "_base" not in r.stdout and "_rownorm_scale" not in r.stdout
    lines = config_part(r.stdout)
    keys = [ln for ln in lines if re.match(r"^ *\w+: \S", ln)]  # keys with a value (not the group nodes)
    assert len(keys) > 100 and all(" # " in ln for ln in keys), [ln for ln in keys if " # " not in ln]
    docs = {ln.split("#")[0].strip(): ln.split("# ", 1)[1] for ln in keys}
    # each key's doc in the schema that declares it (dit_train/config/schema.py, optimizers.py)
    assert docs["grad_clip: 1.0"] == "0 disables clipping (the grad norm is still logged)"
    assert docs["async_checkpoint: auto"] == ("auto (on for CUDA, off on CPU) | true | false: written in the "
                                              "background, training waits only for the copy to host memory "
                                              "(docs/scaling_out.md, Checkpoints)")
    # keys a schema inherits (MatrixConfig's, RowNormScaleKeys')
    assert docs["momentum: 0.95"] == "M <- mu*M + G"
    # declared with the key in its dataclass (dit_train/config/fields.key(doc=))
    assert docs["K: 3"].startswith("refresh period: the first direction when step % K == 0")
    assert docs["rownorm_scale: spectral"].startswith("frobenius: the paper's rule; spectral: scaled toward a cap")
    assert docs["ns_steps: 5"] == "Newton-Schulz iterations"
    assert docs["depth: 6"] == "transformer blocks"  # a model key: its schema's doc, the preset sets the value
    assert "run_dir: ${hydra:runtime.output_dir}" in docs  # '$' reaches the user as written


def test_completion_offers_only_optimizers():
    r = cli("-sc", "query=bash", env={"COMP_LINE": "dit-train optimizer="})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [f"optimizer={o}" for o in OPTIMIZERS]


def test_each_optimizer_composes_as_its_schema_says():
    """Hydra's composition of `optimizer=<name>` (the schema registered with its ConfigStore) is what load_option
    reads, key order included."""
    for name in OPTIMIZERS:
        assert (OmegaConf.to_yaml(compose([f"optimizer={name}"]).optimizer)
                == OmegaConf.to_yaml(load_option("optimizer", name)))
