"""What latents_info.json records of an encoding, and what a rerun into the same --out may do with the shards
there (dit-encode-latents): continue them (the same VAE, --flip, --shard-size and source settings), encode again
only the shards whose images changed (each shard's image list is recorded, and a hash of its image files' sizes
and modification times: an image rewritten in place under the same name), or refuse in one line before anything
is written or removed."""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os

from dit_train.config.latents import LATENTS_INFO, vae_files, vae_scaling
from dit_train.data.latents import recorded_name, shard_name


def image_list(ds, start: int, stop: int, base: str | None = None) -> str:
    """Which images items start..stop-1 of the split are: an image folder's files (relative to `base`, else as
    listed: absolute for --images) and labels in order, else the dataset id (a file added, removed or renamed
    shifts every later shard's contents)."""
    items = getattr(ds, "samples", None)
    text = "".join(f"{p if base is None else os.path.relpath(p, base)}\t{y}\n" for p, y in items[start:stop]) \
        if items is not None else \
        f"{ds.dataset_id}:{stop}" if start == 0 else f"{ds.dataset_id}:{start}:{stop}"
    return hashlib.sha256(os.fsencode(text)).hexdigest()[:16]  # a file name not in UTF-8: its bytes (str.encode raised)


def file_stats(ds, n: int) -> list[str] | None:
    """Each of the split's first n image files as one stat says it is ('size\tmtime_ns'), None for a dataset that
    is not a list of files (Fashion-MNIST's idx files). Taken when the record is built, before any image is read
    for encoding: an image rewritten after its stat shows as a difference on the next rerun, which encodes its
    shard again (one stat per image and run: the rerun compares these with the recorded ones, per shard)."""
    items = getattr(ds, "samples", None)
    if items is None:
        return None
    stats = []
    for path, _ in items[:n]:
        try:
            st = os.stat(path)
            stats.append(f"{st.st_size}\t{st.st_mtime_ns}\n")
        except OSError:  # gone since it was listed: its read for encoding names it
            stats.append("-\n")
    return stats


def stats_hash(stats: list[str], start: int, stop: int) -> str:
    return hashlib.sha256("".join(stats[start:stop]).encode()).hexdigest()[:16]


def encoding_record(args, source: dict, datasets: dict) -> dict:
    """latents_info.json: everything the shards' contents depend on (batch size aside: it only groups the work);
    each shard's image list too, so that a rerun after images changed encodes again only the shards they touch.
    The split's list names the files as listed (older records compare it; a moved folder is another source root
    anyway), each shard's relative to the source's root (train/a/0.png): a latent set's data fingerprint includes
    them, and the same images encoded from a copy of the folder elsewhere are the same data. Of an image folder,
    each shard's images' sizes and modification times too (`shard_image_stats`, a hash per shard): a rerun encodes
    again a shard whose images were rewritten in place, and the data fingerprint changes with it (a copy of the
    images elsewhere is the same data where the copy keeps the modification times: cp -p, rsync -a)."""
    size = args.shard_size
    splits = []
    for split, (ds, n) in datasets.items():
        bounds = [(k * size, min((k + 1) * size, n)) for k in range(math.ceil(n / size))]
        entry = {"split": split, "images": n, "latents": n * (2 if args.flip else 1), "shards": len(bounds),
                 "image_list": image_list(ds, 0, n),
                 "shard_image_lists": [image_list(ds, a, b, source.get("root")) for a, b in bounds]}
        stats = file_stats(ds, n)
        if stats is not None:
            entry["shard_image_stats"] = [stats_hash(stats, a, b) for a, b in bounds]
        splits.append(entry)
    scale, shift = vae_scaling(args.vae)
    # which folder each label is, for the trainer's start-up line (an image folder's; the image lists cover them)
    classes = next((list(ds.classes) for ds, _ in datasets.values() if getattr(ds, "classes", None)), None)
    return {"vae": os.path.abspath(args.vae), "vae_files": vae_files(args.vae), "scaling_factor": scale,
            "shift_factor": shift, "flip": bool(args.flip), "shard_size": args.shard_size, "source": source,
            "splits": splits, "class_names": classes, "complete": False}


# recorded for the reader, not a setting the shards depend on: a record without it (an older encoder's) continues
INFORMATIONAL = ("class_names",)


def binding_record(old: dict, out: str) -> dict:
    """The record a rerun into `out` is held to: `old`, or {} where no shard lies beside it (a refused or stopped
    encoding that wrote no shard binds nothing: a rerun may change the settings, and none of that record is kept)."""
    return old if glob.glob(os.path.join(out, "*", "shard_*.safetensors")) else {}


def resume_conflict(old: dict, new: dict, out: str) -> str | None:
    """Why the shards in `out` (recorded in `old`) cannot be continued by this run (`new`), and what to do; None:
    they can."""
    old = binding_record(old, out)
    if not old:
        if glob.glob(os.path.join(out, "*", "shard_*.safetensors")):
            return f"{out} holds latent shards but no {LATENTS_INFO} that says how they were made; choose another --out"
        return None
    missing = [k for k in new if k not in old and k not in INFORMATIONAL]
    if missing:
        return (f"{out}/{LATENTS_INFO} does not record {', '.join(missing)} (an older dit-encode-latents wrote it); "
                f"choose another --out")
    damaged = damaged_record(old)
    if damaged:  # a hand-edited record: its shard lists decide which shards are removed and encoded again
        return f"{out}/{LATENTS_INFO} is not as dit-encode-latents writes it ({damaged}); choose another --out"
    differs = settings_conflict(old, new, out)
    return differs and f"{differs}; rerun with the settings in {out}/{LATENTS_INFO}, or choose another --out"


def damaged_record(old: dict) -> str | None:
    """What is wrong with a record's source (an object of settings) and `splits` (a list of one entry per split:
    its name, counts, image list and, from encoders that record them, one image list per shard), or None."""
    if not isinstance(old["source"], dict):  # settings_conflict reads its keys
        return f"source is a {type(old['source']).__name__}, not an object"
    splits = old["splits"]
    if not isinstance(splits, list):
        return f"splits is a {type(splits).__name__}, not a list"
    seen = set()
    for s in splits:
        if not (isinstance(s, dict) and isinstance(s.get("split"), str) and isinstance(s.get("images"), int)
                and isinstance(s.get("shards"), int) and isinstance(s.get("image_list"), str)):
            return f"a split entry {json.dumps(s)[:80]} lacks its split name, counts or image list"
        if s["split"] not in ("train", "val"):  # the encoder would list out/<split>: '../x' is outside --out
            return f"a split entry named {s['split'][:40]!r} (dit-encode-latents writes train and val)"
        if s["split"] in seen:  # the encoder read the last entry, the trainer the first
            return f"two entries for split {s['split'][:40]}"
        seen.add(s["split"])
        for key, what in (("shard_image_lists", "image lists"), ("shard_image_stats", "hashes of image stats")):
            lists = s.get(key)  # (a count of 10^20 shards is not a list of 10^20 lists to compare)
            if lists is not None and not (isinstance(lists, list) and len(lists) == s["shards"]
                                          and all(isinstance(h, str) for h in lists)):
                return f"{s['split']}'s {key} is not {s['shards']} {what}, one per shard"
        if "shard_image_stats" in s and "shard_image_lists" not in s:  # the stats are compared beside the lists only:
            return (f"{s['split']} records its images' stats (shard_image_stats) but not their lists "  # an image
                    f"(shard_image_lists), which dit-encode-latents writes with them")  # rewritten kept a stale latent
    return None


def settings_conflict(old: dict, new: dict, out: str) -> str | None:
    """The first setting of this run that differs from the one the shards were made with; None: none does."""
    if (old["vae_files"], old["scaling_factor"], old["shift_factor"]) != \
            (new["vae_files"], new["scaling_factor"], new["shift_factor"]):
        return f"{out} holds latents made with another VAE ({old['vae']}), not --vae {new['vae']}"
    if old["flip"] != new["flip"]:
        return f"{out} holds latents made {'with' if old['flip'] else 'without'} --flip"
    if old["shard_size"] != new["shard_size"]:
        return f"{out} holds latents made with --shard-size {old['shard_size']}, not {new['shard_size']}"
    for key in sorted(set(old["source"]) | set(new["source"])):
        if old["source"].get(key) != new["source"].get(key):
            return (f"{out} holds latents made from source {key}={old['source'].get(key)!r}, not "
                    f"{new['source'].get(key)!r} (--images/--data/--data-set/--image-size)")
    recorded = {s["split"]: s for s in old["splits"]}
    for s in new["splits"]:
        then = recorded.get(s["split"], s)
        if "shard_image_lists" in then:  # the shards whose images changed are encoded again (changed_shards)
            continue
        if (then["images"], then["image_list"]) != (s["images"], s["image_list"]):
            return (f"{out} holds {s['split']} latents of {then['images']} images, now {s['images']} images or "
                    f"other files (--limit, or images added, removed or renamed)")
    return None


def changed_shards(old: dict, new: dict, out: str) -> dict[str, list[str]]:
    """Per split, the shard files in `out` whose images are not those the new record lists for them (a file added,
    removed or renamed, --limit changed, or rewritten in place: its size or modification time is not the one
    recorded, where the record has them): shards of other images, and shards past the new count (the trainer
    refuses a shard its record does not list). The other shards keep their latents."""
    recorded = {s["split"]: s for s in old.get("splits") or ()}
    changed = {}
    for s in new["splits"]:
        entry = recorded.get(s["split"], {})
        then = entry.get("shard_image_lists")
        if then is None:
            continue
        lists = zip(then, s["shard_image_lists"])
        then_stats, now_stats = entry.get("shard_image_stats"), s.get("shard_image_stats")
        stats = zip(then_stats, now_stats) if then_stats is not None and now_stats is not None else \
            ((None, None) for _ in then)  # an older record's: in-place changes are not seen (keep_record_format)
        same = [a == b and c == d for (a, b), (c, d) in zip(lists, stats)]
        if then == s["shard_image_lists"] and all(same):
            continue
        keep = {shard_name(k) for k, kept in enumerate(same) if kept}
        paths = sorted(glob.glob(os.path.join(out, s["split"], "shard_*.safetensors")))
        changed[s["split"]] = [p for p in paths if os.path.basename(p) not in keep]
    return changed


def keep_record_format(old: dict, new: dict, out: str) -> list[str]:
    """A split whose shards an older encoder recorded without per-shard image lists, or without their images'
    sizes and modification times (shard_image_stats), stays so: they are not known for its shards, and adding
    them to its record would change the data fingerprint of runs trained on it (a resume of them refused as
    'other data' after a rerun that encoded nothing). Returns the splits whose images' stats are not recorded
    (an image rewritten in place is not seen there)."""
    recorded = {s["split"]: s for s in old.get("splits") or ()}
    unseen = []
    for s in new["splits"]:
        then = recorded.get(s["split"])
        if then is not None and glob.glob(os.path.join(out, s["split"], "shard_*.safetensors")):
            if "shard_image_lists" not in then:
                del s["shard_image_lists"]
            if "shard_image_stats" not in then and "shard_image_stats" in s:
                del s["shard_image_stats"]
                unseen.append(s["split"])
    return unseen


def forget_changed_shards(changed: dict[str, list[str]], out: str, new: dict) -> None:
    """Remove the shards of images that changed, before the new record is written: a shard on disk always holds
    the images the record on disk lists for it, wherever a rerun is interrupted. Said in one line per split:
    how many are encoded again, and how many (past a lower count) are only removed."""
    counts = {s["split"]: s["shards"] for s in new["splits"]}
    for split, paths in changed.items():
        if paths:
            listed = {shard_name(k) for k in range(counts[split])}
            again = sum(os.path.basename(p) in listed for p in paths)
            past = f"; {len(paths) - again} past the new count are removed" if len(paths) > again else ""
            print(f"the images of {len(paths)} {split} shard(s) in {out} changed since they were encoded (--limit, or "
                  f"images added, removed, renamed or rewritten): {again} are encoded again{past} "
                  f"({os.path.basename(paths[0])} on)", flush=True)
        for path in paths:
            os.remove(path)


def split_written(out: str, entry: dict) -> bool:
    """Whether every shard a recorded split `entry` lists is in `out` (by name: a rerun of that split checks that
    each opens whole): a split kept from an earlier encoding that stopped leaves the record incomplete."""
    names = {os.path.basename(p) for p in glob.glob(os.path.join(out, entry["split"], "shard_*.safetensors"))}
    return sum(recorded_name(n, entry["shards"]) for n in names) == entry["shards"]
