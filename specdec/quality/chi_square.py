"""Two-sample chi-square test of homogeneity (no scipy at run time: the p-value comes from the
regularized upper incomplete gamma function in torch)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIN_EXPECTED = 5.0  # chi-square's usual validity rule for expected cell counts


@dataclass
class ChiSquareResult:
    statistic: float
    df: int
    p_value: float
    num_bins: int  # columns left after dropping empty ones and merging sparse ones


def chi_square_two_sample(counts_a: Sequence[int], counts_b: Sequence[int],
                          min_expected: float = MIN_EXPECTED) -> ChiSquareResult:
    """Chi-square test of homogeneity on the 2 x B table [counts_a; counts_b].

    The last column is "other": all-zero columns are dropped, and columns whose expected count is
    below min_expected in either row are merged into it (if "other" is then still sparse, it is
    merged into the smallest column left). Fewer than two columns left: no evidence, p = 1.
    Returns the statistic, df = B - 1 and the p-value from the chi-square survival function."""
    import torch

    if len(counts_a) != len(counts_b) or not counts_a:
        raise ValueError("counts_a and counts_b need the same, non-zero number of bins")
    n_a, n_b = sum(counts_a), sum(counts_b)
    if n_a <= 0 or n_b <= 0:
        raise ValueError("each sample needs at least one observation")
    total = n_a + n_b
    cols = [[a, b] for a, b in zip(counts_a, counts_b)]
    other, cols = cols[-1], [c for c in cols[:-1] if c[0] + c[1] > 0]
    min_share = min(n_a, n_b) / total  # the smaller row's expected count is min_share * column total

    def sparse(c: list[int]) -> bool:
        return (c[0] + c[1]) * min_share < min_expected

    for c in [c for c in cols if sparse(c)]:
        other[0] += c[0]
        other[1] += c[1]
        cols.remove(c)
    if other[0] + other[1] > 0:
        if sparse(other) and cols:
            smallest = min(cols, key=lambda c: c[0] + c[1])
            smallest[0] += other[0]
            smallest[1] += other[1]
        else:
            cols.append(other)
    if len(cols) < 2:
        return ChiSquareResult(0.0, 0, 1.0, len(cols))
    stat = 0.0
    for row, n_row in ((0, n_a), (1, n_b)):
        for c in cols:
            expected = n_row * (c[0] + c[1]) / total
            stat += (c[row] - expected) ** 2 / expected
    df = len(cols) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return ChiSquareResult(stat, df, p, len(cols))
