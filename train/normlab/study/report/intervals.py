"""The paired comparison's statistics: the 0.975 quantile of Student's t and the t-based 95% confidence interval of a
mean of paired differences."""

import math
import statistics
from dataclasses import dataclass

# The 0.975 quantile of Student's t for 1..30 degrees of freedom (beyond: Hill's expansion, t_quantile_975)
T_975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604,
         2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
         2.0518, 2.0484, 2.0452, 2.0423)
Z_975 = 1.959963984540054


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t: the table to 30 degrees of freedom, then the Cornish-Fisher expansion
    about the normal quantile (G. W. Hill 1970; within 1e-7 of the exact value from 30 on)."""
    if df <= len(T_975):
        return T_975[df - 1]
    z = Z_975
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


@dataclass(frozen=True)
class Interval:
    """The mean of paired differences with its t-based 95% confidence interval (None for a single pair)."""
    n: int
    mean: float
    sd: float | None
    low: float | None
    high: float | None

    @classmethod
    def of(cls, values: list[float]) -> "Interval":
        mean = statistics.fmean(values)
        if len(values) < 2:
            return cls(len(values), mean, None, None, None)
        sd = statistics.stdev(values)
        half = t_quantile_975(len(values) - 1) * sd / math.sqrt(len(values))
        return cls(len(values), mean, sd, mean - half, mean + half)

    @property
    def excludes_zero(self) -> bool | None:
        return None if self.low is None else self.low > 0 or self.high < 0

    def text(self, over: str = "") -> str:
        """The mean and its interval; `over`: what was resampled ("2 seeds"), said beside the interval."""
        if self.low is None:
            return f"{self.mean:+.4f} (1 pair: no interval)"
        return f"{self.mean:+.4f} [{self.low:+.4f}, {self.high:+.4f}]" + (f" (t over {over})" if over else "")
