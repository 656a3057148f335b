"""Training and validation batches from prepared token files (see train/prepare.py).

A split is a flat uint16 token stream cut into fixed windows of seq_len + 1 tokens (inputs and
next-token targets). Training visits the windows in a permutation drawn from (seed, epoch) alone, so
two runs with the same seed see identical batches in identical order whatever their norm layer.
Validation reads the first windows of the validation split in order: the same tokens every time.
"""

import json
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from train import tokenizer
from train.errors import DataError
from train.prepare import META_FILE, SPLITS


class TokenWindows(Dataset):
    def __init__(self, path: Path, seq_len: int, max_windows: int | None = None):
        self.path, self.seq_len = path, seq_len
        n_tokens = path.stat().st_size // 2
        self.num_windows = max(0, (n_tokens - 1) // seq_len)
        if max_windows is not None:
            self.num_windows = min(self.num_windows, max_windows)
        self._tokens = None  # opened lazily, once per process (a memmap does not survive pickling)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        window = torch.from_numpy(self._tokens[i * self.seq_len : (i + 1) * self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


class ShuffledWindows(Sampler[int]):
    """Every window once per epoch, in an order drawn from (seed, epoch), dealt round-robin to ranks
    (the last num_windows % world_size windows of each permutation are left out so ranks stay even)."""

    def __init__(self, num_windows: int, seed: int, rank: int = 0, world_size: int = 1):
        self.num_windows, self.seed, self.rank, self.world_size = num_windows, seed, rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_windows)
        return iter(order[self.rank : len(self) * self.world_size : self.world_size].tolist())

    def __len__(self) -> int:
        return self.num_windows // self.world_size


class TokenDataModule(L.LightningDataModule):
    def __init__(self, name: str, dir: str, seq_len: int, batch_size: int, val_tokens: int, seed: int,
                 source: dict, num_workers: int = 0):
        super().__init__()
        self.name, self.dir, self.seq_len, self.batch_size = name, Path(dir), seq_len, batch_size
        self.val_tokens, self.seed, self.source, self.num_workers = val_tokens, seed, source, num_workers
        self.meta: dict | None = None

    def verify(self) -> dict:
        """Check the prepared files before anything else happens; return their metadata."""
        hint = f"run `normlab-prepare data={self.name}`"
        meta_path = self.dir / META_FILE
        if not meta_path.is_file():
            raise DataError(f"data '{self.name}' is not prepared ({meta_path} is missing): {hint}")
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError:
            raise DataError(f"{meta_path} is not valid JSON: {hint} again") from None
        if meta.get("source") != self.source:
            raise DataError(f"{self.dir} was prepared from another source than conf/data/{self.name}.yaml: {hint} again")
        if meta["tokenizer"]["ranks_sha256"] != tokenizer.RANKS_SHA256:
            raise DataError(f"{self.dir} was tokenized with {meta['tokenizer']['name']}, not GPT-2: {hint} again")
        for split in SPLITS:
            info, path = meta["splits"][split], self.dir / meta["splits"][split]["file"]
            if not path.is_file():
                raise DataError(f"{path} is missing: {hint}")
            if path.stat().st_size != 2 * info["tokens"]:
                raise DataError(
                    f"{path} holds {path.stat().st_size // 2} tokens, its metadata says {info['tokens']}: "
                    f"the file is truncated or replaced, {hint} again"
                )
            if info["tokens"] < self.seq_len + 1:
                raise DataError(f"{path} has {info['tokens']} tokens, fewer than one window of seq_len+1={self.seq_len + 1}")
        self.meta = meta
        return meta

    def setup(self, stage: str) -> None:
        if self.meta is None:
            self.verify()
        self.train_windows = TokenWindows(self.dir / "train.bin", self.seq_len)
        self.val_windows = TokenWindows(self.dir / "val.bin", self.seq_len, max_windows=self.val_tokens // self.seq_len)

    def train_dataloader(self) -> DataLoader:
        rank, world_size = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        sampler = ShuffledWindows(len(self.train_windows), self.seed, rank, world_size)
        return DataLoader(self.train_windows, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                          num_workers=self.num_workers, pin_memory=torch.cuda.is_available())

    def val_dataloader(self) -> DataLoader:
        # Every rank evaluates the same fixed windows, so the logged validation loss does not depend
        # on the number of devices.
        return DataLoader(self.val_windows, batch_size=self.batch_size, num_workers=self.num_workers)
