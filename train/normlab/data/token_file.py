"""A token file as normlab-prepare writes it: uint16 GPT-2 tokens, counted and hashed as they are written, flushed to
disk before the corpus that holds it is put in place."""

import hashlib
import os
from pathlib import Path

import numpy as np


class TokenFile:
    """Writes uint16 tokens to `path` while counting and hashing them."""

    def __init__(self, path: Path):
        self.path, self.file = path, open(path, "wb")
        self.digest, self.tokens, self.documents, self.max_token = hashlib.sha256(), 0, 0, 0

    def write(self, chunk: np.ndarray, documents: int) -> None:
        data = chunk.astype(np.uint16).tobytes()
        self.file.write(data)
        self.digest.update(data)
        self.tokens += chunk.size
        self.documents += documents
        self.max_token = max(self.max_token, int(chunk.max(initial=0)))

    def close(self) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())  # on disk before the staging directory is put in place
        self.file.close()
        return {
            "file": self.path.name,
            "tokens": self.tokens,
            "documents": self.documents,
            "max_token": self.max_token,
            "sha256": self.digest.hexdigest(),
        }
