"""Privatising primitives: what every kernel builds its releases from.

* :mod:`~numpyro_dp.primitives.gradients`: sums of per-row clipped
  log-likelihood gradients (the gradient routes);
* :mod:`~numpyro_dp.primitives.route_choice`: which gradient route a model
  takes, and the plan it follows;
* :mod:`~numpyro_dp.primitives.row_program`: one row's log-likelihood program
  as a graph (what depends on theta, on the row, linearly; cuts);
* :mod:`~numpyro_dp.primitives.indexed_blocks`: blocks of theta each row reads
  at a few entries, and the rows' gradients reduced to those entries;
* :mod:`~numpyro_dp.primitives.clipping`: per-row clip weights, squared norms
  and the norm bound of a clipped vector;
* :mod:`~numpyro_dp.primitives.row_blocks`: per-row computations in blocks of
  rows, and where the rows live on a mesh (full data, minibatches);
* :mod:`~numpyro_dp.primitives.row_statistics`: per-row gradient scales,
  Hessian norms and clipped gradient and Hessian sums (the private warm
  start's);
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
