"""Tokens: the GPT-2 tokenizer files (tokenizer), a corpus prepared into token files (prepare: normlab-prepare; a hub
source located by what its repository holds, hub; OpenWebText's original archives read, archives; a token file
written, token_file), and the Lightning data module that reads them in the same order for every run of a seed
(datamodule)."""
