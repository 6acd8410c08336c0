"""Statistics of an ablation table: mean ± t-interval over seeds, Welch's interval of a
difference. Pure functions of lists of floats; no scipy (it is not a dependency).

    mean_interval(xs)        mean ± t_{(1+level)/2, n-1} · s / √n          (Student)
    welch_interval(a, b)     (b̄ − ā) ± t_{(1+level)/2, ν} · √(s_a²/n_a + s_b²/n_b),
                             ν = (s_a²/n_a + s_b²/n_b)² / ((s_a²/n_a)²/(n_a−1) + (s_b²/n_b)²/(n_b−1))
                             (Welch–Satterthwaite; ν need not be an integer)

The t quantile inverts the Student-t CDF, written with the regularised incomplete beta
function I_x(a, b) (continued fraction, Lentz's method) and found by bisection:

    P(T ≤ t) = 1 − ½ · I_{ν/(ν+t²)}(ν/2, ½)      for t ≥ 0

With fewer than two values there is no interval (half_width is NaN): a table then shows
the mean alone and marks nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Interval:
    """Mean of n values with the half-width of its confidence interval (NaN when n < 2)."""

    mean: float
    half_width: float
    n: int
    std: float
    """Sample standard deviation (ddof = 1; NaN when n < 2)."""

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width


@dataclass(frozen=True)
class Difference:
    """b̄ − ā with Welch's confidence interval; `excludes_zero` marks a supported difference."""

    diff: float
    low: float
    high: float
    df: float
    """Welch–Satterthwaite degrees of freedom (NaN when undefined)."""

    @property
    def excludes_zero(self) -> bool:
        return math.isfinite(self.low) and math.isfinite(self.high) and (self.low > 0 or self.high < 0)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) for a, b > 0 and 0 ≤ x ≤ 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with `df` (> 0, real) degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T ≤ t) = p (0 < p < 1), by bisection on the CDF to ~1e-12."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
        if hi > 1e12:
            return math.inf
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def _mean_var(xs: Sequence[float]) -> tuple:
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else math.nan
    return mean, var


def mean_interval(values: Sequence[float], level: float = 0.95) -> Optional[Interval]:
    """Mean ± Student-t half-width over `values` (None when empty; NaN half-width when n < 2)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return None
    n = len(xs)
    mean, var = _mean_var(xs)
    if n < 2:
        return Interval(mean=mean, half_width=math.nan, n=1, std=math.nan)
    half = t_quantile(0.5 + level / 2.0, n - 1) * math.sqrt(var / n)
    return Interval(mean=mean, half_width=half, n=n, std=math.sqrt(var))


def welch_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Optional[Difference]:
    """Interval of mean(b) − mean(a) by Welch's t (None unless both have >= 2 values).

    Both samples constant (zero variance): the difference is exact, low = high = diff.
    """
    xa = [float(v) for v in a if v is not None and math.isfinite(float(v))]
    xb = [float(v) for v in b if v is not None and math.isfinite(float(v))]
    if len(xa) < 2 or len(xb) < 2:
        return None
    ma, va = _mean_var(xa)
    mb, vb = _mean_var(xb)
    diff = mb - ma
    se2_a, se2_b = va / len(xa), vb / len(xb)
    se2 = se2_a + se2_b
    if se2 == 0.0:
        return Difference(diff=diff, low=diff, high=diff, df=math.nan)
    df = se2 ** 2 / (se2_a ** 2 / (len(xa) - 1) + se2_b ** 2 / (len(xb) - 1))
    half = t_quantile(0.5 + level / 2.0, df) * math.sqrt(se2)
    return Difference(diff=diff, low=diff - half, high=diff + half, df=df)
