"""The share of the squared norm along 1 against random directions, blind to the sign of the 1-component. The signed
statistic (probe.extremes) averages each seed's mean angle to 1 over the seeds, so seeds whose 1-components point
opposite ways (85.5 and 91.5 degrees) cancel there. A mean cos^2 does not change with that sign; it is set against
each seed's own random directions, then combined over the seeds. With seeds r = 1..R, sites s and random directions
j = 1..J (the same directions in every run of a width d):

- c_r(s): seed r's mean cos^2 of its inputs' angle to 1 (mean_cos2: the share of ||x||^2 along 1); C_r(s, j): the
  same for direction j (null_random_cos2).
- z_r(s) = (c_r(s) - mean_j C_r(s, j)) / sd_j C_r(s, j): seed r against its own directions.
- Z(s) = sum_r z_r(s) / sqrt(R) (Stouffer): the seeds combined with equal weights.
- Z_j(s): the same with direction j in place of 1, each seed's mean and sd taken over the other J - 1 directions
  (leave-one-out, as in probe.extremes), the direction being the same in every seed as 1 is.
- T = max_s |Z(s)|, T_j = max_s |Z_j(s)|, p_max = (1 + #{j: T_j >= T}) / (1 + J): the largest of the S sites
  against the largest of a random direction's, so choosing the largest site is accounted for and the dependence
  between sites kept. Two-sided: 1 holding less than random directions would be as special as holding more (the
  sign of Z says which). The cos^2 of random directions is skewed; the null is theirs, so no normality is assumed.
- The share at a site, S(s) = mean_r c_r(s), and its percentile among the directions' S_j(s) = mean_r C_r(s, j)
  (the percent of directions with a smaller share, ties counted half): where the share stands among random
  directions at that one site, not corrected for choosing the site (p_max is).
"""

import math
from dataclasses import dataclass

import numpy as np

from normlab.probe.extremes import LargestOfSites, Unavailable, largest_against_null, leave_one_out_sd, measured

COLUMN = "null_random_cos2"


@dataclass(frozen=True)
class ShareExtremes(LargestOfSites):
    """The sign-invariant largest-of-sites statistic of the runs' mean cos^2 along 1, and each site's share with its
    percentile among random directions (seed level)."""
    z: dict[tuple, float]  # Z(s), per site in site order
    site: tuple  # the site of the largest |Z|
    p_max: float
    threshold: float | None  # the |Z| the largest must exceed for p_max <= 0.05; None: too few directions
    directions: int
    runs: int
    share: dict[tuple, float]  # S(s): the runs' average share along 1
    percentile: dict[tuple, float]  # of S(s) among the directions' S_j(s), percent
    null_median: dict[tuple, float]  # the median over directions of S_j(s)
    steps: set[int]


def stouffer_z(targets: np.ndarray, null: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """targets [R, S] (1's mean cos^2 per run and site), null [R, S, J] (direction j's): (Z [S], Z_j [S, J])."""
    runs, directions = null.shape[0], null.shape[2]
    mean, sd = null.mean(axis=2), null.std(axis=2, ddof=1)
    z = ((targets - mean) / sd).sum(axis=0) / math.sqrt(runs)
    others_mean = (directions * mean[..., None] - null) / (directions - 1)
    null_z = ((null - others_mean) / leave_one_out_sd(null)).sum(axis=0) / math.sqrt(runs)
    return z, null_z


def share_extremes(tables: list[list[dict]], labels: list[str], io: str = "input",
                   step: int | None = None) -> ShareExtremes | Unavailable:
    """The statistic of the module's docstring for the runs' angle rows (one table per run, `labels` naming them),
    at each site's input (or output) over all positions at `step` (default: each run's last measured step);
    Unavailable where a run lacks null_random_cos2 or the runs' directions differ."""
    found = measured(tables, labels, io, "uniform", step, target="mean_cos2", column=COLUMN)
    if isinstance(found, Unavailable):
        return found
    z, null_z = stouffer_z(found.targets, found.null)
    p_max, threshold = largest_against_null(np.abs(z).max(), np.abs(null_z).max(axis=0))
    share, null_shares = found.targets.mean(axis=0), found.null.mean(axis=0)  # [S], [S, J]
    below = (null_shares < share[:, None]).sum(axis=1) + 0.5 * (null_shares == share[:, None]).sum(axis=1)
    keys = found.keys
    return ShareExtremes(
        z=dict(zip(keys, z.tolist())),
        site=keys[int(np.abs(z).argmax())],
        p_max=p_max,
        threshold=threshold,
        directions=found.null.shape[2],
        runs=len(tables),
        share=dict(zip(keys, share.tolist())),
        percentile=dict(zip(keys, (100 * below / found.null.shape[2]).tolist())),
        null_median=dict(zip(keys, np.median(null_shares, axis=1).tolist())),
        steps=found.steps,
    )
