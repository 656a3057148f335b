"""The paired statistics: Student's t (its distribution function, and its quantiles at any level) and the noncentral t
(its distribution function, AS 243), the t-based confidence interval of a mean of paired differences or of a contrast
with a pooled variance, the exact sign test, Holm's step-down test of a family of comparisons with the simultaneous
intervals that match its decisions (Strassburger & Bretz 2008), and the power and smallest detectable difference of
a comparison under the family's rule. Written here, in float64, so that normlab needs no statistics package."""

import math
import statistics
from dataclasses import dataclass, replace

ALPHA = 0.05  # two-sided: 95% intervals
POWER = 0.80  # of the smallest detectable difference
NCT_TERMS = 2000  # AS 243's series: terms at most (it stops at an error bound of 1e-12 long before)


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


def normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def noncentral_t_cdf(t: float, df: float, noncentrality: float) -> float:
    """P(T <= t) for the noncentral t with `df` degrees of freedom and noncentrality `noncentrality`: Lenth's
    algorithm AS 243 (Applied Statistics 38, 1989), the series of incomplete beta functions summed to an error bound
    of 1e-12. With noncentrality 0 it is t_cdf."""
    if t < 0:
        return 1.0 - noncentral_t_cdf(-t, df, -noncentrality)
    x = t * t / (t * t + df)
    total = 0.0
    if x > 0:
        lam = noncentrality * noncentrality
        p = 0.5 * math.exp(-0.5 * lam)
        if p == 0.0:  # exp(-δ²/2) underflows (|δ| > 38): the series cannot start
            return noncentral_t_cdf_by_quadrature(t, df, noncentrality)
        q = math.sqrt(2.0 / math.pi) * p * noncentrality
        s, a, b = 0.5 - p, 0.5, 0.5 * df
        rxb = (1.0 - x) ** b
        log_beta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
        x_odd = regularized_beta(x, a, b)
        g_odd = 2.0 * rxb * math.exp(a * math.log(x) - log_beta)
        x_even, g_even = 1.0 - rxb, b * x * rxb
        total = p * x_odd + q * x_even
        for term in range(1, NCT_TERMS + 1):
            a += 1.0
            x_odd -= g_odd
            x_even -= g_even
            g_odd *= x * (a + b - 1.0) / a
            g_even *= x * (a + b - 0.5) / (a + 0.5)
            p *= lam / (2 * term)
            q *= lam / (2 * term + 1)
            s -= p
            total += p * x_odd + q * x_even
            if 2.0 * s * (x_odd - g_odd) <= 1e-12:
                break
    return min(1.0, max(0.0, total + normal_cdf(-noncentrality)))


def noncentral_t_cdf_by_quadrature(t: float, df: float, noncentrality: float, intervals: int = 20_000) -> float:
    """P(T <= t) as the mean over the chi distribution of U = sqrt(V / df), V ~ chi²(df), of Φ(t U − δ) (Simpson's
    rule on [0, 1 + 12 / sqrt(df)], beyond which U's density is below 1e-30): for noncentralities beyond AS 243's."""
    top = 1.0 + 12.0 / math.sqrt(df)
    step = top / intervals
    log_norm = (df / 2) * math.log(df) - (df / 2 - 1) * math.log(2) - math.lgamma(df / 2)

    def integrand(u: float) -> float:
        if u == 0.0:
            return math.exp(log_norm) * normal_cdf(-noncentrality) if df == 1 else 0.0
        density = math.exp(log_norm + (df - 1) * math.log(u) - df * u * u / 2)
        return density * normal_cdf(t * u - noncentrality)

    total = integrand(0.0) + integrand(top)
    total += sum((4 if k % 2 else 2) * integrand(k * step) for k in range(1, intervals))
    return min(1.0, max(0.0, total * step / 3))


def power(effect: float, se: float, df: int, level: float) -> float:
    """The chance that a two-sided t test at `level` excludes 0 when the true difference is `effect` and its
    standard error `se` (exact: the noncentral t with noncentrality effect / se)."""
    critical, shift = t_quantile(1 - level / 2, df), effect / se
    return 1.0 - noncentral_t_cdf(critical, df, shift) + noncentral_t_cdf(-critical, df, shift)


def detectable_effect(se: float, df: int, level: float, wanted: float = POWER) -> float:
    """The smallest true difference that a two-sided t test at `level` detects with power `wanted` (bisection on
    power, to 1e-10 of se)."""
    low, high = 0.0, se
    while power(high, se, df, level) < wanted:
        low, high = high, 2 * high
    while high - low > 1e-10 * se:
        middle = (low + high) / 2
        low, high = (middle, high) if power(middle, se, df, level) < wanted else (low, middle)
    return (low + high) / 2


@dataclass(frozen=True)
class Interval:
    """An estimate (a mean of paired differences, or a contrast of cell means) with its standard error on `df`
    degrees of freedom, its 95% t interval and two-sided p against 0 and, once its family of `family_size`
    comparisons is known (simultaneous), its simultaneous interval (sim_low, sim_high: all of the family's hold
    together with 95% confidence, and one excludes 0 exactly where Holm's test rejects) and Holm-adjusted p. None
    where a single pair leaves no spread."""
    n: int  # seeds
    mean: float
    sd: float | None  # of the paired differences (a pooled contrast: its residual sd)
    low: float | None
    high: float | None
    se: float | None = None
    df: int | None = None
    p: float | None = None
    sim_low: float | None = None
    sim_high: float | None = None
    holm_p: float | None = None
    family_size: int = 1

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
    def adjusted_level(self) -> float:
        """The two-sided level at which Holm's test is sure to reach this comparison whatever the others' p-values:
        its first step's, ALPHA / family_size (a p below it is rejected at whatever rank it has)."""
        return ALPHA / self.family_size

    @property
    def detectable(self) -> float | None:
        """The smallest true difference that this many seeds, at the observed spread, would find excluding 0 after
        Holm with POWER at least (a t test at adjusted_level; exact noncentral t)."""
        return None if self.se is None or self.se == 0 else detectable_effect(self.se, self.df, self.adjusted_level)

    def power_at(self, effect: float) -> float | None:
        """The chance at least that a true difference `effect` would be found excluding 0 after Holm."""
        return None if self.se is None or self.se == 0 else power(effect, self.se, self.df, self.adjusted_level)

    def number(self, value: float, sign: str = "+") -> str:
        """A number on this interval's scale: 4 decimals, or 2 significant digits where the whole interval lies
        within ±5e-4, which 4 decimals would print as -0.0000 [-0.0000, +0.0000] (a control's rounding floor)."""
        ends = [abs(v) for v in (self.mean, self.low, self.high, self.sim_low, self.sim_high) if v is not None]
        return f"{value:{sign}.1e}" if 0 < max(ends) < 5e-4 else f"{value:{sign}.4f}"

    def text(self, over: str = "") -> str:
        """The mean and its interval; `over`: what was resampled ("2 seeds"), said beside the interval."""
        if self.low is None:
            return f"{self.number(self.mean)} (1 pair: no interval)"
        return (f"{self.number(self.mean)} [{self.number(self.low)}, {self.number(self.high)}]"
                + (f" (t over {over})" if over else ""))

    def range_text(self, low: float | None, high: float | None) -> str:
        return "—" if low is None else f"[{self.number(low)}, {self.number(high)}]"

    def simultaneous_text(self) -> str:
        """The simultaneous interval and the Holm-adjusted p: 'simultaneous [a, b], Holm p 0.08'."""
        if self.sim_low is None:
            return "no simultaneous interval"
        return f"simultaneous {self.range_text(self.sim_low, self.sim_high)}, Holm p {self.holm_p:.3g}"

    def detectable_text(self) -> str:
        """'±x': the smallest difference detected after Holm with POWER (detectable), '—' without a spread."""
        return "—" if self.detectable is None else f"±{self.number(self.detectable, '')}"


def holm_adjusted(p_values: list[float]) -> list[float]:
    """Holm's adjusted p-values: ordered by p, the i-th (from 0) of m is max over the ones before of (m - i) p."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [1.0] * len(p_values), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def one_sided_p(x: Interval, upward: bool) -> float:
    """p of the one-sided t test of "the difference is at most 0" (upward) or "at least 0"."""
    if x.se == 0:
        return 0.0 if (x.mean > 0 if upward else x.mean < 0) else 1.0
    return 1.0 - t_cdf(x.mean / x.se, x.df) if upward else t_cdf(x.mean / x.se, x.df)


def bounds(family: list[Interval], upward: bool) -> tuple[list[float], list[float]]:
    """Holm at ALPHA / 2 over the family's one-sided hypotheses of one direction ("at most 0" for upward) and the
    bounds that match its decisions (Strassburger & Bretz 2008, Guilbaud 2008): where it rejects some but not all,
    a rejected one's bound is 0 and a retained one's is its estimate minus its t at ALPHA / 2 / (the number
    retained) times se; where it rejects all, each bound is the larger of 0 and its estimate minus t at
    ALPHA / 2 / m; where it rejects none, each is at ALPHA / 2 / m. (adjusted one-sided p, bound), each as a lower
    bound of the difference turned to face this direction."""
    sign = 1.0 if upward else -1.0
    adjusted = holm_adjusted([one_sided_p(x, upward) for x in family])
    rejected = [p < ALPHA / 2 for p in adjusted]
    retained = len(family) - sum(rejected)
    found = []
    for x, rejects in zip(family, rejected):
        if rejects and retained:
            found.append(0.0)
            continue
        bound = sign * x.mean - t_quantile(1 - ALPHA / 2 / (retained or len(family)), x.df) * x.se
        found.append(max(0.0, bound) if not retained else bound)
    return [min(1.0, 2 * p) for p in adjusted], found


def simultaneous(intervals: list[Interval]) -> list[Interval]:
    """The family's simultaneous intervals and Holm-adjusted p-values. The family's rule is Holm's test in each
    direction at ALPHA / 2 (two one-sided families: together a family-wise error of at most ALPHA under any
    dependence); where every estimate has one sign it is Holm's two-sided test at ALPHA exactly. The lower (upper)
    ends are the bounds that match the upward (downward) decisions, so all intervals hold together with 95%
    confidence and one excludes 0 exactly where its Holm p is below ALPHA; a comparison's Holm p is twice its
    one-sided adjusted p in its estimate's direction. Intervals without a spread (one pair) are not in the family
    and come back as they are."""
    tested = [i for i, x in enumerate(intervals) if x.p is not None]
    family = [intervals[i] for i in tested]
    up_p, lows = bounds(family, upward=True)
    down_p, highs = bounds(family, upward=False)
    adjusted = list(intervals)
    for k, index in enumerate(tested):
        x = family[k]
        holm_p = up_p[k] if x.mean > 0 else down_p[k] if x.mean < 0 else min(1.0, min(up_p[k], down_p[k]))
        adjusted[index] = replace(x, sim_low=lows[k], sim_high=-highs[k], holm_p=holm_p, family_size=len(family))
    return adjusted
