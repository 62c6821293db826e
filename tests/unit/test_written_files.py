"""Files written into folders that may come from elsewhere (a copied run folder, a shared output folder): a symbolic
link planted at a temp name is never written through, and a full disk leaves no partial file."""

import os

import pytest
import torch

from dit_train.evaluation.grids import save_grid, save_image
from dit_train.runs.atomic_io import atomic_write_bytes

VICTIM = b"important, not a PNG"


def plant_links(tmp_path, path):
    """Links from each temp name a writer of `path` used or uses (a fixed `.tmp.png`; `.tmp-<pid>`) to a victim."""
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    for tmp in (f"{path}.tmp.png", f"{path}.tmp-{os.getpid()}"):
        os.symlink(victim, tmp)
    return victim


@pytest.mark.parametrize("writer", ["grid", "image", "bytes"])
def test_a_link_at_a_temp_name_is_not_written_through(tmp_path, writer):
    path = str(tmp_path / "step_00000004.png")
    victim = plant_links(tmp_path, path)
    image = torch.zeros(2, 1, 8, 8)
    {"grid": lambda: save_grid(image, path, nrow=2), "image": lambda: save_image(image[0], path),
     "bytes": lambda: atomic_write_bytes(b"new", path)}[writer]()
    assert victim.read_bytes() == VICTIM
    assert not os.path.islink(path) and open(path, "rb").read(4) in (b"\x89PNG", b"new")


def test_a_full_disk_while_writing_a_grid_leaves_no_partial_file(tmp_path, monkeypatch):
    """dit-sample's grid or images onto a full disk: the error names the PNG, and no `.tmp` file is left."""
    from dit_train.runs import atomic_io

    def full_disk(data, path):
        with open(path, "wb") as f:
            f.write(data[:3])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic_io, "write_synced", full_disk)
    writers = (lambda p: save_grid(torch.zeros(2, 3, 8, 8), p, nrow=2), lambda p: save_image(torch.zeros(3, 8, 8), p))
    for write in writers:
        path = str(tmp_path / "samples.png")
        with pytest.raises(OSError, match="No space left") as e:
            write(path)
        assert e.value.filename == path
        assert os.listdir(tmp_path) == []
