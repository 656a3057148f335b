"""Training and validation batches from prepared token files (see train/normlab/data/prepare.py).

A split is a flat uint16 token stream cut into fixed windows of seq_len + 1 tokens (inputs and
next-token targets). Training visits the windows in a permutation drawn from (seed, epoch) alone, so
two runs with the same seed see identical batches in identical order whatever their norm layer.
Validation reads the first windows of the validation split in order: the same tokens every time. The files are
checked by train/normlab/data/corpus.py.
"""

from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from normlab.common.errors import ConfigError, DataError
from normlab.data.corpus import verify_prepared

SPLITS = ("train", "val")


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
    """The windows of an epoch in a permutation drawn from (seed, epoch) alone.

    The permutation is cut into global batches of batch_size x world_size x accumulate windows, one per
    optimizer step; micro-step a of rank r takes the (a x world_size + r)-th micro-batch of it. The ranks and
    micro-steps together consume the permutation in order, with no overlap and no gap, and an optimizer step
    sees the same windows whatever the split between devices and accumulation; only a last, incomplete global
    batch of each epoch is left out. A resumed epoch starts after its first `consumed` micro-batches.
    """

    def __init__(
        self, num_windows: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1, accumulate: int = 1
    ):
        self.num_windows, self.batch_size, self.seed = num_windows, batch_size, seed
        self.rank, self.world_size, self.accumulate = rank, world_size, accumulate
        self.global_batches = num_windows // (batch_size * world_size * accumulate)
        self.epoch, self.consumed = 0, 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:  # Lightning also calls this on the epoch a resumed run continues
            self.epoch, self.consumed = epoch, 0

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def __iter__(self):
        order, B = self.order(self.epoch), self.batch_size
        for micro in range(self.consumed, self.global_batches * self.accumulate):
            step, a = divmod(micro, self.accumulate)
            start = (step * self.accumulate * self.world_size + a * self.world_size + self.rank) * B
            yield from order[start : start + B].tolist()

    def __len__(self) -> int:
        return self.global_batches * self.accumulate * self.batch_size


class ResumableLoader(DataLoader):
    """A DataLoader whose position in the epoch goes into Lightning checkpoints (Lightning saves and restores
    the state of any loader with state_dict/load_state_dict), for exact mid-epoch resume. Checkpoints are taken
    between optimizer steps (training/rundir/), so the position is the micro-batches of the optimizer steps done:
    `steps_done()` x accumulation, less those of the epochs before."""

    steps_done = staticmethod(lambda: 0)  # set by the data module: the trainer's global step
    accumulate = 1

    def state_dict(self) -> dict:
        return {
            "epoch": self.sampler.epoch,
            "consumed": self.steps_done() * self.accumulate - self.sampler.epoch * len(self),
        }

    def load_state_dict(self, state: dict) -> None:
        self.sampler.epoch, self.sampler.consumed = state["epoch"], state["consumed"]


class TokenDataModule(L.LightningDataModule):
    def __init__(
        self,
        name: str,
        dir: str,
        seq_len: int,
        vocab_size: int,
        batch_size: int,
        val_tokens: int,
        seed: int,
        source: dict,
        verify_checksums: bool = False,
        num_workers: int = 0,
    ):
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"data.batch_size={batch_size}: give a positive number of sequences per device")
        if val_tokens is not None and (not isinstance(val_tokens, int) or val_tokens < seq_len):
            raise ConfigError(
                f"data.val_tokens={val_tokens}: validation needs at least one sequence of {seq_len} "
                "tokens (and checkpoints follow validations); give more, or null for the whole split"
            )
        self.name, self.dir, self.seq_len, self.vocab_size = name, Path(dir), seq_len, vocab_size
        self.batch_size, self.val_tokens, self.seed, self.source = batch_size, val_tokens, seed, source
        self.verify_checksums, self.num_workers = verify_checksums, num_workers
        self.meta: dict | None = None

    def verify(self) -> dict:
        """Check the prepared files before training starts; return their metadata."""
        self.meta = verify_prepared(self.dir, self.name, self.source, self.vocab_size, SPLITS, self.verify_checksums)
        for split in SPLITS:
            if self.meta["splits"][split]["tokens"] < self.seq_len + 1:
                raise DataError(
                    f"{self.dir / split}.bin has {self.meta['splits'][split]['tokens']} tokens, "
                    f"fewer than one window of seq_len+1={self.seq_len + 1}"
                )
        available = (self.meta["splits"]["val"]["tokens"] - 1) // self.seq_len * self.seq_len
        if self.val_tokens is not None and self.val_tokens > available:
            raise DataError(
                f"data.val_tokens={self.val_tokens} but the validation split of '{self.name}' holds "
                f"{available} tokens in windows of {self.seq_len}: lower it, or set data.val_tokens=null for all"
            )
        return self.meta

    def check_global_batch(self, windows_per_step: int) -> None:
        """Refuse an optimizer step larger than the training split (Lightning would train on nothing)."""
        windows = (self.meta["splits"]["train"]["tokens"] - 1) // self.seq_len
        if windows < windows_per_step:
            raise ConfigError(
                f"an optimizer step takes {windows_per_step} sequences of {self.seq_len} tokens, but "
                f"the training split of '{self.name}' holds {windows}: lower data.batch_size (or "
                "global_batch_size, trainer.devices), or train on more data"
            )

    def setup(self, stage: str) -> None:
        if self.meta is None:
            self.verify()
        self.train_windows = TokenWindows(self.dir / "train.bin", self.seq_len)
        max_windows = None if self.val_tokens is None else self.val_tokens // self.seq_len
        self.val_windows = TokenWindows(self.dir / "val.bin", self.seq_len, max_windows=max_windows)

    def train_dataloader(self) -> ResumableLoader:
        trainer = self.trainer
        rank, world, accumulate = (
            (trainer.global_rank, trainer.world_size, trainer.accumulate_grad_batches) if trainer else (0, 1, 1)
        )
        sampler = ShuffledWindows(len(self.train_windows), self.batch_size, self.seed, rank, world, accumulate)
        loader = ResumableLoader(
            self.train_windows,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            generator=self.own_generator(),
        )
        if trainer is not None:
            loader.steps_done, loader.accumulate = lambda: trainer.global_step, accumulate
        return loader

    def val_dataloader(self) -> DataLoader:
        # Every rank evaluates the same fixed windows, so the logged validation loss does not depend
        # on the number of devices.
        return DataLoader(
            self.val_windows, batch_size=self.batch_size, num_workers=self.num_workers, generator=self.own_generator()
        )

    def own_generator(self) -> torch.Generator:
        # A DataLoader without one draws its workers' seed from the global generator each time it is iterated,
        # which would shift dropout masks after a resume (the resumed run iterates its loaders at other times).
        return torch.Generator().manual_seed(self.seed)
