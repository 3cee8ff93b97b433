"""The runner: :class:`~numpyro_dp.PrivateMCMC` and what it decides before it runs.

A call of ``PrivateMCMC.run`` goes, in order, through

* :mod:`~numpyro_dp.runner.mcmc`: ``PrivateMCMC``, NumPyro's ``MCMC`` with a
  budget and a ledger (the NumPyro-facing class);
* :mod:`~numpyro_dp.runner.chains`: the chains a call runs (checked against what
  is charged), the devices they run on, and where they start;
* :mod:`~numpyro_dp.runner.charging`: the call against its ledger (charge,
  refusal, ``PrivateMCMC.plan``), on the decisions of
* :mod:`~numpyro_dp.runner.budget`: the shares of epsilon, the sampler's noise
  (one formula for the runner and both planners) and the entries a call charges,
  from public facts only;
* :mod:`~numpyro_dp.runner.tuning`: the private tuning before the sampler, planned
  (its noise and ledger entries, from public facts) and run, made of
* :mod:`~numpyro_dp.runner.clip_selection`: clips as DP quantiles of per-row scales,
  from noisy histograms, and
* :mod:`~numpyro_dp.runner.warm_start`: the private warm start's noisy Fisher
  scoring steps from the prior's median;

and, after the draws, :mod:`~numpyro_dp.runner.mixing` (did the chains move and
mix; free post-processing).  :mod:`~numpyro_dp.runner.planning` is ``ndp.plan``, a
run's plan from public facts, on the same budget decisions.
"""
