"""Privacy accounting on Google's ``dp-accounting``.

Conventions
-----------
Kernels declare the privacy cost of one iteration as a
:class:`dp_accounting.DpEvent` next to their algorithm.  A
``GaussianDpEvent(z)`` declared by a kernel carries the noise multiplier
``z = sigma / Delta``, where ``Delta`` is the l2-sensitivity of the released
sum *under the kernel's neighbourhood* (``2 c`` for ``"substitute"``, ``c``
for ``"add_remove"``, for per-row terms clipped to ``c``).  A release with
noise multiplier ``z`` is then ``mu``-GDP with ``mu = 1 / z`` under either
neighbourhood (zCDP ``rho = 1 / (2 z^2)``).  Subsampled releases
(``PoissonSampledDpEvent``, ``TruncatedSubsampledGaussianDpEvent``,
``SampledWithoutReplacementDpEvent``) carry the same ``z``.

Layout
------
* :mod:`~numpyro_dp.accounting.events`: the one walker of an event tree and
  what is read off it (releases, noise multipliers, dp-accounting's own noise
  convention);
* :mod:`~numpyro_dp.accounting.accountants`: the accountants, all
  ``dp_accounting.PrivacyAccountant`` subclasses, and
  :func:`~numpyro_dp.accounting.accountants.make_accountant`, the one place
  that picks the accountant for an event and the user's ``accountant=``;
* :mod:`~numpyro_dp.accounting.calibration`: noise and iteration counts
  for a budget, through dp-accounting's ``calibrate_dp_mechanism``;
* :mod:`~numpyro_dp.accounting.gaussian`, :mod:`~numpyro_dp.accounting.budget`:
  closed forms and checks;
* :mod:`~numpyro_dp.accounting.lower_bound`: a fast, provable lower bound on
  epsilon, which refuses a run clearly over its budget before any PLD;
* :mod:`numpyro_dp.accounting.ledger`: what has been charged, and the budget;
  :mod:`~numpyro_dp.accounting.entry`: its entries and their events as JSON;
  :mod:`~numpyro_dp.accounting.ledger_file`: its file (verified, locked, appended);
  :mod:`~numpyro_dp.accounting.keyring`: the key that authenticates ledger files.

Every epsilon returned here is rounded up: the reported figure is never below
the true one (invariant 4).
"""

from numpyro_dp.accounting.accountants import (
    ACCOUNTANTS,
    AccountantChoice,
    AccountantWarning,
    choose_accountant,
    epsilon_spent,
    make_accountant,
)
from numpyro_dp.accounting.budget import (
    NEIGHBOURHOODS,
    PrivacyBudgetError,
    check_budget,
    check_delta_for_rows,
    check_neighbourhood,
    sensitivity_factor,
)
from numpyro_dp.accounting.calibration import (
    calibrate_gaussian,
    calibrate_noise_multiplier,
    max_iterations,
)
from numpyro_dp.accounting.entry import LedgerEntry
from numpyro_dp.accounting.events import (
    count_releases,
    gaussian_mu,
    gaussian_releases,
    noise_multipliers,
    pure_releases,
    releases,
    to_dp_accounting,
)
from numpyro_dp.accounting.gaussian import (
    epsilon_to_zcdp,
    gaussian_epsilon,
    gaussian_log_delta,
    rdp_to_epsilon,
    zcdp_to_epsilon,
)
from numpyro_dp.accounting.ledger import PrivacyLedger, PrivacySpent

__all__ = [
    "ACCOUNTANTS", "NEIGHBOURHOODS", "AccountantChoice", "AccountantWarning",
    "LedgerEntry", "PrivacyBudgetError",
    "PrivacyLedger", "PrivacySpent", "calibrate_noise_multiplier", "check_budget",
    "calibrate_gaussian",
    "check_delta_for_rows", "check_neighbourhood", "choose_accountant", "count_releases",
    "epsilon_spent", "epsilon_to_zcdp", "gaussian_epsilon", "gaussian_log_delta",
    "gaussian_mu", "gaussian_releases", "make_accountant", "max_iterations",
    "noise_multipliers", "pure_releases", "rdp_to_epsilon", "releases",
    "sensitivity_factor", "to_dp_accounting", "zcdp_to_epsilon",
]
