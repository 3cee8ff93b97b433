"""Privatising primitives: what every kernel builds its releases from.

* :mod:`~numpyro_dp.primitives.gradients`: sums of per-row clipped
  log-likelihood gradients (the gradient routes);
* :mod:`~numpyro_dp.primitives.batching`: minibatches (Poisson and without
  replacement) drawn from the secret;
* :mod:`~numpyro_dp.primitives.release`: the release gate -- every Gaussian
  or Laplace release is sized (grid, sensitivity as computed, noise scale) and
  made here;
* :mod:`~numpyro_dp.primitives.rounding`: floating-point-safe sums and noise
  added on a grid, with the rounding charged;
* :mod:`~numpyro_dp.primitives.secret`: the secret that every noise key
  derives from;
* :mod:`~numpyro_dp.primitives.sharding`: rows on a device mesh (placement,
  padding, full-data sums per shard);
* :mod:`~numpyro_dp.primitives.tap`: the white-box audit's view of the
  release gates (a no-op outside an audit).
"""
