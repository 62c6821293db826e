"""Rectified flow: the loss and timesteps, the sampler, the EMA weights and the VAE codec."""
