"""The Fréchet distance and its streaming statistics (docs/algorithms.md §9): exact against scipy, closed forms,
streaming = one-shot, merge = concatenation."""

import numpy as np
import pytest
import scipy.linalg
import torch

from dit_train.evaluation.fd.frechet import (GaussianStats, NegativeFDError, RankDeficientWarning, StreamingStats,
                                  fd_from_stats, frechet_distance, stats_from_features, trace_sqrt_product)


def scipy_fd(mu1, s1, mu2, s2):
    covmean = scipy.linalg.sqrtm(s1 @ s2)
    covmean = np.real(covmean)
    d = mu1 - mu2
    return float(d @ d + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


def random_gaussian_samples(rng, n, d, scale=1.0, shift=0.0):
    mix = rng.normal(size=(d, d)) / np.sqrt(d)
    return (rng.normal(size=(n, d)) @ mix) * scale + shift + rng.normal(size=d)


@pytest.mark.parametrize("seed,d", [(0, 8), (1, 32), (2, 64), (3, 128)])
def test_matches_scipy_sqrtm_on_random_gaussians(seed, d):
    rng = np.random.default_rng(seed)
    a = stats_from_features(random_gaussian_samples(rng, 4 * d, d))
    b = stats_from_features(random_gaussian_samples(rng, 3 * d, d, scale=1.7, shift=0.5))
    ours = fd_from_stats(a, b)
    ref = scipy_fd(a.mean, a.cov, b.mean, b.cov)
    assert ours == pytest.approx(ref, rel=1e-6)
    # symmetric in its arguments
    assert fd_from_stats(b, a) == pytest.approx(ours, rel=1e-9)


def test_trace_term_matches_scipy_for_ill_conditioned_covariances():
    rng = np.random.default_rng(5)
    d = 48
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    s1 = (q * np.logspace(-6, 2, d)) @ q.T
    s2 = s1 + 0.1 * np.cov(rng.normal(size=(200, d)), rowvar=False)
    ref = float(np.trace(np.real(scipy.linalg.sqrtm(s1 @ s2))))
    assert trace_sqrt_product(s1, s2) == pytest.approx(ref, rel=1e-6)


def test_fd_of_a_set_with_itself_is_zero():
    rng = np.random.default_rng(0)
    s = stats_from_features(random_gaussian_samples(rng, 300, 64))
    fd = fd_from_stats(s, s)
    assert abs(fd) < 1e-9 * np.trace(s.cov)


def test_closed_form_for_diagonal_gaussians():
    # FD = |mu1 - mu2|^2 + sum_i (sqrt(a_i) - sqrt(b_i))^2 when both covariances are diagonal
    rng = np.random.default_rng(1)
    d = 20
    mu1, mu2 = rng.normal(size=d), rng.normal(size=d)
    a, b = rng.uniform(0.1, 4, size=d), rng.uniform(0.1, 4, size=d)
    a[3] = 0.0  # a degenerate direction is fine (eigenvalues clamped at 0)
    expected = float(((mu1 - mu2) ** 2).sum() + ((np.sqrt(a) - np.sqrt(b)) ** 2).sum())
    assert frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(expected, rel=1e-12)
    # a pure mean shift with equal covariances
    assert frechet_distance(mu1, np.diag(b), mu2, np.diag(b)) == pytest.approx(((mu1 - mu2) ** 2).sum(), rel=1e-10)



def test_a_negative_fd_is_never_reported():
    """FD >= 0: rounding just below 0 is clamped to 0, a clearly negative value (invalid statistics) is refused."""
    mu = np.zeros(2)
    # by hand: A = diag(1, 0), Tr (A S2 A)^(1/2) = 1, FD = (1 - 1e-10) + 1 - 2 = -1e-10 before the clamp
    assert frechet_distance(mu, np.diag([1.0, -1e-10]), mu, np.diag([1.0, 0.0])) == 0.0
    with pytest.raises(NegativeFDError, match=r"FD came out -3 .*not positive semi-definite"):
        frechet_distance(mu, np.diag([-4.0, 0.0]), mu, np.diag([1.0, 0.0]))  # tr -3, square-root term 0


def test_negative_eigenvalues_count_as_zero_in_both_square_roots():
    """Rounding can leave a singular covariance with slightly negative eigenvalues; both square roots (of S1, and of
    A S2 A) clamp them at 0 (not |lambda|). By hand, with diagonal covariances: S1 = diag(1, -1/4), S2 = diag(1, 1/4)
    gives A = diag(1, 0), Tr (A S2 A)^(1/2) = 1 and FD = 3/4 + 5/4 - 2 = 0; swapped, A S2 A = diag(1, -1/4) and
    Tr (.)^(1/2) = 1 again."""
    mu = np.zeros(2)
    a, b = np.diag([1.0, -0.25]), np.diag([1.0, 0.25])
    assert frechet_distance(mu, a, mu, b) == pytest.approx(0.0, abs=1e-12)
    assert frechet_distance(mu, b, mu, a) == pytest.approx(0.0, abs=1e-12)

def test_streaming_equals_one_shot_and_merge_equals_concatenation():
    rng = np.random.default_rng(2)
    x = random_gaussian_samples(rng, 257, 16, shift=3.0).astype(np.float32)
    one = stats_from_features(x.astype(np.float64))
    acc = StreamingStats(16)
    for lo, hi in [(0, 1), (1, 100), (100, 101), (101, 257)]:  # uneven batches, including size 1
        acc.update(torch.from_numpy(x[lo:hi]))
    s = acc.finalize()
    assert s.count == 257
    np.testing.assert_allclose(s.mean, one.mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.cov, one.cov, rtol=1e-9, atol=1e-11)
    # two batches each: sums about each side's own shift are not zero, so re-centring them is exercised in full
    left = StreamingStats(16).update(torch.from_numpy(x[:20])).update(torch.from_numpy(x[20:50]))
    right = StreamingStats(16).update(torch.from_numpy(x[50:90])).update(torch.from_numpy(x[90:]))
    m = left.merge(right).finalize()
    assert m.count == 257
    np.testing.assert_allclose(m.mean, one.mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(m.cov, one.cov, rtol=1e-9, atol=1e-11)
    assert np.array_equal(s.cov, s.cov.T) and np.array_equal(m.cov, m.cov.T)  # exactly symmetric, as stored
    assert fd_from_stats(s, one) == pytest.approx(0.0, abs=1e-9)


def test_features_accumulate_in_float64():
    # float32 sums would lose these: mean 1e4, spread 1e-2
    rng = np.random.default_rng(3)
    x = 1e4 + 1e-2 * rng.normal(size=(1000, 4))
    acc = StreamingStats(4).update(torch.from_numpy(x))
    np.testing.assert_allclose(acc.finalize().cov, np.cov(x, rowvar=False), rtol=1e-4)


def test_rank_deficient_counts_warn():
    rng = np.random.default_rng(4)
    small = stats_from_features(rng.normal(size=(10, 32)))
    big = stats_from_features(rng.normal(size=(100, 32)))
    with pytest.warns(RankDeficientWarning, match="10 samples .* feature dim 32"):
        fd_from_stats(small, big)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fd_from_stats(big, big)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"features must be \[B, 4\]"):
        StreamingStats(4).update(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="at least 2 samples"):
        StreamingStats(4).update(torch.zeros(1, 4)).finalize()
    a = GaussianStats(np.zeros(3), np.eye(3), 10)
    b = GaussianStats(np.zeros(4), np.eye(4), 10)
    with pytest.raises(ValueError, match="feature dims differ: 3 vs 4"):
        fd_from_stats(a, b)


def test_as_many_samples_as_feature_dims_is_still_rank_deficient():
    """n samples give a covariance of rank at most n - 1 (numpy's matrix_rank says so): n = d is singular too and
    warns; n = d + 1 is the first count of full rank and does not."""
    import warnings

    rng = np.random.default_rng(5)
    d = 16
    at_dim, above = stats_from_features(rng.normal(size=(d, d))), stats_from_features(rng.normal(size=(d + 1, d)))
    assert np.linalg.matrix_rank(at_dim.cov) == d - 1 and np.linalg.matrix_rank(above.cov) == d
    with pytest.warns(RankDeficientWarning, match=f"{d} samples .* feature dim {d}.* more than {d} samples"):
        fd_from_stats(at_dim, above)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fd_from_stats(above, above)
