"""Precomputed latent shards (safetensors), as written by dit-encode-latents:
root/<split>/*.safetensors, each holding `latents` [N, C, H, W] and either `labels` [N] (int64) or
`text_emb` [N, L, D] (+ optional `text_mask` [N, L]). Shards are opened lazily (memory-mapped), so the whole
set never has to fit in RAM. Every shard is checked when the set is opened, each fault one line naming the file:
a latent shape other than the configured one, latents that are not floating point, labels that are not integers
or lie outside 0..data.num_classes-1 (label num_classes is the guidance null class, a larger one an IndexError
mid-run), a truncated file. A shard opened later (by a loader worker) must still be the file indexed: a
dit-encode-latents rerun rewrites the shards whose images changed."""

from __future__ import annotations

import bisect
import glob
import os

from safetensors import SafetensorError, safe_open
from torch.utils.data import Dataset

from dit_train.config.latents import LATENTS_INFO, read_latents_info


LABEL_DTYPES = ("I64", "I32", "I16", "I8", "U8")


def shard_name(shard: int) -> str:
    """A split's shard number `shard`, as dit-encode-latents names it."""
    return f"shard_{shard:05d}.safetensors"


def file_identity(path: str):
    """Which file `path` is (size, modification time), None where there is none: a shard written again
    (dit-encode-latents renames a new file over it, or removes it) is another file. Not the inode: FUSE mounts of
    object stores may number a file anew when their cache forgets it."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def open_shard(path: str):
    if not os.path.isfile(path):  # a FIFO would hang the reader
        raise ValueError(f"latent shard {path} is not a regular file (a FIFO, device or folder)")
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as e:
        raise ValueError(f"latent shard {path} is truncated or not a safetensors file ({e}); delete it and rerun "
                         f"dit-encode-latents, which writes the missing shards") from None


def check_labels(path: str, f, count: int, num_classes: int) -> None:
    """One label per latent, an integer in 0..num_classes-1 (any label when num_classes is 0: unconditional)."""
    dtype, shape = f.get_slice("labels").get_dtype(), f.get_slice("labels").get_shape()
    if dtype not in LABEL_DTYPES:
        raise ValueError(f"latent shard {path} has labels of dtype {dtype}, expected integers "
                         f"({', '.join(LABEL_DTYPES)})")
    if list(shape) != [count]:
        raise ValueError(f"latent shard {path} has labels of shape {list(shape)}, expected [{count}] (one per latent)")
    labels = f.get_tensor("labels").long()
    bad = labels[(labels < 0) | (labels >= num_classes)]
    if num_classes and len(bad):
        raise ValueError(f"latent shard {path} has label {int(bad[0])}: data.num_classes={num_classes} allows "
                         f"labels 0..{num_classes - 1} (label {num_classes} is the guidance null class)")


def recorded_split(root: str, split: str) -> dict | None:
    """The split's entry of root's latents_info.json (its shard and latent counts), or None where the folder has no
    record (shards made by other means: every *.safetensors is read, as before)."""
    info = read_latents_info(root)
    entries = [s for s in info.get("splits") or () if isinstance(s, dict) and s.get("split") == split]
    if not entries or not all(isinstance(entries[0].get(k), int) for k in ("shards", "latents")):
        return None
    return entries[0]


def check_recorded_files(folder: str, files: list[str], recorded: dict) -> None:
    """The shards a split holds are exactly those its encoding recorded (shard_00000 .. shard_<shards - 1>): a
    stray file beside them (a copy, another encoding's shard) was read as more data, 356 latents for 256."""
    count = max(recorded["shards"], 0)  # a hand-edited 10^12 is not listed: only the names found are compared
    found = {os.path.basename(p) for p in files}
    extra = sorted(n for n in found if not recorded_name(n, count))
    if extra:
        names = f" ({shard_name(0)} .. {shard_name(count - 1)})" if count else ""
        raise ValueError(f"{os.path.join(folder, extra[0])} is not one of the {count} shard(s) that {LATENTS_INFO} "
                         f"records for {os.path.basename(folder)}{names}: move it out of {folder}")
    if len(found) < count:  # every name found is a recorded one: the first gap is among the first len(found) + 1
        first = next(k for k in range(len(found) + 1) if shard_name(k) not in found)
        raise ValueError(f"{os.path.join(folder, shard_name(first))} is missing ({count - len(found)} of the {count} "
                         f"recorded shards): rerun the dit-encode-latents command that made {os.path.dirname(folder)}, "
                         f"which writes the missing shards")


def recorded_name(name: str, count: int) -> bool:
    """Whether `name` is shard_name(k) of some k < count."""
    number = name[len("shard_"):-len(".safetensors")]
    return number.isdigit() and int(number) < count and shard_name(int(number)) == name


class LatentShards(Dataset):
    def __init__(self, cfg, split: str):
        root = cfg.get("root")
        folder = os.path.join(root or "", split)
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        other = "val" if split == "train" else "train"
        if root and not files and glob.glob(os.path.join(root, other, "*.safetensors")):
            # encoded with --splits train: training refused it naming only the folder, not how to add the split
            raise FileNotFoundError(
                f"data.root={root!r} has {other} latents but no {split} latents ({folder}/*.safetensors): a run "
                f"opens both, even with train.val_every=0; add them by rerunning the dit-encode-latents command that "
                f"made these with --splits {split} instead (every other flag the same; the {other} shards are kept)"
            )
        if not root or not files:
            raise FileNotFoundError(
                f"data.root={root!r}: no latent shards in {folder}/*.safetensors; write them with "
                f"dit-encode-latents (which creates root/train and root/val)"
            )
        recorded = recorded_split(root, split)
        if recorded is not None:
            check_recorded_files(folder, files, recorded)
        expected = (int(cfg.channels), int(cfg.image_size), int(cfg.image_size))
        self.files, self.offsets, total = [], [], 0
        self.identities = []  # each shard as indexed: a shard opened later must still be that file (_shard)
        self.text = None
        for path in files:
            self.identities.append(file_identity(path))
            with open_shard(path) as f:
                keys = set(f.keys())
                if "latents" not in keys:
                    raise ValueError(f"latent shard {path} has no 'latents' tensor (keys: {sorted(keys)})")
                shape = tuple(f.get_slice("latents").get_shape())
                if tuple(shape[1:]) != expected:
                    raise ValueError(
                        f"latent shard {path} has latents of shape {list(shape[1:])} per item, expected "
                        f"{list(expected)} (data.channels, data.image_size, data.image_size)"
                    )
                dtype = f.get_slice("latents").get_dtype()
                if not dtype.startswith(("F", "BF")):  # an integer latent trains as noise of the wrong scale
                    raise ValueError(f"latent shard {path} has latents of dtype {dtype}, expected floating point "
                                     f"(F16, BF16, F32)")
                has_text = "text_emb" in keys
                if "labels" not in keys and not has_text:
                    raise ValueError(f"latent shard {path} has neither 'labels' nor 'text_emb'")
                if not has_text:
                    check_labels(path, f, shape[0], cfg.num_classes)
                if self.text is None:
                    self.text = has_text
                elif self.text != has_text:
                    raise ValueError(f"latent shard {path} mixes text and label conditioning with earlier shards")
            self.files.append(path)
            self.offsets.append(total)
            total += shape[0]
        if recorded is not None and total != recorded["latents"]:
            raise ValueError(f"{folder} holds {total} latents; {os.path.join(root, LATENTS_INFO)} records "
                             f"{recorded['latents']}: a shard was replaced or altered since it was encoded; rerun "
                             f"dit-encode-latents into a new folder")
        self.total = total
        self.num_classes = cfg.num_classes
        self.dataset_id = f"latents:{os.path.abspath(folder)}:{total}"
        lists = (recorded or {}).get("shard_image_lists")  # which images each shard holds (dit-encode-latents)
        self.shard_image_lists = lists if isinstance(lists, list) and len(lists) == len(files) else None
        stats = (recorded or {}).get("shard_image_stats")  # their images' sizes and times when last encoded
        self.shard_image_stats = stats if isinstance(stats, list) and len(stats) == len(files) else None
        self._handles: dict[int, object] = {}

    def __len__(self) -> int:
        return self.total

    def content_index(self):
        """What identifies this split's data wherever it lives (data/datasets.py: data_fingerprint): each shard's
        name, item count and size in bytes (the shards themselves are not read), and which images it holds where
        latents_info.json records it (a shard encoded again after an image was removed has the same size), and the
        sizes and modification times its images had when it was encoded, where recorded (a shard encoded again after
        an image was rewritten in place has the same images and size; an image touched since, not encoded again,
        leaves it as it was)."""
        counts = [b - a for a, b in zip(self.offsets, self.offsets[1:] + [self.total])]
        lists = [f"\t{h}" for h in self.shard_image_lists] if self.shard_image_lists else [""] * len(self.files)
        if self.shard_image_lists and self.shard_image_stats:
            lists = [f"{h}\t{st}" for h, st in zip(lists, self.shard_image_stats)]
        return ["".join(f"{os.path.basename(p)}\t{n}\t{os.path.getsize(p)}{h}\n"
                        for p, n, h in zip(self.files, counts, lists)).encode()]

    def _shard(self, k: int):
        if k not in self._handles:  # opened per process (DataLoader workers included), kept open
            path = self.files[k]
            if file_identity(path) != self.identities[k]:  # a rerun of dit-encode-latents after the images changed
                raise ValueError(f"latent shard {path} changed since this process indexed {os.path.dirname(path)} "
                                 f"(dit-encode-latents encoded it again?): its latents are not those at the indices "
                                 f"this run reads; restart the run (a resume is told whether its data changed)")
            self._handles[k] = safe_open(path, framework="pt")
        return self._handles[k]

    def __getitem__(self, i):
        k = bisect.bisect_right(self.offsets, i) - 1
        f, j = self._shard(k), i - self.offsets[k]
        x = f.get_slice("latents")[j : j + 1][0].float()
        if not self.text:
            return x, int(f.get_slice("labels")[j : j + 1][0])
        cond = {"context": f.get_slice("text_emb")[j : j + 1][0].float()}
        keys = f.keys()
        if "text_mask" in keys:
            cond["context_mask"] = f.get_slice("text_mask")[j : j + 1][0].bool()
        return x, cond

    def __getstate__(self):  # safetensors handles do not pickle; workers reopen them
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state
