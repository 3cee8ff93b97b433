"""The model adapter: a user's NumPyro model, split for private inference.

:class:`PrivateModel` (:mod:`~numpyro_dp.model.adapter`) splits the model's
log-density into a data-free prior and one log-likelihood term per row, finds
the data plate and the row arrays, and refuses models that private inference
cannot run (latent sites in the data plate, rows that read each other, ...);
:mod:`~numpyro_dp.model.dataflow` traces which values depend on the rows;
:mod:`~numpyro_dp.model.layout` says which rows of padded arrays are real.
"""

from numpyro_dp.model.adapter import ModelSpecificationError, PrivateModel, tabular_to_numpy
from numpyro_dp.model.layout import RowLayout

__all__ = ["ModelSpecificationError", "PrivateModel", "RowLayout", "tabular_to_numpy"]
