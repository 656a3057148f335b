"""normlab and the Hugging Face world: export to a transformers model (export, with the model code of an RMSNorm GPT-2:
hf_rmsnorm_gpt2), sampling text (sample) and evaluation with the harness or held-out perplexity (evaluate)."""
