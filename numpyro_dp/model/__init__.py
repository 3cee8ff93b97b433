"""The model adapter: a user's NumPyro model, split for private inference.

:class:`PrivateModel` (:mod:`~numpyro_dp.model.adapter`) splits the model's
log-density into a data-free prior and one log-likelihood term per row, finds
the data plate and the row arrays, and composes the modules below:

* :mod:`~numpyro_dp.model.checks` refuses models that private inference cannot
  run (no data plate, latent sites in it, discrete latents, rows that read each
  other, priors that read the data, ...) with a :class:`ModelSpecificationError`;
* :mod:`~numpyro_dp.model.log_density` evaluates the prior and the per-row
  log-likelihoods of one run of the model at unconstrained parameters;
* :mod:`~numpyro_dp.model.tracing` runs the model on public inputs only: traces
  with the rows abstract, and stand-in rows;
* :mod:`~numpyro_dp.model.dataflow` traces which values depend on the rows;
* :mod:`~numpyro_dp.model.layout` says which rows of padded arrays are real;
* :mod:`~numpyro_dp.model.units` groups the rows into privacy units (a person's
  rows), and :mod:`~numpyro_dp.model.inputs` maps the model's arguments to a
  run's private inputs (the rows, or the unit blocks) and back.
"""

from numpyro_dp.model.adapter import PrivateModel, tabular_to_numpy
from numpyro_dp.model.checks import ModelSpecificationError
from numpyro_dp.model.layout import RowLayout

__all__ = ["ModelSpecificationError", "PrivateModel", "RowLayout", "tabular_to_numpy"]
