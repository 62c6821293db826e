"""The encoders eval.encoder names (features.py builds them; its docstring says what each is) and the published
DINOv2 networks. No torch here: the command-line check refuses an unknown encoder before torch is imported."""

# hub name -> (Hugging Face repo, torch.hub entry point, torch.hub checkpoint file name)
DINOV2_VARIANTS = {
    "dinov2_vits14": ("facebook/dinov2-small", "dinov2_vits14", "dinov2_vits14_pretrain.pth"),
    "dinov2_vitb14": ("facebook/dinov2-base", "dinov2_vitb14", "dinov2_vitb14_pretrain.pth"),
    "dinov2_vitl14": ("facebook/dinov2-large", "dinov2_vitl14", "dinov2_vitl14_pretrain.pth"),
    "dinov2_vitg14": ("facebook/dinov2-giant", "dinov2_vitg14", "dinov2_vitg14_pretrain.pth"),
}
# the published networks' shapes (hidden size, layers, patch): a Hugging Face folder is named by what it holds
DINOV2_SHAPES = {
    "dinov2_vits14": (384, 12, 14),
    "dinov2_vitb14": (768, 12, 14),
    "dinov2_vitl14": (1024, 24, 14),
    "dinov2_vitg14": (1536, 40, 14),
}

# every name eval.encoder takes: features.py registers one builder under each (tests/unit/test_config.py checks it)
ENCODERS = (*DINOV2_VARIANTS, "dinov2", "dinov2_random", "inception")
