"""Releases of statistics, and inference from them (Alparslan 2023).

* :mod:`~numpyro_dp.releases.mechanisms`: one-shot Gaussian, Laplace,
  randomized-response and ``X^T X`` releases, charged to a ledger;
* :mod:`~numpyro_dp.releases.row_products`: the sums of row products those
  releases compute (``X^T X``, ``X^T y``), in float64, with their error bounds;
* :mod:`~numpyro_dp.releases.fisher`: which statistic to release, by the
  Fisher information of its noisy release (``ndp.fisher.rank_statistics``);
* :mod:`~numpyro_dp.releases.smooth_sensitivity`: the smooth sensitivity of a
  median or a maximum (Nissim et al. 2007), to model a release whose noise
  is scaled to it (the functions only: no release);
* :mod:`~numpyro_dp.releases.pseudo_marginal`: exact MCMC from a release, with
  its likelihood in closed form (``ndp.MH``) or intractable (``ndp.PMMH``,
  ``ndp.MHAAR``; rows released one by one are averaged per row);
* :mod:`~numpyro_dp.releases.score`, :mod:`~numpyro_dp.releases.score_budget`,
  :mod:`~numpyro_dp.releases.score_release` and :mod:`~numpyro_dp.releases.noise_aware`:
  one release of a model's whitened score and curvature at a private anchor (made
  in stages; their budget; the release and its noise-aware model), and NUTS on
  that model (``ndp.NoiseAwareNUTS``, SPEC s12);
* :mod:`~numpyro_dp.releases.linreg_release`: the release of linear
  regression's sufficient statistics by J data holders, and adaSSP;
* :mod:`~numpyro_dp.releases.linreg`: Bayesian linear regression from those
  released statistics (``ndp.linreg``, which offers the release functions too).
"""
