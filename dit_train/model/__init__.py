"""The Diffusion Transformer, its initialisation, FLOPs and its exported form (usable without the trainer)."""
