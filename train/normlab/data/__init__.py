"""Tokens: the GPT-2 tokenizer files (tokenizer), a corpus prepared into token files (prepare: normlab-prepare), and
the Lightning data module that reads them in the same order for every run of a seed (datamodule)."""
