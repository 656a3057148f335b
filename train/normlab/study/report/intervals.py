"""The paired statistics: Student's t (its distribution function, and its quantiles at any level), the t-based
confidence interval of a mean of paired differences or of a contrast with a pooled variance, the exact sign test, the
smallest difference a comparison could detect, and Holm's step-down correction of a family of comparisons. Written
here, in float64, so that normlab needs no statistics package."""

import math
import statistics
from dataclasses import dataclass, replace

ALPHA = 0.05  # two-sided: 95% intervals
POWER = 0.80  # of the smallest detectable difference


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, by its continued fraction (modified Lentz), on the side
    where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - regularized_beta(1.0 - x, b, a)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny, f, c, d = 1e-300, 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            numerator = 1.0
        elif i % 2:
            numerator = -((a + m) * (a + b + m) * x) / ((a + 2 * m) * (a + 2 * m + 1))
        else:
            numerator = (m * (b - m) * x) / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1.0 + numerator * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + numerator / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1.0 - c * d) < 1e-15:
            break
    return front * (f - 1.0)


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * regularized_beta(df / (df + t * t), df / 2, 0.5)
    return 1.0 - tail if t > 0 else tail


def t_quantile(level: float, df: float) -> float:
    """The `level` quantile of Student's t (bisection on t_cdf, to 1e-12)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"a quantile level must be in (0, 1), got {level}")
    if level < 0.5:
        return -t_quantile(1.0 - level, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < level:
        low, high = high, high * 2
    while high - low > 1e-12 * max(1.0, high):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(middle, df) < level else (low, middle)
    return (low + high) / 2


def t_quantile_975(df: int) -> float:
    return t_quantile(1 - ALPHA / 2, df)


def two_sided_p(t: float, df: float) -> float:
    return regularized_beta(df / (df + t * t), df / 2, 0.5)


def sign_test_p(above: int, n: int) -> float:
    """The exact two-sided sign test: the chance, were each seed's sign a fair coin, of a split at least as uneven as
    `above` of `n` (3 of 3: 0.25)."""
    extreme = max(above, n - above)
    tail = sum(math.comb(n, k) for k in range(extreme, n + 1)) / 2**n
    return min(1.0, 2 * tail)


@dataclass(frozen=True)
class Interval:
    """An estimate (a mean of paired differences, or a contrast of cell means) with its standard error on `df`
    degrees of freedom, its 95% t interval, two-sided p against 0 and, once its family is known (holm), the Holm-
    adjusted twin: the interval at its step of Holm's procedure, and the adjusted p. None where a single pair
    leaves no spread."""
    n: int  # seeds
    mean: float
    sd: float | None  # of the paired differences (a pooled contrast: its residual sd)
    low: float | None
    high: float | None
    se: float | None = None
    df: int | None = None
    p: float | None = None
    holm_low: float | None = None
    holm_high: float | None = None
    holm_p: float | None = None

    @classmethod
    def of(cls, values: list[float]) -> "Interval":
        mean = statistics.fmean(values)
        if len(values) < 2:
            return cls(len(values), mean, None, None, None)
        sd = statistics.stdev(values)
        return cls.with_se(len(values), mean, sd, sd / math.sqrt(len(values)), len(values) - 1)

    @classmethod
    def with_se(cls, n: int, mean: float, sd: float, se: float, df: int) -> "Interval":
        half = t_quantile_975(df) * se
        p = two_sided_p(mean / se, df) if se > 0 else (1.0 if mean == 0 else 0.0)
        return cls(n, mean, sd, mean - half, mean + half, se, df, p)

    @property
    def excludes_zero(self) -> bool | None:
        return None if self.low is None else self.low > 0 or self.high < 0

    @property
    def holm_excludes_zero(self) -> bool | None:
        return None if self.holm_p is None else self.holm_p < ALPHA

    @property
    def detectable(self) -> float | None:
        """The smallest true difference this many seeds would detect with POWER at ALPHA (two-sided), at the
        observed spread: (t_(1-alpha/2) + t_power) x se, the usual approximation of the noncentral t."""
        if self.se is None:
            return None
        return (t_quantile_975(self.df) + t_quantile(POWER, self.df)) * self.se

    def number(self, value: float, sign: str = "+") -> str:
        """A number on this interval's scale: 4 decimals, or 2 significant digits where the whole interval lies
        within ±5e-4, which 4 decimals would print as -0.0000 [-0.0000, +0.0000] (a control's rounding floor)."""
        ends = [abs(v) for v in (self.mean, self.low, self.high, self.holm_low, self.holm_high) if v is not None]
        return f"{value:{sign}.1e}" if 0 < max(ends) < 5e-4 else f"{value:{sign}.4f}"

    def text(self, over: str = "") -> str:
        """The mean and its interval; `over`: what was resampled ("2 seeds"), said beside the interval."""
        if self.low is None:
            return f"{self.number(self.mean)} (1 pair: no interval)"
        return (f"{self.number(self.mean)} [{self.number(self.low)}, {self.number(self.high)}]"
                + (f" (t over {over})" if over else ""))

    def holm_text(self) -> str:
        """The Holm-adjusted twin: '[a, b], p_Holm 0.08'."""
        if self.holm_low is None:
            return "no Holm interval"
        return f"Holm [{self.number(self.holm_low)}, {self.number(self.holm_high)}], p {self.holm_p:.3g}"

    def detectable_text(self) -> str:
        """'±x': the smallest difference detected with POWER (detectable), '—' without a spread."""
        return "—" if self.detectable is None else f"±{self.number(self.detectable, '')}"


def holm(intervals: list[Interval]) -> list[Interval]:
    """Holm's step-down correction of one family: ordered by p, the i-th (from 0) of m is tested at ALPHA / (m - i),
    its interval taken at that level, and its adjusted p is the running maximum of (m - i) p. Intervals without a
    spread (one pair) are not in the family and come back as they are."""
    tested = sorted((i for i, x in enumerate(intervals) if x.p is not None), key=lambda i: intervals[i].p)
    m, running, adjusted = len(tested), 0.0, list(intervals)
    for rank, index in enumerate(tested):
        x = intervals[index]
        running = max(running, min(1.0, (m - rank) * x.p))
        half = t_quantile(1 - ALPHA / (2 * (m - rank)), x.df) * x.se
        adjusted[index] = replace(x, holm_low=x.mean - half, holm_high=x.mean + half, holm_p=running)
    return adjusted
