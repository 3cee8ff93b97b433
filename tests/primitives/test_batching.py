"""Batches without replacement: exact uniform law over subsets (and orders), O(b) cost."""

import itertools

import jax
import numpy as np
import pytest
from scipy.stats import chisquare

from numpyro_dp.primitives.batching import sample_without_replacement

DRAWS = 42_000


def draw_many(num_rows, batch_size, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), DRAWS)
    f = jax.jit(jax.vmap(lambda k: sample_without_replacement(k, num_rows, batch_size)))
    return np.asarray(f(keys))


@pytest.mark.parametrize(
    "num_rows, batch_size",
    [(7, 3), (4, 2), (2, 1), (6, 4), (5, 5)],  # rejection path (b <= n/2) and permutation path
)
def test_law_is_uniform_over_ordered_batches(num_rows, batch_size):
    draws = draw_many(num_rows, batch_size)
    assert all(len(set(row)) == batch_size for row in draws)
    assert draws.min() >= 0 and draws.max() < num_rows
    # Every ordered batch equally likely: uniform subset and uniformly random order.
    cells = {t: i for i, t in enumerate(itertools.permutations(range(num_rows), batch_size))}
    counts = np.bincount([cells[tuple(r)] for r in draws], minlength=len(cells))
    assert chisquare(counts).pvalue > 1e-3


def test_large_n_distinct_in_range():
    idx = np.asarray(jax.jit(lambda k: sample_without_replacement(k, 10**7, 1000))(
        jax.random.PRNGKey(3)))
    assert idx.shape == (1000,) and len(np.unique(idx)) == 1000
    assert idx.min() >= 0 and idx.max() < 10**7


@pytest.mark.parametrize("b", [0, 8])
def test_bad_batch_size(b):
    with pytest.raises(ValueError, match="batch_size"):
        sample_without_replacement(jax.random.PRNGKey(0), 7, b)
