"""Which parameters get the matrix update and which get AdamW (docs/algorithms.md §4), for any nn.Module.

Default rule: a trainable parameter is a *matrix* parameter iff it is 2-D, it is not an embedding table
(nn.Embedding, nn.EmbeddingBag) and its name does not match one of the input/output-layer patterns. That is every
nn.Linear weight, and, by shape as torch.optim.Muon's and moonlight's users route them, every other 2-D parameter
(nn.MultiheadAttention's in_proj_weight, hand-written weights): the printed table names those. Everything else
(biases, norms, embedding tables, patch embedders, the final projection, positional tables, convolution weights)
goes to AdamW. Convolution weights are not flattened to [out, in*kh*kw]: the table says so; `matrix_patterns`
cannot force them (only 2-D parameters take the matrix update).

Overrides come from the optimizer config:
- `matrix_patterns`: names forced to the matrix update (must be 2-D), checked first;
- `adamw_patterns`: names forced to AdamW; replaces DEFAULT_ADAMW_PATTERNS when given.

A pattern is a dotted name fragment that must match whole consecutive components of the parameter name, each
component an fnmatch glob: "final_layer.linear" matches "final_layer.linear.weight" but not
"final_layer.linear2.weight"; "blocks.*.attn.qkv" matches every block's qkv; "proj_out" matches diffusers'
"proj_out.weight" but not "proj_out_1.weight".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Iterable, Sequence

from torch import nn

# Input layers, output layers and embedding tables, by the names used in our DiT, diffusers (DiT, PixArt, SD3,
# Flux) and common transformer code. Embedding modules and convolutions are excluded by type anyway.
DEFAULT_ADAMW_PATTERNS: tuple[str, ...] = (
    "x_embedder",  # our DiT: patch embedder (Linear on flattened patches)
    "patch_embed",
    "pos_embed",  # diffusers PatchEmbed (patchify conv) and positional tables
    "proj_in",  # diffusers input projection
    "context_embedder",  # text-embedding input projection (ours, SD3, Flux)
    "text_embedder.linear_1",  # SD3/PixArt pooled-text input projection
    "y_embedder",
    "class_embedder",
    "embedding",
    "embed_tokens",
    "final_layer.linear",  # our DiT: final projection to patches
    "proj_out",  # diffusers final projection (SD3, PixArt)
    "proj_out_2",  # diffusers DiTTransformer2DModel final projection (proj_out_1 is its adaLN modulation)
    "lm_head",
)

CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)

MATRIX = "matrix"
ADAMW = "adamw"


def _components(name: str) -> list[str]:
    return [c for c in name.split(".") if c]


def name_matches(name: str, pattern: str) -> bool:
    """True if the pattern's components (fnmatch globs) match consecutive components of the dotted name."""
    parts, pat = _components(name), _components(pattern)
    if not pat:
        return False
    for start in range(len(parts) - len(pat) + 1):
        if all(fnmatchcase(parts[start + i], p) for i, p in enumerate(pat)):
            return True
    return False


def _first_match(name: str, patterns: Iterable[str]) -> str | None:
    for p in patterns:
        if name_matches(name, p):
            return p
    return None


# reasons the summary table names parameters for, so that neither rule is silent
BY_SHAPE = "2-D, not an nn.Linear weight: by shape"
CONVOLUTION = "convolution weight: not flattened, the matrix update takes 2-D weights"
# The table's last line, for Python callers; the trainer, whose user has a command line, names the dry run instead.
PER_TENSOR_HINT = "per tensor: optimizer.routing.table()"


@dataclass
class Routing:
    """Parameters by group, in model order: (name, parameter) pairs, and why each went where it did."""

    matrix: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    adamw: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)

    def table(self) -> str:
        """One markdown row per trainable parameter, in model order: name, shape, group, why."""
        group = {name: MATRIX for name, _ in self.matrix} | {name: ADAMW for name, _ in self.adamw}
        shapes = {name: tuple(p.shape) for name, p in self.matrix + self.adamw}
        lines = ["| parameter | shape | group | why |", "| --- | --- | --- | --- |"]
        lines += [f"| {name} | {shapes[name]} | {group[name]} | {why} |" for name, why in self.reasons.items()]
        return "\n".join(lines)

    def group_of(self, name: str) -> str:
        if any(n == name for n, _ in self.matrix):
            return MATRIX
        if any(n == name for n, _ in self.adamw):
            return ADAMW
        raise KeyError(f"{name!r} is not a trainable parameter of the routed model")


def route_parameters(
    model: nn.Module,
    matrix_patterns: Sequence[str] | None = None,
    adamw_patterns: Sequence[str] | None = None,
    matrix_update: bool = True,
) -> Routing:
    """Split the trainable parameters of `model` into the matrix group and the AdamW group.

    matrix_update=False sends everything to AdamW (the AdamW baseline), still reporting the routing. Parameters
    shared between modules appear once (named_parameters deduplicates). Works on the meta device."""
    matrix_patterns = list(matrix_patterns or ())
    adamw_patterns = list(DEFAULT_ADAMW_PATTERNS if adamw_patterns is None else adamw_patterns)
    for key, pats in (("matrix_patterns", matrix_patterns), ("adamw_patterns", adamw_patterns)):
        bad = [p for p in pats if not isinstance(p, str) or not p.strip(".")]
        if bad:
            raise ValueError(f"optimizer.{key} must be a list of dotted name patterns (strings), got {bad!r}")
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    tables = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    convolutions = {id(m.weight) for m in model.modules() if isinstance(m, CONVOLUTIONS)}
    routing = Routing()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        group, why = ADAMW, ""
        forced = _first_match(name, matrix_patterns) if matrix_update else None
        if forced is not None:
            if p.ndim != 2:
                raise ValueError(
                    f"optimizer.matrix_patterns entry {forced!r} matches {name!r} of shape {tuple(p.shape)}; "
                    f"only 2-D parameters can take the matrix update")
            group, why = MATRIX, f"matrix_patterns {forced!r}"
        elif not matrix_update:
            why = "AdamW for every parameter"
        elif (hit := _first_match(name, adamw_patterns)) is not None:
            why = f"adamw_patterns {hit!r}"
        elif id(p) in tables:
            why = "embedding table"
        elif id(p) in convolutions:
            why = f"{p.ndim}-D {CONVOLUTION}"
        elif p.ndim == 2:
            group, why = MATRIX, "2-D nn.Linear weight" if id(p) in linear_weights else BY_SHAPE
        else:
            why = f"{p.ndim}-D"
        (routing.matrix if group == MATRIX else routing.adamw).append((name, p))
        routing.reasons[name] = why
    return routing


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _some(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def format_routing_table(routing: Routing) -> str:
    """A markdown table: group, number of tensors, number of parameters (and the share of parameters); then a note
    naming the 2-D parameters routed by shape and the convolution weights left on AdamW, if any."""
    rows = [(MATRIX, routing.matrix), (ADAMW, routing.adamw)]
    total = sum(p.numel() for _, ps in rows for _, p in ps) or 1
    lines = ["| group | tensors | params | share |", "| --- | ---: | ---: | ---: |"]
    for group, ps in rows:
        n = sum(p.numel() for _, p in ps)
        lines.append(f"| {group} | {len(ps)} | {n:,} ({_count(n)}) | {100 * n / total:.1f}% |")
    by_shape = [name for name, why in routing.reasons.items() if why == BY_SHAPE]
    convs = [name for name, why in routing.reasons.items() if why.endswith(CONVOLUTION)]
    if by_shape:
        lines.append(f"note: 2-D parameters outside nn.Linear take the matrix update by shape ({len(by_shape)}): "
                     f"{_some(by_shape)}; optimizer.adamw_patterns keeps them on AdamW")
    if convs:
        lines.append(f"note: convolution weights take AdamW, not flattened to [out, in*kh*kw] ({len(convs)}): "
                     f"{_some(convs)}")
    lines.append(PER_TENSOR_HINT)
    return "\n".join(lines)
