"""The Diffusion Transformer: patchify -> N adaLN-Zero blocks -> unpatchify.

Follows DiT (Peebles & Xie): per-block adaLN-Zero modulation from the timestep + class embedding, 2-D sin-cos
positions, a null class for classifier-free guidance. Options: qk-norm, SwiGLU MLP, and cross-attention to
precomputed text embeddings. Presets live in conf/model/*.yaml; `DiTConfig` holds the same fields.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from dit_train.model.init import ONES, ZEROS, Rule, init_parameters, xavier_uniform


@dataclass
class DiTConfig:
    image_size: int = 32  # spatial size of the model input (pixels, or latent size for latent presets)
    in_channels: int = 1
    patch_size: int = 2
    hidden_size: int = 256
    depth: int = 6
    num_heads: int = 4
    mlp_ratio: float = 4.0
    num_classes: int = 10  # 0 disables class conditioning; the null class is index num_classes
    class_dropout_prob: float = 0.1
    qk_norm: bool = False
    swiglu: bool = False
    text_dim: int = 0  # > 0 enables cross-attention to precomputed text embeddings of this width

    @classmethod
    def from_cfg(cls, cfg) -> "DiTConfig":
        """Build from a Hydra `model` node, ignoring keys that are not architecture (name, nominal_params...)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in dict(cfg).items() if k in names})

    def validate(self) -> None:
        """The same check as `python -m dit_train` runs on the model group (one-line ConfigError)."""
        from dit_train.config import check_architecture

        check_architecture(asdict(self))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: x [B, N, D] scaled and shifted per image; shift and scale [B, 1, D] (broadcast over the tokens)."""
    return x * (1 + scale) + shift


def adaln_chunks(modulation: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """The adaLN projection [B, n*D] as n vectors [B, 1, D] that broadcast over the tokens: one view for all n (a
    view per vector and use would be one more operator to dispatch each, forward and backward)."""
    return modulation.unsqueeze(1).chunk(n, dim=2)


def sincos_pos_embed_2d(dim: int, grid: int) -> torch.Tensor:
    """Fixed 2-D sin-cos position table [grid*grid, dim] (half the channels per axis), MAE's/DiT's formula with
    the row's half first and the column's second (theirs, and diffusers' get_2d_sincos_pos_embed, put the column
    first). Kept so: the table is not in checkpoints, and reordering it would move every trained model's positions."""
    assert dim % 4 == 0, "hidden size must be divisible by 4 for 2-D sin-cos positions"
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))
    coords = torch.arange(grid, dtype=torch.float64)
    gy, gx = torch.meshgrid(coords, coords, indexing="ij")

    def axis(pos):
        out = pos.reshape(-1, 1) * omega.reshape(1, -1)
        return torch.cat([out.sin(), out.cos()], dim=1)

    return torch.cat([axis(gy), axis(gx)], dim=1).float()


class TimestepEmbedder(nn.Module):
    """t in [0, 1] -> sinusoidal features -> MLP. t is scaled by 1000 so the frequencies match DiT's."""

    def __init__(self, hidden_size: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = (t.float() * 1000)[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class labels -> vectors; index num_classes is the null class used for classifier-free guidance."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + 1, hidden_size)

    def forward(self, labels: torch.Tensor, drop_mask: torch.Tensor | None = None) -> torch.Tensor:
        if drop_mask is not None:
            labels = torch.where(drop_mask, torch.full_like(labels, self.num_classes), labels)
        return self.embedding_table(labels)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class SelfAttention(nn.Module):
    """The projections run on the [B*N, D] token rows: one addmm each (nn.Linear on a 3-D input adds a flatten and
    an unflatten view to dispatch, forward and backward)."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        head_dim = dim // num_heads
        self.qk_norm = qk_norm  # a plain attribute: read without nn.Module.__getattr__
        self.q_norm = RMSNorm(head_dim) if qk_norm else None  # None, not nn.Identity: no module call to do nothing
        self.k_norm = RMSNorm(head_dim) if qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        q, k, v = self.qkv(x.reshape(B * N, D)).view(B, N, 3, self.num_heads, D // self.num_heads).unbind(2)
        if self.qk_norm:
            # q/k normalised on [B, N, H, hd] views, before the heads are moved forward: the same rows and values as
            # on the permuted views, bit for bit, and cheaper on the CPU (docs/qk_norm.md)
            q, k = self.q_norm(q), self.k_norm(k)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.proj(out.transpose(1, 2).reshape(B * N, D)).view(B, N, D)


class CrossAttention(nn.Module):
    """Image tokens attend to projected text tokens (already mapped to the model width by context_embedder);
    projections on token rows, as in SelfAttention."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool):
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        head_dim = dim // num_heads
        self.qk_norm = qk_norm
        self.q_norm = RMSNorm(head_dim) if qk_norm else None
        self.k_norm = RMSNorm(head_dim) if qk_norm else None

    def forward(self, x: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor | None) -> torch.Tensor:
        B, N, D = x.shape
        L, H, hd = context.shape[1], self.num_heads, D // self.num_heads
        q = self.q(x.reshape(B * N, D)).view(B, N, H, hd)
        k, v = self.kv(context.reshape(B * L, D)).view(B, L, 2, H, hd).unbind(2)
        if self.qk_norm:  # normalised before the transpose, as above
            q, k = self.q_norm(q), self.k_norm(k)
        mask = None if context_mask is None else context_mask[:, None, None, :].bool()
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(B * N, D)).view(B, N, D)


class Mlp(nn.Module):
    """On the token rows [..., D] -> [rows, D], as the attention's projections."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x.reshape(-1, x.shape[-1])), approximate="tanh")).view(x.shape)


class SwiGLU(nn.Module):
    """SwiGLU with 2/3 of the hidden width so its parameter count matches the GELU MLP of the same ratio; on token rows,
    as Mlp."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        hidden = int(2 * hidden / 3)
        self.w12 = nn.Linear(dim, 2 * hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.w12(x.reshape(-1, x.shape[-1])).chunk(2, dim=-1)
        return self.w3(F.silu(a) * b).view(x.shape)


class DiTBlock(nn.Module):
    """adaLN-Zero block: the conditioning vector c produces shift/scale/gate for attention and MLP; the gates start
    at zero so every block is the identity at initialisation."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        d = cfg.hidden_size
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.attn = SelfAttention(d, cfg.num_heads, cfg.qk_norm)
        self.cross_attn = CrossAttention(d, cfg.num_heads, cfg.qk_norm) if cfg.text_dim else None
        self.norm_cross = nn.LayerNorm(d, eps=1e-6) if cfg.text_dim else None
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        hidden = int(d * cfg.mlp_ratio)
        self.mlp = SwiGLU(d, hidden) if cfg.swiglu else Mlp(d, hidden)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))

    def forward(self, x, c, context=None, context_mask=None):
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = adaln_chunks(self.adaLN_modulation(c), 6)
        x = x + gate_a * self.attn(modulate(self.norm1(x), shift_a, scale_a))
        if self.cross_attn is not None and context is not None:
            x = x + self.cross_attn(self.norm_cross(x), context, context_mask)
        return x + gate_m * self.mlp(modulate(self.norm2(x), shift_m, scale_m))


class FinalLayer(nn.Module):
    def __init__(self, d: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(d, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 2 * d))

    def forward(self, x, c):
        shift, scale = adaln_chunks(self.adaLN_modulation(c), 2)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """v_theta(x_t, t, y[, context]): predicts the rectified-flow velocity eps - x0 for a batch of images/latents."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        d, p, C = cfg.hidden_size, cfg.patch_size, cfg.in_channels
        self.grid = cfg.image_size // p
        self.x_embedder = nn.Module()
        self.x_embedder.proj = nn.Linear(p * p * C, d)  # patch embedding as a Linear on flattened patches
        self.register_buffer("pos_embed", sincos_pos_embed_2d(d, self.grid), persistent=False)
        self.t_embedder = TimestepEmbedder(d)
        self.y_embedder = LabelEmbedder(cfg.num_classes, d, cfg.class_dropout_prob) if cfg.num_classes else None
        self.context_embedder = nn.Linear(cfg.text_dim, d) if cfg.text_dim else None
        self.blocks = nn.ModuleList([DiTBlock(cfg) for _ in range(cfg.depth)])
        self.final_layer = FinalLayer(d, p, C)
        if not self.pos_embed.is_meta:  # on meta: shapes only, initialised after allocation (build.build_models)
            self.reset_parameters()

    def init_rules(self) -> dict[str, Rule]:
        """DiT initialisation, per parameter name: xavier-uniform linears with zero biases, N(0, 0.02) class and
        timestep embeddings, unit norms, and zeroed adaLN modulation, output layer and cross-attention output
        (adaLN-Zero: every block starts as the identity)."""
        rules = {}
        for prefix, m in self.named_modules():
            at = f"{prefix}." if prefix else ""
            if isinstance(m, nn.Linear):
                rules[at + "weight"] = xavier_uniform(m.weight.shape)
                if m.bias is not None:
                    rules[at + "bias"] = ZEROS
            elif isinstance(m, RMSNorm):
                rules[at + "weight"] = ONES
            elif isinstance(m, nn.LayerNorm) and m.elementwise_affine:
                rules[at + "weight"], rules[at + "bias"] = ONES, ZEROS
            elif isinstance(m, nn.Embedding):
                rules[at + "weight"] = Rule("normal", 0.02)
        for lin in ("t_embedder.mlp.0", "t_embedder.mlp.2"):
            rules[f"{lin}.weight"] = Rule("normal", 0.02)
        zeroed = ["final_layer.adaLN_modulation.1", "final_layer.linear"]
        zeroed += [f"blocks.{i}.adaLN_modulation.1" for i in range(len(self.blocks))]
        for lin in zeroed:
            rules[f"{lin}.weight"], rules[f"{lin}.bias"] = ZEROS, ZEROS
        for i, block in enumerate(self.blocks):
            if block.cross_attn is not None:  # cross-attention also starts as the identity
                rules[f"blocks.{i}.cross_attn.proj.weight"] = ZEROS
        return rules

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """The seeded initialisation (weight_init: the same values whether or not the parameters are FSDP2 shards,
        on any number of ranks). seed=None draws one from torch's global generator, so torch.manual_seed still
        chooses a standalone model; training passes the run's `model_init` seed."""
        if seed is None:
            seed = int(torch.randint(0, 2**63 - 1, ()).item())
        init_parameters(self, self.init_rules(), seed)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The position table (not in checkpoints: computed, also after to_empty on a resume)."""
        self.pos_embed.copy_(sincos_pos_embed_2d(self.config.hidden_size, self.grid))

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        p = self.config.patch_size
        x = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(B, (H // p) * (W // p), p * p * C)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        p, C, g = self.config.patch_size, self.config.in_channels, self.grid
        x = x.reshape(B, g, g, p, p, C).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(B, C, g * p, g * p)

    def forward(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        y: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        drop_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [B,C,H,W]; t: [B] in [0,1]; y: [B] labels (num_classes = null); context: [B,L,text_dim];
        drop_mask: [B] bool, True drops the condition (classifier-free guidance training). t is used as given (fp32:
        the timestep embedding needs its precision); x and context are cast to the compute dtype (bf16 under FSDP2
        mixed precision, which does not cast the root's inputs)."""
        compute = self.x_embedder.proj.weight.dtype
        x = x.to(compute)
        h = self.x_embedder.proj(self.patchify(x)) + self.pos_embed.to(compute)
        c = self.t_embedder(t)
        if self.y_embedder is not None:
            if y is None:  # unconditional call: use the null class
                y = torch.full((x.shape[0],), self.config.num_classes, dtype=torch.long, device=x.device)
            c = c + self.y_embedder(y, drop_mask)
        if context is not None:
            if self.context_embedder is None:
                raise ValueError("context given but model.text_dim=0; set model.text_dim to the embedding width")
            context = self.context_embedder(context.to(compute))
            if drop_mask is not None:  # dropped text condition = zero context (the text 'null')
                context = context * (~drop_mask).to(context.dtype)[:, None, None]
        for block in self.blocks:
            h = block(h, c, context, context_mask)
        return self.unpatchify(self.final_layer(h, c))


    @classmethod
    def from_pretrained(cls, path: str, device="cpu") -> "DiT":
        """A model folder written by `dit-export` (config.json + model.safetensors)."""
        from dit_train.model.pretrained import load_pretrained

        return load_pretrained(cls, path, device)

    def save_pretrained(self, folder: str, dtype: str = "fp32", provenance: dict | None = None) -> str:
        from dit_train.model.pretrained import save_pretrained

        return save_pretrained(self.state_dict(), self.config, folder, dtype, provenance, type(self).__name__)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def load_preset(name: str, hidden_size: int | None = None, depth: int | None = None, num_heads: int | None = None):
    """A model preset (conf/model/<name>.yaml) as an OmegaConf node, optionally resized for benchmarks: a width
    override keeps head dim 64 unless num_heads is given."""
    import os

    from omegaconf import OmegaConf

    from dit_train.config.files import CONF_DIR

    folder = os.path.join(CONF_DIR, "model")
    path = os.path.join(folder, f"{name}.yaml")
    if not os.path.exists(path):
        valid = sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))
        raise ValueError(f"model preset {name!r} does not exist; valid: {', '.join(valid)}")
    cfg = OmegaConf.load(path)
    if hidden_size:
        cfg.hidden_size, cfg.num_heads = hidden_size, max(1, hidden_size // 64)
    if depth:
        cfg.depth = depth
    if num_heads:
        cfg.num_heads = num_heads
    return cfg


def build_model(cfg, device: torch.device | str | None = None) -> DiT:
    """Build from a Hydra `model` node; device='meta' builds the architecture without allocating it."""
    with torch.device(device or "cpu"):
        return DiT(DiTConfig.from_cfg(cfg))
