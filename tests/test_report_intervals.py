"""The family's statistics on planted cases whose answer is known: the noncentral t against simulation, power and the
smallest detectable difference under the verdict's rule (excludes 0 after Holm), and simultaneous intervals that hold
together at 95% and exclude 0 exactly where Holm's test rejects, on the issue's worked numbers and planted families."""

import math

import numpy as np
import pytest

from normlab.study.report.intervals import (
    ALPHA,
    POWER,
    Interval,
    detectable_effect,
    holm_adjusted,
    noncentral_t_cdf,
    noncentral_t_cdf_by_quadrature,
    power,
    simultaneous,
    t_cdf,
    t_quantile,
    two_sided_p,
)


def noncentral_t_draws(rng, df: int, noncentrality: float, count: int) -> np.ndarray:
    return (rng.normal(size=count) + noncentrality) / np.sqrt(rng.chisquare(df, size=count) / df)


@pytest.mark.parametrize("df, noncentrality, t", [(2, 3.0, 4.3), (5, 1.5, 2.0), (15, -1.0, 0.5), (30, 2.5, -0.3),
                                                  (3, 8.0, 6.0), (1, 60.0, 127.0), (3, 45.0, 40.0)])
def test_noncentral_t_matches_a_simulation_and_is_student_t_at_noncentrality_0(df, noncentrality, t):
    """The last two lie beyond AS 243's series (exp(-δ²/2) underflows): the quadrature over the chi distribution
    takes them, and agrees with the series where both work."""
    draws = noncentral_t_draws(np.random.default_rng(df), df, noncentrality, 400_000)
    assert noncentral_t_cdf(t, df, noncentrality) == pytest.approx(np.mean(draws <= t), abs=0.003)
    assert noncentral_t_cdf(t, df, 0.0) == pytest.approx(t_cdf(t, df), abs=1e-12)
    if abs(noncentrality) < 30:
        assert noncentral_t_cdf_by_quadrature(t, df, noncentrality) == pytest.approx(
            noncentral_t_cdf(t, df, noncentrality), abs=1e-10)


def test_the_issues_power_figures_under_holm_and_the_exact_2_df_figure():
    """The norm_arms centring effect (se 0.01008 on 15 df, a family of 6): 80% power at ±0.0302 alone, but a test at
    0.05/6 (where Holm is sure to reach it) needs 0.039-0.040, and at 0.0302 has about even chances. DyT's 3 seeds
    (2 df): the t-quantile formula's 0.0807 is 0.0851 by the exact noncentral t."""
    se = 0.010080630086505893
    assert detectable_effect(se, 15, ALPHA) == pytest.approx(0.0302, abs=5e-5)
    assert 0.039 < detectable_effect(se, 15, ALPHA / 6) < 0.040
    assert 0.45 < power(0.0302, se, 15, ALPHA / 6) < 0.55
    dyt = (1.4263 - 1.2968) / 2 / t_quantile(0.975, 2)
    assert (t_quantile(0.975, 2) + t_quantile(POWER, 2)) * dyt == pytest.approx(0.0807, abs=5e-5)
    assert detectable_effect(dyt, 2, ALPHA) == pytest.approx(0.0851, abs=5e-5)


def test_the_detectable_difference_is_found_after_holm_four_times_in_five_or_more():
    """Simulated studies of a family of 4 paired comparisons (6 seeds each), one at the reported detectable
    difference and three at 0: the first is found excluding 0 after Holm in at least 80% of them (the rule can reach
    it at a later step too, so a little more), and the family-wise error on the three stays under 5%."""
    rng, n, sd, studies = np.random.default_rng(0), 6, 0.01, 2000
    effect = Interval.with_se(n, 0.0, sd, sd / math.sqrt(n), n - 1)
    effect = simultaneous([effect] * 4)[0].detectable
    found = false_claims = 0
    for _ in range(studies):
        family = [Interval.of(list(rng.normal(mean, sd, n))) for mean in (effect, 0.0, 0.0, 0.0)]
        adjusted = simultaneous(family)
        found += adjusted[0].holm_excludes_zero
        false_claims += any(x.holm_excludes_zero for x in adjusted[1:])
    assert 0.78 < found / studies < 0.86
    assert false_claims / studies < 0.05 + 0.012


def test_the_last_ranked_comparison_whose_raw_interval_excludes_0_is_not_claimed_after_holm():
    """Three comparisons with p 0.030, 0.035 and 0.040: each 95% interval excludes 0, but Holm tests the first at
    0.05/3 and stops, so none is rejected; the simultaneous intervals (each at 0.05/3 here) all include 0. The
    interval once called Holm's gave the last-ranked its raw one, which excluded 0."""
    family = [Interval.with_se(6, mean, 0.01, 0.01 / math.sqrt(6), 5) for mean in (0.012259, 0.011716, 0.011253)]
    assert [round(x.p, 3) for x in family] == [0.030, 0.035, 0.040] and all(x.excludes_zero for x in family)
    adjusted = simultaneous(family)
    assert all(not x.holm_excludes_zero and x.sim_low < 0 < x.sim_high for x in adjusted)
    half = t_quantile(1 - ALPHA / 6, 5) * 0.01 / math.sqrt(6)  # none rejected: every bound at 0.05 / (2 x 3)
    assert [x.sim_low for x in adjusted] == pytest.approx([x.mean - half for x in family], abs=1e-12)
    assert [x.sim_high for x in adjusted] == pytest.approx([x.mean + half for x in family], abs=1e-12)


def test_the_issues_centring_family_bonferroni_where_holm_rejects_nothing_below_and_0_where_it_rejects():
    """norm_arms' family of 6: DyT − LayerNorm is rejected upward, the other five are not. Their upper ends are
    Bonferroni's at 6 (centring +0.0243, the issue's figure); their lower ends are at 0.05/(2 x 5), the five retained
    (centring -0.0360, inside Bonferroni's -0.0369); DyT's lower end is 0, all that Holm's decision says."""
    estimates = [(-0.006317516167958577, 0.010080630086505893, 15), (0.006765981515248616, 0.010080630086505893, 15),
                 (-0.014334003130594889, 0.020161260173011786, 15), (-0.013484517733256022, 0.014256171, 15),
                 (0.0008, 0.014256171, 15), (1.3616, 0.015050955, 2)]
    family = [Interval.with_se(6, mean, se * math.sqrt(6), se, df) for mean, se, df in estimates]
    centring, *_, dyt = simultaneous(family)
    assert (round(centring.sim_low, 4), round(centring.sim_high, 4)) == (-0.0360, 0.0243)
    bonferroni = t_quantile(1 - ALPHA / 12, 15) * 0.010080630086505893
    assert centring.sim_high == pytest.approx(centring.mean + bonferroni, abs=1e-12)
    assert round(centring.mean - bonferroni, 4) == -0.0369 and centring.mean - bonferroni < centring.sim_low
    assert dyt.sim_low == 0.0 and dyt.holm_excludes_zero and dyt.holm_p == pytest.approx(6 * dyt.p)


def test_simultaneous_intervals_cover_together_and_agree_with_holm_on_random_families():
    """Families of 5 with planted effects of both signs and of none: all five intervals hold the true differences
    together in at least 95% of studies; an interval excludes 0 exactly where its Holm p is below 0.05, which
    no end lies beyond Bonferroni's but a rejected one's 0 (the price
    of matching Holm: that end says what the decision says, no more)."""
    rng, n, sd, studies = np.random.default_rng(1), 6, 0.01, 2000
    truth = [0.012, -0.009, 0.0, 0.0, 0.004]
    covered = 0
    for _ in range(studies):
        family = simultaneous([Interval.of(list(rng.normal(mean, sd, n))) for mean in truth])
        covered += all(x.sim_low <= mean <= x.sim_high for x, mean in zip(family, truth))
        for x in family:
            assert (x.sim_low > 0 or x.sim_high < 0 or (x.sim_low == 0 and x.mean > 0) or
                    (x.sim_high == 0 and x.mean < 0)) == x.holm_excludes_zero
            wide = t_quantile(1 - ALPHA / 10, x.df) * x.se  # Bonferroni's; a rejected one's near end is 0
            assert x.mean - wide - 1e-12 <= x.sim_low or (x.sim_low == 0 and x.holm_excludes_zero)
            assert x.sim_high <= x.mean + wide + 1e-12 or (x.sim_high == 0 and x.holm_excludes_zero)
    assert covered / studies >= 0.95 - 0.008


def test_holm_in_each_direction_is_holms_two_sided_test_where_the_estimates_share_a_sign():
    """The family's rule is Holm at 0.025 in each direction; where every estimate has one sign it is Holm's
    two-sided test at 0.05 exactly, p-values and all; with both signs it can differ (each direction ranks its own)."""
    rng = np.random.default_rng(2)
    for _ in range(200):
        means = np.abs(rng.normal(0.006, 0.006, 4)) * rng.choice([-1, 1])
        family = [Interval.with_se(6, float(m), 0.01, 0.01 / math.sqrt(6), 5) for m in means]
        assert [x.holm_p for x in simultaneous(family)] == pytest.approx(holm_adjusted([x.p for x in family]),
                                                                        abs=1e-12)


def test_a_family_of_one_is_its_95_interval_and_holm_p_its_p():
    (alone,) = simultaneous([Interval.of([0.02, 0.025, 0.01, 0.03])])
    assert (alone.sim_low, alone.sim_high) == pytest.approx((alone.low, alone.high), abs=1e-12)
    assert alone.holm_p == pytest.approx(two_sided_p(alone.mean / alone.se, alone.df))
    assert simultaneous([Interval.of([0.1])])[0].holm_p is None  # one pair: no interval, not in the family
