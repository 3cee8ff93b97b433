"""The runner: :class:`~numpyro_dp.PrivateMCMC` and what it decides before it runs.

* :mod:`~numpyro_dp.runner.mcmc`: ``PrivateMCMC``, NumPyro's ``MCMC`` with a
  budget and a ledger;
* :mod:`~numpyro_dp.runner.tuning`: private clip selection and the warm start;
* :mod:`~numpyro_dp.runner.planning`: ``ndp.plan``, a run's plan from public facts;
* :mod:`~numpyro_dp.runner.mixing`: did the chains move and mix (free
  post-processing of the draws).
"""
