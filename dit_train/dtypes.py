"""The one declaration of how a dtype is spelled in a config key or a command's flag: bf16, fp16, fp32, fp64.
Each key or flag takes a subset of these, in this order, and refuses every other spelling (torch's 'bfloat16',
'torch.bfloat16', 'BF16') in one line naming its subset, before any work: one run's config reads like another's,
and a resume compares like with like. torch is imported only when a name is turned into a dtype, so that the
config check stays fast."""

from __future__ import annotations

TORCH_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
DTYPE_NAMES = tuple(TORCH_NAMES)


def dtype_choices(*names: str) -> tuple[str, ...]:
    """The subset `names` of DTYPE_NAMES in the declared order (what a key's refusal lists)."""
    unknown = set(names) - set(DTYPE_NAMES)
    if unknown:
        raise ValueError(f"not dtype names: {sorted(unknown)}; the names are {', '.join(DTYPE_NAMES)}")
    return tuple(n for n in DTYPE_NAMES if n in names)


def torch_dtype(name: str):
    """torch.bfloat16 for 'bf16', ..."""
    import torch

    return getattr(torch, TORCH_NAMES[name])


def torch_dtypes(*names: str) -> dict:
    """{name: torch dtype} of the subset `names`, in the declared order."""
    return {n: torch_dtype(n) for n in dtype_choices(*names)}
