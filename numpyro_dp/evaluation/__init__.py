"""Evaluation: models with posteriors known in closed form, and how close draws are.

* :mod:`~numpyro_dp.evaluation.models`: the banana and correlated Gaussian
  models and their exact posterior draws (``ndp.models``);
* :mod:`~numpyro_dp.evaluation.diagnostics`: MMD and mean distance against
  exact draws (``ndp.diagnostics``);
* :mod:`~numpyro_dp.evaluation.canary`: the canary problem every kernel is
  audited on (:mod:`numpyro_dp.audit`);
* :mod:`~numpyro_dp.evaluation.simulation`: simulation-based calibration of a
  route (``ndp.evaluation.sbc``), and NUTS on the same simulations as its
  yardstick (``ndp.evaluation.nuts_route``).
"""

from numpyro_dp.evaluation.simulation import SBCResult, noise_aware_route, nuts_route, sbc

__all__ = ["SBCResult", "noise_aware_route", "nuts_route", "sbc"]
