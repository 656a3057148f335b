"""The angle study: streaming statistics of the angle between hidden vectors and reference vectors.

For every norm layer, forward hooks see the norm's input (h for the attention norm, h + a for the MLP norm,
the last residual stream for the final norm) and its output after the affine map, and reduce them at once
to statistics; nothing else is kept, so memory does not depend on the number of tokens. Per
(layer, site, reference, position) a row holds count, mean, M2 (Welford/Chan, float64), min, max, a 1-degree
histogram, the mean norm of the vectors and the mean cos^2 of the angle (the share of their squared norm that
lies along the reference). References: the uniform vector 1, a random vector a~ with the same norm sqrt(d)
and a random vector b~ with another norm (fixed seeds). Rows at site "<norm>.rotation" hold the angle between
each norm's input and output. Position "all" counts every token, "first" only the first token of each document
(the one after a document separator: GPT-2's EOT, or the model's EOS, which a BOS then follows), "rest" all but
those.

Two nulls. One random direction makes 90 +- (180/pi)/sqrt(d) degrees with any fixed vector (null_mean_deg,
null_std_deg): the spread of single angles. Whether 1 is special is asked of the MEAN angle: the same mean is taken
for `null_directions` seeded random directions (uniform on the sphere), and a row holds where its reference's mean
falls among theirs (null_percentile: the share of random directions with a smaller mean angle, in percent) and
their mean and spread (null_random_mean_deg, null_random_std_deg). The null of mean_cos2 is 1/d.
"""

import csv
import json
import math
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from tqdm import tqdm

from normlab.common import outputs
from normlab.common.errors import NormlabError
from normlab.data.tokenizer import EOT

REFERENCES = ("uniform", "random_a", "random_b")
POSITIONS = ("all", "first", "rest")
BINS = 180  # 1-degree histogram over [0, 180]
NULL_DIRECTIONS_SEED = 3  # the random directions of the percentile null (1, 2: a~ and b~)
IDENTITY_COLUMNS = ("run", "model", "norm", "seed", "source")  # what was measured: any number of them share a CSV
CSV_COLUMNS = (*IDENTITY_COLUMNS, "step", "layer", "site", "reference", "position", "count", "mean_deg", "std_deg",
               "sem_deg", "min_deg", "max_deg", "mean_norm", "mean_cos2", "null_mean_deg", "null_std_deg",
               "null_percentile", "null_random_mean_deg", "null_random_std_deg", "null_directions", "d", "histogram")


@dataclass(frozen=True)
class NormSite:
    """A norm module to watch: `role` is attn_norm, mlp_norm or final_norm; final_norm has layer = n_layer."""
    layer: int
    role: str
    module: nn.Module


# Where the norms are, per architecture: (list of blocks, attention norm, MLP norm or None, final norm).
LAYOUTS = {
    "normlab": ("blocks", "ln_1", "ln_2", "ln_f"),
    "gpt2": ("transformer.h", "ln_1", "ln_2", "transformer.ln_f"),
    "normlab_rms_gpt2": ("transformer.h", "ln_1", "ln_2", "transformer.ln_f"),  # normlab-export's RMSNorm GPT-2
    "gpt_neo": ("transformer.h", "ln_1", "ln_2", "transformer.ln_f"),
    "gptj": ("transformer.h", "ln_1", None, "transformer.ln_f"),  # attention and MLP share one norm
    "gpt_neox": ("gpt_neox.layers", "input_layernorm", "post_attention_layernorm", "gpt_neox.final_layer_norm"),
    "llama": ("model.layers", "input_layernorm", "post_attention_layernorm", "model.norm"),
}


def norm_sites(model: nn.Module, layout: str) -> list[NormSite]:
    """The norm modules of `model` (an architecture of LAYOUTS), in forward order."""
    blocks, attn_norm, mlp_norm, final_norm = LAYOUTS[layout]
    sites = []
    for i, block in enumerate(model.get_submodule(blocks)):
        sites.append(NormSite(i, "attn_norm", block.get_submodule(attn_norm)))
        if mlp_norm is not None:
            sites.append(NormSite(i, "mlp_norm", block.get_submodule(mlp_norm)))
    sites.append(NormSite(len(model.get_submodule(blocks)), "final_norm", model.get_submodule(final_norm)))
    return sites


def reference_vectors(d: int, seed_a: int = 1, seed_b: int = 2, norm_b: float = 0.5) -> torch.Tensor:
    """[3, d]: the uniform vector 1 (norm sqrt d), a~ of norm sqrt(d) and b~ of norm norm_b * sqrt(d)."""
    gen_a, gen_b = torch.Generator().manual_seed(seed_a), torch.Generator().manual_seed(seed_b)
    a, b = torch.randn(d, generator=gen_a, dtype=torch.float64), torch.randn(d, generator=gen_b, dtype=torch.float64)
    return torch.stack([torch.ones(d, dtype=torch.float64), a / a.norm() * d**0.5, b / b.norm() * norm_b * d**0.5])


def random_directions(count: int, d: int) -> torch.Tensor:
    """[count, d]: unit vectors drawn uniformly on the sphere (normalised Gaussians), the same for every run."""
    directions = torch.randn(count, d, generator=torch.Generator().manual_seed(NULL_DIRECTIONS_SEED),
                             dtype=torch.float64)
    return directions / directions.norm(dim=1, keepdim=True)


class AngleStats:
    """Mergeable statistics of many angle series at once, one row per (layer, site, reference, position)."""

    def __init__(self, rows: list[tuple[int, str, str, str]], d: int, device=None, null_directions: int = 0):
        self.rows, self.d, self.null_directions = rows, d, null_directions
        self.index = {row: i for i, row in enumerate(rows)}
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=device)  # noqa: E731
        self.count, self.mean, self.m2 = zeros(len(rows)), zeros(len(rows)), zeros(len(rows))
        self.min, self.max = zeros(len(rows)).fill_(math.inf), zeros(len(rows)).fill_(-math.inf)
        self.hist, self.norm_sum, self.cos2_sum = zeros(len(rows), BINS), zeros(len(rows)), zeros(len(rows))
        self.null_sum = zeros(len(rows), null_directions)  # per row: the sum of its vectors' angles to each direction

    TENSORS = ("count", "mean", "m2", "min", "max", "hist", "norm_sum", "cos2_sum", "null_sum")

    def update_null(self, idx: torch.Tensor, sums: torch.Tensor) -> None:
        """Add sums[k, j], the sum of angles (degrees) of row idx[k]'s vectors to random direction j."""
        self.null_sum[idx] += sums.double()

    def update(self, idx: torch.Tensor, degrees: torch.Tensor, norms: torch.Tensor, cos2: torch.Tensor) -> None:
        """Add the values degrees[k, :] (with their vectors' norms[k, :] and cos2[k, :]) to row idx[k]."""
        n = degrees.shape[1]
        if n == 0:
            return
        degrees = degrees.double()
        mean_b = degrees.mean(1)
        m2_b = ((degrees - mean_b[:, None]) ** 2).sum(1)
        self._merge_moments(idx, torch.full_like(mean_b, n), mean_b, m2_b)
        self.min[idx] = torch.minimum(self.min[idx], degrees.amin(1))
        self.max[idx] = torch.maximum(self.max[idx], degrees.amax(1))
        bins = degrees.long().clamp_(0, BINS - 1) + torch.arange(len(idx), device=degrees.device)[:, None] * BINS
        counts = torch.bincount(bins.flatten(), minlength=len(idx) * BINS).view(len(idx), BINS)
        self.hist[idx] += counts.double()
        self.norm_sum[idx] += norms.sum(1, dtype=torch.float64)
        self.cos2_sum[idx] += cos2.sum(1, dtype=torch.float64)

    def _merge_moments(self, idx, n_b, mean_b, m2_b) -> None:
        n_a, mean_a = self.count[idx], self.mean[idx]
        total = n_a + n_b
        delta = mean_b - mean_a
        self.mean[idx] = mean_a + delta * n_b / total
        self.m2[idx] = self.m2[idx] + m2_b + delta**2 * n_a * n_b / total
        self.count[idx] = total

    def merge(self, other: "AngleStats") -> "AngleStats":
        """Combine with statistics of other tokens (Chan et al.): the result is that of one pass over both."""
        assert other.rows == self.rows
        idx = torch.nonzero(other.count, as_tuple=True)[0]
        if len(idx):
            self._merge_moments(idx, other.count[idx], other.mean[idx], other.m2[idx])
        self.min, self.max = torch.minimum(self.min, other.min), torch.maximum(self.max, other.max)
        self.hist += other.hist
        self.norm_sum += other.norm_sum
        self.cos2_sum += other.cos2_sum
        self.null_sum += other.null_sum
        return self

    def all_reduce(self) -> "AngleStats":
        """Merge the statistics of every DDP rank, in rank order, into every rank's copy."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self
        flat = torch.cat([getattr(self, t).reshape(len(self.rows), -1) for t in self.TENSORS], 1)
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        merged = AngleStats(self.rows, self.d, flat.device, self.null_directions)
        for tensor in gathered:
            merged.merge(AngleStats.from_flat(self.rows, self.d, tensor, self.null_directions))
        return merged

    @classmethod
    def from_flat(cls, rows, d, flat: torch.Tensor, null_directions: int = 0) -> "AngleStats":
        stats = cls(rows, d, flat.device, null_directions)
        widths = [{"hist": BINS, "null_sum": null_directions}.get(t, 1) for t in cls.TENSORS]
        for name, part in zip(cls.TENSORS, flat.split(widths, 1)):
            setattr(stats, name, part.squeeze(1) if name not in ("hist", "null_sum") else part.clone())
        return stats

    def records(self, step: int, identity: dict | None = None) -> list[dict]:
        """One CSV row per statistics row that saw tokens; `identity`: the IDENTITY_COLUMNS of what was measured."""
        null_std = math.degrees(1 / math.sqrt(self.d))
        count, mean, m2, hist = self.count.cpu(), self.mean.cpu(), self.m2.cpu(), self.hist.cpu().long()
        random_means = self.null_sum.cpu() / count.clamp_min(1)[:, None]  # [rows, directions]
        out = []
        for i, (layer, site, reference, position) in enumerate(self.rows):
            n = count[i].item()
            if n == 0:
                continue
            std = math.sqrt(m2[i].item() / n)
            row = {**dict.fromkeys(IDENTITY_COLUMNS, ""), **(identity or {}),
                   "step": step, "layer": layer, "site": site, "reference": reference, "position": position,
                   "count": int(n), "mean_deg": mean[i].item(), "std_deg": std, "sem_deg": std / math.sqrt(n),
                   "min_deg": self.min[i].item(), "max_deg": self.max[i].item(),
                   "mean_norm": self.norm_sum[i].item() / n, "mean_cos2": self.cos2_sum[i].item() / n,
                   "null_mean_deg": 90.0, "null_std_deg": null_std, "null_percentile": "",
                   "null_random_mean_deg": "", "null_random_std_deg": "", "null_directions": "", "d": self.d,
                   "histogram": " ".join(map(str, hist[i].tolist()))}  # counts per degree, 0..180
            if self.null_directions and not site.endswith(".rotation"):
                means = random_means[i]
                below = (means < mean[i]).sum().item() + 0.5 * (means == mean[i]).sum().item()
                row.update(null_percentile=100 * below / self.null_directions,
                           null_random_mean_deg=means.mean().item(),
                           null_random_std_deg=means.std().item() if self.null_directions > 1 else 0.0,
                           null_directions=self.null_directions)
            out.append(row)
        return out


def site_rows(site: NormSite, position: str) -> list[tuple[int, str, str, str]]:
    """The 7 rows of one norm at one position: its input and output against each reference, and its rotation."""
    rows = [(site.layer, f"{site.role}.{io}", ref, position) for io in ("input", "output") for ref in REFERENCES]
    return rows + [(site.layer, f"{site.role}.rotation", "input", position)]


def stat_rows(sites: list[NormSite]) -> list[tuple[int, str, str, str]]:
    return [row for s in sites for position in POSITIONS for row in site_rows(s, position)]


class AngleProbe:
    """Forward hooks on the norm modules that feed AngleStats. A hook reduces the norm's input and output to a
    few numbers per token (their norms, their dot products with the references, the rotation); `flush()`, after
    each forward, turns those of every site into angles and statistics at once. `mask` ([B, T] bool, True = real
    token) must be set before each forward when batches are padded."""

    def __init__(self, sites: list[NormSite], d: int, device=None, null_directions: int = 0, **reference_kwargs):
        self.sites, self.d = sites, d
        self.stats = AngleStats(stat_rows(sites), d, device, null_directions)
        self.references = reference_vectors(d, **reference_kwargs).to(device=device, dtype=torch.float32)
        self.reference_norms = self.references.norm(dim=1)
        self.random_directions = random_directions(null_directions, d).to(device=device, dtype=torch.float32)
        self.mask: torch.Tensor | None = None
        self.first: torch.Tensor | None = None  # [B, T] bool: the first tokens of documents (None: position 0)
        self._pending: list[tuple[NormSite, torch.Tensor, torch.Tensor | None]] = []
        self._row_cache: dict[tuple, torch.Tensor] = {}

    @contextmanager
    def hooks(self):
        handles = [s.module.register_forward_hook(self._hook(s)) for s in self.sites]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, site: NormSite):
        def hook(module, args, output):
            x = args[0] if args else None
            y = output[0] if isinstance(output, tuple) else output
            if any(pending is site for pending, *_ in self._pending):  # a norm called twice in one forward
                self.flush()
            with torch.autocast(x.device.type, enabled=False):  # float32 whatever the run's autocast
                x, y = x.detach().float(), y.detach().float()
                null = self._null_sums(x, y) if len(self.random_directions) else None
                self._pending.append((site, self._per_token(x, y), null))

        return hook

    def _positions(self, shape, device) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] masks of the tokens counted at positions all and first (rest: all but first)."""
        mask = self.mask if self.mask is not None else torch.ones(shape, dtype=torch.bool, device=device)
        first = self.first
        if first is None:
            first = torch.zeros(shape, dtype=torch.bool, device=device)
            first[:, 0] = True
        return mask, mask & first

    def _null_sums(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """[2 (input, output), 3 (POSITIONS), directions]: the sums of the angles of x and y to each random
        direction, reduced at once (a [B, T, directions] tensor per norm would not fit for long)."""
        every_token, first_tokens = self._positions(x.shape[:2], x.device)
        sums = []
        for v in (x, y):
            cos = (v @ self.random_directions.T).div_(v.norm(dim=-1, keepdim=True).clamp_min(1e-30))
            degrees = torch.rad2deg_(torch.acos_(cos.clamp_(-1, 1)))
            every = degrees[every_token].sum(0, dtype=torch.float64)
            first = degrees[first_tokens].sum(0, dtype=torch.float64)
            sums.append(torch.stack([every, first, every - first]))
        return torch.stack(sums)

    def _per_token(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """[B, T, 9]: x and y against each reference (dot products), |x|, |y|, and |x^ - y^| (unit vectors)."""
        x_norm, y_norm = x.norm(dim=-1, keepdim=True), y.norm(dim=-1, keepdim=True)
        # The rotation is small, so it is measured from |x^ - y^| (see flush), which keeps the precision that
        # an angle from x . y loses near 0.
        gap = torch.addcmul(x / x_norm.clamp_min(1e-30), y, -1 / y_norm.clamp_min(1e-30)).norm(dim=-1, keepdim=True)
        return torch.cat([x @ self.references.T, y @ self.references.T, x_norm, y_norm, gap], -1)

    def flush(self) -> None:
        """Add what the hooks saw since the last flush to the statistics: one update per position for all sites."""
        with torch.autocast(self.references.device.type, enabled=False):
            self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        by_shape: dict[tuple, list] = {}
        for site, values, null in pending:
            by_shape.setdefault(values.shape, []).append((site, values))
            if null is not None:
                for position, sums in zip(POSITIONS, null.unbind(1)):  # input rows get the input's sums, output's
                    self.stats.update_null(self._rows(site, position)[:6], sums.repeat_interleave(3, 0))
        for group in by_shape.values():
            sites, values = zip(*group)
            values = torch.stack(values)  # [sites, B, T, 9]
            every_token, first_tokens = self._positions(values.shape[1:3], values.device)
            selections = (values[:, every_token], values[:, first_tokens], values[:, every_token & ~first_tokens])
            for position, selected in zip(POSITIONS, selections):
                self._update(sites, position, selected)

    def _update(self, sites, position: str, values: torch.Tensor) -> None:
        """values: [sites, tokens, 9] from _per_token."""
        dots, x_norm, y_norm, gap = values[..., :6], values[..., 6], values[..., 7], values[..., 8]
        norms = torch.stack([x_norm] * 3 + [y_norm] * 3 + [x_norm], 1)  # [sites, 7, tokens], in site_rows order
        cos = dots.transpose(1, 2) / (norms[:, :6] * self.reference_norms.repeat(2)[:, None]).clamp_min(1e-30)
        radians = torch.acos(cos.clamp(-1, 1))  # well conditioned: these angles lie near 90 degrees
        # for unit vectors |x^ + y^| = sqrt(4 - |x^ - y^|^2), and the angle between them is 2 atan2 of the two
        rotation = 2 * torch.atan2(gap, (4 - gap**2).clamp_min(0).sqrt())
        radians = torch.cat([radians, rotation[:, None]], 1)
        rows = torch.cat([self._rows(site, position) for site in sites])
        self.stats.update(
            rows, torch.rad2deg(radians).flatten(0, 1), norms.flatten(0, 1), (torch.cos(radians) ** 2).flatten(0, 1)
        )

    def _rows(self, site: NormSite, position: str) -> torch.Tensor:
        key = (site.layer, site.role, position)
        if key not in self._row_cache:
            rows = [self.stats.index[r] for r in site_rows(site, position)]
            self._row_cache[key] = torch.tensor(rows, device=self.references.device)
        return self._row_cache[key]


@torch.no_grad()
def measure(forward, sites: list[NormSite], d: int, batches, device=None, null_directions: int = 0,
            separator: int | None = None, **reference_kwargs) -> AngleStats:
    """Run `forward(ids, mask)` over `batches` of (ids, mask or None) with the hooks on; return the stats
    (merged over DDP ranks when a process group is initialised). Position first: the tokens that follow the token
    id `separator` (None: position 0 of each sequence)."""
    probe = AngleProbe(sites, d, device, null_directions, **reference_kwargs)
    with probe.hooks():
        for ids, mask in batches:
            probe.mask = mask
            if separator is not None:
                probe.first = torch.zeros_like(ids, dtype=torch.bool)
                probe.first[:, 1:] = ids[:, :-1] == separator
            forward(ids, mask)
            probe.flush()
    return probe.stats.all_reduce()


def append_csv(path: Path, records: list[dict]) -> None:
    """Add `records` to the CSV at `path`, which may hold the rows of any number of models: rows of the same source
    and step are replaced (measuring a checkpoint again rewrites its rows, without duplicates), every other row is
    kept; a torn or damaged row is dropped with a warning."""
    from normlab.training.run_dir import read_table, warn

    measured = {(str(r["source"]), str(r["step"])) for r in records}
    _, rows, dropped = read_table(path)
    if dropped:
        warn(f"{path}: dropped {dropped} torn or damaged row{'s' * (dropped > 1)}")
    kept = [row for row in rows if (row.get("source", ""), row["step"]) not in measured]
    outputs.write_csv(path, CSV_COLUMNS, kept + records)


# -- reading the CSV files back (normlab-report, tests)


class AnalysisError(NormlabError):
    """Input that normlab-angles or normlab-report cannot analyse as given."""


class DamagedTable(AnalysisError):
    """A CSV file with a row cut short or damaged."""


def read_rows(path: str | Path, parse: Callable[[str, str], object], columns=("step",)) -> list[dict]:
    """The rows of a CSV file that normlab writes, each value through parse(column, value). A header without
    `columns`, a row cut short (the last line without its newline), with another number of fields than the header,
    or with a value that does not parse raises DamagedTable naming its line (training.run_dir.read_table drops the same
    rows, silently)."""
    lines = Path(path).read_bytes().decode("utf-8", errors="replace").split("\n")
    if lines.pop():
        raise DamagedTable(f"{path}, line {len(lines) + 1}, is cut short (no newline at its end)")
    header = next(csv.reader(lines[:1]), [])
    if lines and (missing := [c for c in columns if c not in header]):
        raise DamagedTable(f"{path}, line 1: the header has no {', '.join(missing)} column")
    rows = []
    for number, line in enumerate(lines[1:], start=2):
        fields = next(csv.reader([line]), [])
        if len(fields) != len(header):
            raise DamagedTable(f"{path}, line {number}, has {len(fields)} fields, its header {len(header)}")
        row = {}
        for column, value in zip(header, fields):
            try:
                row[column] = parse(column, value)
            except ValueError:
                raise DamagedTable(f"{path}, line {number}: {column} '{value[:20]}' is not a number") from None
        rows.append(row)
    return rows


ANGLE_COLUMN_TYPES = {
    **dict.fromkeys(IDENTITY_COLUMNS, str),  # seed too: empty for a Hugging Face model
    "step": int,
    "layer": int,
    "count": int,
    "d": int,
    "site": str,
    "reference": str,
    "position": str,
    "histogram": lambda v: [int(c) for c in v.split()],
}  # any other column: float
OPTIONAL_COLUMNS = ("sem_deg", "null_percentile", "null_random_mean_deg", "null_random_std_deg", "null_directions")
REQUIRED_COLUMNS = tuple(c for c in CSV_COLUMNS if c not in IDENTITY_COLUMNS + OPTIONAL_COLUMNS)  # older files too


def parse_angle_value(column: str, value: str):
    if value == "" and column in OPTIONAL_COLUMNS:
        return None  # no random-direction null (rotation rows, or null_directions=0)
    return ANGLE_COLUMN_TYPES.get(column, float)(value)


def read_csv(path: str | Path) -> list[dict]:
    """angles.csv as dicts of numbers (histogram: a list of counts per degree). Files written before the identity
    and null columns existed read as well, without them."""
    return read_rows(path, parse_angle_value, REQUIRED_COLUMNS)


# -- normlab-angles (conf/angles.yaml): the same statistics for saved normlab checkpoints and local Hugging Face models


def check_positive(name: str, value, null_means: str | None = None) -> None:
    """A positive whole number (or null, when `null_means` says what null stands for)."""
    if value is None and null_means:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        or_null = f", or null for {null_means}" if null_means else ""
        raise AnalysisError(f"{name}={value}: give a positive whole number{or_null}")


def check_null_directions(value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise AnalysisError(f"probe.null_directions={value}: give a whole number of random directions (0: none)")


def device_name(name) -> str:
    """The device of `device=`: null is cuda when torch sees a GPU, else cpu."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(str(name))
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise AnalysisError(f"unknown device={name}: give cpu, cuda or cuda:N")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise AnalysisError(f"device={name}: torch sees {torch.cuda.device_count()} CUDA devices here: give "
                            "device=cpu, or one that it sees")
    return str(name)


@contextmanager
def loading(what: str):
    """An error of transformers reading a model directory, as one line naming what it was reading."""
    try:
        yield
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for damaged files
        raise AnalysisError(f"cannot load {what} ({type(e).__name__}: {str(e).strip().splitlines()[0]})") from None


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_checkpoint(path: Path) -> dict:
    """A normlab checkpoint, memory-mapped: its tensors are read from the file when used."""
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def load_normlab(path: Path, dtype: str = "float32") -> nn.Module:
    """A normlab model from a checkpoint, full or weights only (its config rides in the checkpoint), in `dtype`."""
    from omegaconf import OmegaConf

    from normlab.training.pipeline import build_model

    ckpt = load_checkpoint(path)
    model = build_model(OmegaConf.create(ckpt["hyper_parameters"]["config"]))
    weights = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    model.load_state_dict(weights)
    return model.to(DTYPES[dtype])


def load_hugging_face(path: Path, dtype: str = "float32") -> nn.Module:
    from transformers import AutoModelForCausalLM

    from normlab.interop import hf_rmsnorm_gpt2  # noqa: F401 (registers the model type of normlab-export's RMSNorm models)

    with loading(f"the model in {path}"):
        return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])  # raw weights: nothing folded


def hf_windows(path: Path, probe: torch.Tensor, vocab_size: int, seq_len: int) -> tuple[torch.Tensor, int]:
    """The probe for a Hugging Face model: its text re-tokenized with the model's own tokenizer when the
    directory has one, else the GPT-2 ids themselves (only for a vocabulary of GPT-2's size: any other is another
    tokenizer's, whose ids would be read as the wrong tokens). With the token id that separates its documents."""
    from transformers import AutoTokenizer

    from normlab.data import tokenizer as gpt2

    tokenizer_files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((path / f).exists() for f in tokenizer_files):
        if vocab_size != gpt2.VOCAB_SIZE:
            raise AnalysisError(
                f"{path} has no tokenizer files and a vocabulary of {vocab_size} tokens, not GPT-2's "
                f"{gpt2.VOCAB_SIZE}: add the model's tokenizer files (tokenizer.json, ...) to the directory"
            )
        return probe[:, :seq_len], gpt2.EOT
    with loading(f"the tokenizer in {path}"):
        tok = AutoTokenizer.from_pretrained(path)
    documents = gpt2.gpt2().decode(probe.flatten().tolist()).split("<|endoftext|>")
    separator = tok.eos_token_id or 0
    ids = [t for doc in documents if doc for t in tok(doc)["input_ids"] + [separator]]  # a BOS, if any, after it
    n = min(len(ids) // seq_len, probe.numel() // seq_len)
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len), separator


@dataclass
class Analysis:
    """A path given to normlab-angles, checked and ready to measure."""

    path: Path
    layout: str  # a key of LAYOUTS
    checkpoints: list[tuple[int, Callable[[], nn.Module], dict]]  # (step, what loads its model, identity), by step
    windows: torch.Tensor  # the probe: [sequences, seq_len] token ids
    warnings: list[str]
    separator: int  # the token id between the probe's documents: position first is the token after it


def run_identity(config: dict, source: str) -> dict:
    """The IDENTITY_COLUMNS of a normlab model, from its run's config."""
    return {"run": config["run_name"], "model": config["model"]["name"], "norm": config["norm"]["name"],
            "seed": config["seed"], "source": source}


def checked_seq_len(cfg: DictConfig, path: Path, context: int, context_name: str) -> int:
    """seq_len (null: the model's context, at most 1024), checked against the context and probe.tokens."""
    seq_len = cfg.seq_len or min(1024, context)
    if seq_len > context:
        raise AnalysisError(
            f"seq_len={seq_len} is beyond the context of {path} ({context} tokens, {context_name}): "
            f"give at most {context}"
        )
    if cfg.probe.tokens is not None and cfg.probe.tokens < seq_len:
        raise AnalysisError(
            f"probe.tokens={cfg.probe.tokens} is less than one sequence of {seq_len} tokens: give at least "
            f"{seq_len}, a smaller seq_len, or probe.tokens=null for the whole split"
        )
    return seq_len


def plan_hugging_face(path: Path, cfg: DictConfig) -> Analysis:
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_bytes())
    except ValueError as e:
        raise AnalysisError(f"{config_file} is not valid JSON ({e}): restore the model's config.json") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in LAYOUTS or model_type == "normlab":
        raise AnalysisError(
            f"{path}: model type {model_type} is not supported "
            f"(supported: {', '.join(k for k in LAYOUTS if k != 'normlab')})"
        )
    from transformers import AutoConfig

    from normlab.data.datamodule import load_probe
    from normlab.interop import hf_rmsnorm_gpt2  # noqa: F401 (registers the model type of normlab-export's RMSNorm models)

    with loading(config_file):
        config = AutoConfig.from_pretrained(path)
    context_key = "n_positions" if hasattr(config, "n_positions") else "max_position_embeddings"
    seq_len = checked_seq_len(cfg, path, getattr(config, context_key), f"{context_key} in config.json")
    probe = load_probe(cfg.probe.dir, cfg.probe.split, cfg.probe.tokens, seq_len)
    windows, separator = hf_windows(path, probe, config.vocab_size, seq_len)
    exported = getattr(config, "normlab", None)  # what normlab-export records of the run it exported
    exported = exported if isinstance(exported, dict) else {}
    rms = model_type in ("llama", "normlab_rms_gpt2")
    identity = {"run": exported.get("run", path.resolve().name), "model": model_type,
                "norm": exported.get("norm", "rmsnorm" if rms else "layernorm"), "seed": exported.get("seed", ""),
                "source": str(path.resolve())}
    load = partial(load_hugging_face, path, cfg.get("dtype", "float32"))
    return Analysis(path, model_type, [(exported.get("step", 0), load, identity)], windows, [], separator)


def normlab_probe(checkpoint: Path, path: Path, cfg: DictConfig) -> tuple[dict, torch.Tensor]:
    """The run config a normlab checkpoint carries, and the probe windows of `cfg` for its model (seq_len checked
    against its context; `path`: what the user named, for the error)."""
    from normlab.data.datamodule import load_probe

    config = OmegaConf.to_container(OmegaConf.create(load_checkpoint(checkpoint)["hyper_parameters"]["config"]))
    seq_len = checked_seq_len(cfg, path, config["model"]["block_size"], "model.block_size")
    return config, load_probe(cfg.probe.dir, cfg.probe.split, cfg.probe.tokens, seq_len, config["model"]["vocab_size"])


def plan_normlab(path: Path, cfg: DictConfig) -> Analysis:
    """A checkpoint, or every intact scheduled checkpoint of a run directory (damaged ones: a warning each)."""

    from normlab.training.run_dir import RunDirError, verify

    is_run = path.is_dir()
    checkpoints = sorted((path / "checkpoints").glob("step-*.ckpt")) if is_run else [path]
    if not checkpoints:
        raise AnalysisError(
            f"no checkpoint (.ckpt or <run>/checkpoints/step-*.ckpt) at {path}: give a .ckpt, a run "
            "directory or a Hugging Face model directory (with its config.json)"
        )
    intact, damaged = [], []
    for checkpoint in checkpoints:
        try:
            intact.append((verify(checkpoint).step, checkpoint))
        except RunDirError as e:
            if not is_run:
                raise AnalysisError(f"{e}: give another checkpoint of the run, or the run directory") from None
            damaged.append(str(e))
    if not intact:
        more = f" (and {len(damaged) - 1} more damaged)" if len(damaged) > 1 else ""
        raise AnalysisError(
            f"no intact checkpoint in {path / 'checkpoints'}: {damaged[0]}{more}; restore them from a "
            "copy, or train the run again"
        )
    config, windows = normlab_probe(intact[0][1], path, cfg)
    return Analysis(
        path,
        "normlab",
        [(step, partial(load_normlab, c, cfg.get("dtype", "float32")), run_identity(config, str(c.resolve())))
         for step, c in sorted(intact)],
        windows,
        [f"{reason}: skipped" for reason in damaged],
        EOT,
    )


def plan(path: Path, cfg: DictConfig) -> Analysis:
    if not path.exists():
        raise AnalysisError(f"{path} does not exist: give a .ckpt, a run directory or a Hugging Face model directory")
    if (path / "config.json").is_file():
        return plan_hugging_face(path, cfg)
    return plan_normlab(path, cfg)


def measure_analysis(analysis: Analysis, device: str, batch_size: int, null_directions: int = 0) -> list[dict]:
    """The angle rows of every checkpoint of `analysis`, loading one model at a time."""
    batches = [
        (b.to(device), torch.ones_like(b, dtype=torch.bool, device=device)) for b in analysis.windows.split(batch_size)
    ]
    records = []
    for step, load, identity in analysis.checkpoints:  # one model in memory at a time
        model = load().to(device).eval()
        if analysis.layout == "normlab":
            d, forward = model.config.n_embd, lambda ids, mask, m=model: m.hidden(ids)
        else:
            d = model.config.hidden_size
            forward = lambda ids, mask, m=model: m.base_model(input_ids=ids, attention_mask=mask)  # noqa: E731
        progress = tqdm(batches, desc=f"{analysis.path.name} step {step}", unit="batch")
        stats = measure(forward, norm_sites(model, analysis.layout), d, progress, device, null_directions,
                        analysis.separator)
        records += stats.records(step, identity)
        del model, forward
    return records


def default_name(path: Path) -> str:
    """<folder>/<name>.csv of what is measured: a run as <experiment>/<run>.csv, a checkpoint as
    <experiment>/<run>-<checkpoint>.csv, a Hugging Face model as <its folder>/<model>.csv; rows also carry their source,
    so that even two inputs of the same name share a file without losing rows."""
    path = path.resolve()
    if path.is_file() and path.parent.name == "checkpoints":
        run = path.parent.parent
        return f"{run.parent.name}/{run.name}-{path.stem}.csv"
    return f"{path.parent.name}/{path.stem if path.is_file() else path.name}.csv"


def main(cfg: DictConfig) -> None:
    """normlab-angles (normlab.cli.angles): the angle rows of every intact checkpoint of a run directory, of one
    checkpoint, or of a Hugging Face model directory (`model_path`), on the probe set of `probe=`, into `out`."""
    if OmegaConf.is_missing(cfg, "model_path") or not str(cfg.model_path).strip():
        raise AnalysisError("no model given: model_path=RUN_DIR, model_path=CHECKPOINT.ckpt or "
                            "model_path=HF_MODEL_DIR")
    path = Path(str(cfg.model_path))
    check_positive("seq_len", cfg.seq_len, "the model's context")
    check_positive("probe.tokens", cfg.probe.tokens, "the whole split")
    check_positive("probe.batch_size", cfg.probe.batch_size)
    check_null_directions(cfg.probe.null_directions)
    if cfg.dtype not in DTYPES:
        raise AnalysisError(f"dtype={cfg.dtype}: give one of {', '.join(DTYPES)}")
    device = device_name(cfg.device)
    out = Path(str(cfg.out or Path(cfg.paths.output_dir) / "angles" / default_name(path)))
    try:  # a new file, or an earlier output of normlab-angles (its header): rows of other models are kept
        outputs.check_file(out, "normlab-angles", lambda line: line == ",".join(CSV_COLUMNS),
                           example="angles.csv")
    except outputs.OutputError as e:
        raise AnalysisError(str(e)) from None
    analysis = plan(path, cfg)  # checked before any model runs
    for warning in analysis.warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    records = measure_analysis(analysis, device, cfg.probe.batch_size, cfg.probe.null_directions or 0)
    append_csv(out, records)  # written once measured: a failure leaves no partial output
    count = len(analysis.checkpoints)
    print(f"wrote {out} ({count} checkpoint{'s' * (count > 1)}, {analysis.windows.numel():,} probe tokens)")
