"""normlab and the Hugging Face world: export to a transformers model (export, with the model code of an RMSNorm GPT-2:
hf_rmsnorm_gpt2, and of a DyT GPT-2: hf_dyt_gpt2), sampling text (sample), evaluation with the harness or held-out
perplexity (evaluate), local Hugging Face models for the angle study and the ablation (pretrained), and a LayerNorm
model (normlab's or Hugging Face GPT-2) converted into the RMSNorm model that computes the same function (convert)."""
