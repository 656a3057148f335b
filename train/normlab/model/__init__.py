"""The GPT-2 model (gpt) and its norm layers (norms: LayerNorm, RMSNorm and DyT, the one place the arms differ;
fused_rmsnorm: a fused CPU kernel of RMSNorm). Plain PyTorch: nothing here knows about training, data or the run
directory."""
