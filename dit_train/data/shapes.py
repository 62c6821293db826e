"""What a dataset's files say about the tensors it yields: channels, image size and class count, read before any
model is built so that a latent or image-folder run needs no hand-written shape overrides (#28 item 2).

read_data_shapes(data) returns, per data key, the value the files hold and where it was read; a key the files do
not decide (synthetic data, an image folder of mixed sizes) is absent. Fashion-MNIST's are fixed: 1 channel and 10
classes (its side is padded to data.image_size, a choice). Missing or
unreadable files are left to the checks that name them (dit_train.config.validate, the datasets themselves):
here they only mean that nothing can be read."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from dit_train.config.latents import read_latents_info


@dataclass(frozen=True)
class Found:
    value: int
    source: str  # where it was read, for the start-up log and errors
    # only a suggestion: a value set on the command line wins (an image folder is resized to any data.image_size; a
    # class count guessed from the largest label yields to the user's, against which the dataset checks the labels)
    suggested: bool = False


SHAPES_FROM_FILES = ("latents", "image_folder")  # the data whose files decide shapes (read_data_shapes)
FASHION_MNIST = {"channels": 1, "num_classes": 10}  # grayscale, ten classes of clothing


def read_data_shapes(data: dict) -> dict[str, Found]:
    """{data key: Found} for data.channels, data.image_size and data.num_classes, as far as the files decide them."""
    if data.get("name") == "latents":
        return latent_shapes(data.get("root"))
    if data.get("name") == "image_folder":
        return image_folder_shapes(data.get("root"))
    if data.get("name") == "fashion_mnist":
        return {"channels": Found(FASHION_MNIST["channels"], "Fashion-MNIST images are grayscale"),
                "num_classes": Found(FASHION_MNIST["num_classes"],
                                     f"Fashion-MNIST has {FASHION_MNIST['num_classes']} classes")}
    return {}


def latent_shapes(root) -> dict[str, Found]:
    from dit_train.data.latents import open_shard

    train = sorted(glob.glob(os.path.join(str(root), "train", "*.safetensors"))) if root else []
    if not train:
        return {}
    with open_shard(train[0]) as f:
        if "latents" not in f.keys():
            return {}  # LatentShards names the shard
        shape = list(f.get_slice("latents").get_shape())
        text = "text_emb" in f.keys()
    if len(shape) != 4 or shape[2] != shape[3]:
        raise ValueError(f"latent shard {train[0]} has latents of shape {shape}, expected [N, C, H, W] with H = W "
                         f"(the DiT takes square inputs)")
    where = f"{train[0]}: latents [N, {shape[1]}, {shape[2]}, {shape[3]}]"
    found = {"channels": Found(shape[1], where), "image_size": Found(shape[2], where)}
    if not text:
        found["num_classes"] = latent_class_count(str(root))
    return found


def latent_class_count(root: str) -> Found:
    """The class count recorded by dit-encode-latents (latents_info.json: an image folder's class folders, named in
    the start-up line as an image-folder run names them, or the source's count), else the largest label in the
    shards plus one."""
    info = read_latents_info(root)
    source, names = info.get("source") or {}, info.get("class_names")  # names: an image folder's, since 2026-12-03
    if isinstance(names, list) and names and all(isinstance(n, str) for n in names):
        return Found(len(names), f"{os.path.join(root, 'latents_info.json')}: {len(names)} class folders, "
                                 f"{label_names(names)}")
    if isinstance(source.get("num_classes"), int) and source["num_classes"] > 0:
        return Found(source["num_classes"], f"{os.path.join(root, 'latents_info.json')}: source "
                                            f"{source.get('name', '?')} with {source['num_classes']} classes")
    from dit_train.data.latents import LABEL_DTYPES, open_shard

    top = -1
    for path in sorted(glob.glob(os.path.join(root, "*", "*.safetensors"))):
        with open_shard(path) as f:
            if "labels" in f.keys() and f.get_slice("labels").get_dtype() in LABEL_DTYPES:
                labels = f.get_tensor("labels")
                if labels.numel():
                    top = max(top, int(labels.max()))
    return Found(top + 1, f"{root}: largest label {top} in the shards", suggested=True)


def label_names(classes: list[str], shown: int = 8) -> str:
    """'labels 0=cat 1=dog 2=fox': which folder each label is (dit-sample --classes takes labels), which no output
    said; of many classes the first few and the last."""
    pairs = [f"{i}={name}" for i, name in enumerate(classes)]
    return "labels " + " ".join(pairs if len(pairs) <= shown else [*pairs[:shown - 2], "...", pairs[-1]])


def image_folder_shapes(root) -> dict[str, Found]:
    from dit_train.data.image_folder import class_folders, first_image_sizes, split_folder

    if not root or not os.path.isdir(str(root)):
        return {}
    folder = split_folder(str(root), "train")
    classes = class_folders(folder)
    if not classes:
        return {}
    found = {"channels": Found(3, f"{root}: images are read as RGB"),
             "num_classes": Found(len(classes), f"{folder}: {len(classes)} class folders, {label_names(classes)}")}
    sizes = set(first_image_sizes(folder, classes))
    if len(sizes) == 1 and len({*next(iter(sizes))}) == 1:  # one square size: a set prepared at its resolution
        side = next(iter(sizes))[0]
        found["image_size"] = Found(side, f"{folder}: {side}x{side} images", suggested=True)
    return found  # mixed or non-square sizes: resized to the preset's data.image_size


def with_data_shapes(data: dict, given) -> tuple[dict, list[str]]:
    """`data` with the shapes its files decide, as the trainer takes them (config/data_shapes.py), for the tools
    that read a dataset outside a run (dit-reference-stats, dit-encode-latents --data): the keys in `given` (the
    user's KEY=VALUE overrides) are kept. Returns the new dict and 'data.key=value (where)' for each key taken. An
    image folder of 32 px images was read at the preset's 64 px: reference statistics no run of it compares with."""
    found = read_data_shapes(data)
    taken = [f"data.{k}={f.value} ({f.source})" for k, f in found.items() if k not in given and data.get(k) != f.value]
    return {**data, **{k: f.value for k, f in found.items() if k not in given}}, taken
