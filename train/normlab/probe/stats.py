"""Streaming statistics of many angle series at once, one row per (layer, site, reference, position): count, mean,
M2 (Welford/Chan, float64), min, max, a 1-degree histogram, the mean norm of the vectors and the mean cos^2 of the
angle (the share of their squared norm that lies along the reference); mergeable across batches and DDP ranks, so
memory does not depend on the number of tokens.

Two nulls. One random direction makes 90 +- (180/pi)/sqrt(d) degrees with any fixed vector (null_mean_deg,
null_std_deg): the spread of single angles. Whether 1 is special is asked of the MEAN angle: the same mean is taken
for `null_directions` seeded random directions (uniform on the sphere), and a row holds where its reference's mean
falls among theirs (null_percentile: the share of random directions with a smaller mean angle, in percent) and
their mean and spread (null_random_mean_deg, null_random_std_deg). The directions' mean angles themselves
(null_random_means_deg, to 1e-5 degree) go on the uniform row at position all only: they are the same for the three
references of a row (the vectors are), and the largest-of-sites null and the seed-level scale (probe.extremes) read
them there. The null of mean_cos2 is 1/d on average over directions; each direction's own mean cos^2 (its share
of the squared norm, null_random_cos2, to 7 significant digits) goes beside those means, for the sign-invariant
statistic and the share's percentile (probe.shares).
"""

import math

import torch
import torch.distributed as dist

from normlab.probe.table import IDENTITY_COLUMNS

BINS = 180  # 1-degree histogram over [0, 180]
# 1e-5 degree: over N independent tokens the spread of a mean angle over directions would be (180/pi)/sqrt(dN), 0.0018
# degree at 1M tokens and d=1024 (0.0009 at d=4096; dependent tokens spread more), so the rounding (at most 5e-6
# degree) changes a z by under 0.3% (0.6%)
MEANS_DECIMALS = 5
# the mean and spread of those means, to 1e-9 degree: far below any difference that matters, and above the last bits
# that a process's choice of floating-point kernel can change, so that two runs of one seed write the same bytes
NULL_DECIMALS = 9
# a mean cos^2 over N independent tokens spreads over directions by about sqrt(2/N) of itself (cos^2 ~ chi^2_1 / d),
# 0.0014 at 1M tokens: 7 significant digits (rounding at most 5e-7 of it) move a z by under 0.04%
COS2_DIGITS = 7


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
        self.null_cos2_sum = zeros(len(rows), null_directions)  # and of their cos^2

    TENSORS = ("count", "mean", "m2", "min", "max", "hist", "norm_sum", "cos2_sum", "null_sum", "null_cos2_sum")
    PER_DIRECTION = ("null_sum", "null_cos2_sum")  # null_directions columns a row

    def update_null(self, idx: torch.Tensor, sums: torch.Tensor, cos2_sums: torch.Tensor) -> None:
        """Add sums[k, j], the sum of angles (degrees) of row idx[k]'s vectors to random direction j, and
        cos2_sums[k, j], the sum of their cos^2."""
        self.null_sum[idx] += sums.double()
        self.null_cos2_sum[idx] += cos2_sums.double()

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
        self.null_cos2_sum += other.null_cos2_sum
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
        widths = [BINS if t == "hist" else null_directions if t in cls.PER_DIRECTION else 1 for t in cls.TENSORS]
        for name, part in zip(cls.TENSORS, flat.split(widths, 1)):
            setattr(stats, name, part.clone() if name == "hist" or name in cls.PER_DIRECTION else part.squeeze(1))
        return stats

    def records(self, step: int, identity: dict | None = None) -> list[dict]:
        """One CSV row per statistics row that saw tokens; `identity`: the IDENTITY_COLUMNS of what was measured."""
        null_std = math.degrees(1 / math.sqrt(self.d))
        count, mean, m2, hist = self.count.cpu(), self.mean.cpu(), self.m2.cpu(), self.hist.cpu().long()
        random_means = self.null_sum.cpu() / count.clamp_min(1)[:, None]  # [rows, directions]
        random_cos2 = self.null_cos2_sum.cpu() / count.clamp_min(1)[:, None]
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
                   "histogram": " ".join(map(str, hist[i].tolist())),  # counts per degree, 0..180
                   "null_random_means_deg": "", "null_random_cos2": ""}
            if self.null_directions and not site.endswith(".rotation"):
                means = random_means[i]
                below = (means < mean[i]).sum().item() + 0.5 * (means == mean[i]).sum().item()
                row.update(null_percentile=100 * below / self.null_directions,
                           null_random_mean_deg=round(means.mean().item(), NULL_DECIMALS),
                           null_random_std_deg=round(means.std().item(), NULL_DECIMALS) if self.null_directions > 1
                           else 0.0,
                           null_directions=self.null_directions)
                if reference == "uniform" and position == "all":
                    row["null_random_means_deg"] = " ".join(f"{m:.{MEANS_DECIMALS}f}" for m in means.tolist())
                    row["null_random_cos2"] = " ".join(f"{c:.{COS2_DIGITS}g}" for c in random_cos2[i].tolist())
            out.append(row)
        return out
