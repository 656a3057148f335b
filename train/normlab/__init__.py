"""normlab: controlled LayerNorm-vs-RMSNorm GPT-2 pretraining."""
