"""Model adapter: per-row log-likelihoods and the prior of a NumPyro model.

Every kernel of the library talks to a user's model only through
:class:`PrivateModel`.  It splits the model's log-density
(:mod:`~numpyro_dp.model.log_density`) into

* the prior term ``log p(theta)`` in NumPyro's unconstrained space, including
  the log-Jacobian of the transforms; it must not read the data, and
* the per-row log-likelihoods ``l_i(theta)``: the log-probabilities of all
  observed sites and ``numpyro.factor`` sites inside the data plate, reduced
  over every dimension except the data-plate dimension.  Each ``l_i`` is
  computed by running the model on row ``i`` alone (vectorised over rows), so
  it cannot read another row, whatever the model does with its arguments;
  clipping ``l_i`` then bounds row ``i``'s influence.

What counts as private data
---------------------------
The data plate's size ``n`` is public.  Every array argument of the model
(positional or keyword) whose leading dimension is ``n`` holds rows of the
private data set; covariates and observations are treated alike.  Other
arguments (scalars, hyperparameter arrays of another length) are public
configuration.  Rows must lie along the leading axis of those arrays.  Rows
that reach the model any other way are refused, because they would be treated
as public: a Python list or tuple of ``n`` items among the arguments, and an
array with ``n`` rows that the model reads from a global or a closure (found
as a constant of the traced program).

The rows are passed to the compiled sampler as arguments
(:meth:`PrivateModel.private_inputs` and :meth:`PrivateModel.rebuild`), never
baked in as constants, which JAX's persistent compilation cache would write to
disk; the public arguments stay Python values.

Nothing this module does before a kernel's first charge depends on the rows'
values (SPEC: every release is charged).  The model's structure is traced with
the rows as abstract values, shapes and dtypes only, as the compiled sampler
sees them (:mod:`~numpyro_dp.model.tracing`): plate sizes, sites, NumPyro's
checks of constant arguments and any exception the model raises are public
facts, and are quoted as they are.  Checks that need numbers (a row's
log-likelihood alone and among others) run on stand-in rows made by a public
rule (:func:`~numpyro_dp.model.tracing.stand_ins`), with NumPyro's validation
off and warnings ignored.  The one exception is the refusal of NaN/inf in the
row arrays (last of all checks): such values lie outside the data domain that
privacy is claimed for, and the refusal tells whoever sees it that some row
holds one.

Bad models are rejected with an error that names the problem and the fix,
before any private value is computed (:mod:`~numpyro_dp.model.checks`).

Privacy units
-------------
With ``privacy_unit=ids`` (:class:`~numpyro_dp.model.units.Units`)
a *unit* plays the part of a row everywhere after the checks: ``num_rows`` is
the number of units, the private inputs are the unit blocks
(:meth:`Units.block <numpyro_dp.model.units.Units.block>`) and their mask, and
a unit's log-likelihood is the sum of its rows' ``l_i``, each row still run
alone.  Every route (gradients, log-likelihood ratios, curvature, minibatches,
sharding) then clips and samples units with no change of its own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from numpyro.distributions import biject_to, constraints
from numpyro.infer.initialization import init_to_uniform

from numpyro_dp.model.checks import (
    CONCRETIZATION_ERRORS,
    CONCRETIZATION_MESSAGE,
    ModelSpecificationError,
    check_data_free,
    check_finite,
    check_layout,
    check_single_row,
    check_sites,
    find_data_plate,
    find_rows,
    find_structure,
)
from numpyro_dp.model.dataflow import inputs_read
from numpyro_dp.model.inputs import ModelInputs, unit_sum
from numpyro_dp.model.layout import RowLayout
from numpyro_dp.model.log_density import LogDensityTerms, constrained_trace, split_log_density
from numpyro_dp.model.tracing import quietly, shape_dtype, structure_trace
from numpyro_dp.model.units import Units


class ObservedSite(NamedTuple):
    """Public structure of an observed site (read from a trace with abstract rows)."""

    family: type  # the distribution's class, e.g. numpyro.distributions.Bernoulli
    support: type  # the class of its support constraint
    discrete: bool  # whether that support is discrete


def tabular_to_numpy(tree: Any) -> Any:
    """``tree`` with every pandas DataFrame, Series or Index replaced by its NumPy array.

    Models read their data as arrays (``X @ w``), and a pandas object is not a
    JAX array type.  Every column must have a numeric or boolean dtype
    (nullable ones included; they become float64 and a missing value becomes
    NaN, which the data checks then refuse).  Strings, categories, objects,
    dates and durations are refused with the fix: parsing text or counting
    microseconds would silently make up the numbers the model sees.
    """

    def convert(x: Any) -> Any:
        if type(x).__module__.split(".")[0] != "pandas" or not hasattr(x, "to_numpy"):
            return x
        from pandas.api.types import is_bool_dtype, is_numeric_dtype

        dtypes = list(x.dtypes) if hasattr(x, "columns") else [x.dtype]
        if not all(is_numeric_dtype(t) or is_bool_dtype(t) for t in dtypes):
            raise ModelSpecificationError(
                f"A pandas {type(x).__name__} argument has a column that is not numeric "
                "or boolean (strings, categories, objects, dates or durations). Encode it "
                "as numbers before the call, e.g. `pd.get_dummies(df, dtype=float)`, "
                "`df[col].cat.codes`, or days since a public reference date, then pass "
                "the frame or `df.to_numpy(float)`."
            )
        values = x.to_numpy()
        if values.dtype == object:  # mixed or nullable numeric columns
            values = x.to_numpy(dtype=np.float64, na_value=np.nan)
        return values

    return jax.tree_util.tree_map(convert, tree)


class PrivateModel(ModelInputs):
    """A NumPyro model split into a data-free prior and per-row log-likelihoods.

    Parameters
    ----------
    model : callable
        A NumPyro model whose observed sites all lie in one plate over rows.
    model_args, model_kwargs : tuple, dict
        The arguments the model is run with (they hold the private data).
    data_plate : str, optional
        Name of the plate over data rows.  Auto-detected when exactly one plate
        holds every observed site.
    row_layout : RowLayout, optional
        Where the real rows of padded arrays lie
        (:func:`numpyro_dp.primitives.sharding.shard_rows`): padded rows
        contribute exactly zero to :meth:`log_density_terms` and to every
        clipped sum, and are not counted in ``num_rows``.  With ``units``, the
        padding of the unit blocks is set by :meth:`with_layout`.
    privacy_unit : array, optional
        One unit id per row (:class:`~numpyro_dp.model.units.Units`): each unit
        then plays the part of a row (module docstring).

    Attributes
    ----------
    num_rows : int
        The public number of rows ``n`` (real rows: padding excluded), or of
        units with ``units``.
    padded_rows : int
        The rows of the arrays (``n`` unless padded by ``row_layout``).
    latent_sites : tuple of str
        Names of the latent sample sites, i.e. the parameters.
    data_plate : str
        The plate over rows.
    row_specs : list of jax.ShapeDtypeStruct
        The shapes and dtypes of the row arrays (public structure).
    """

    def __init__(
        self,
        model: Callable,
        model_args: tuple = (),
        model_kwargs: dict | None = None,
        data_plate: str | None = None,
        row_layout: RowLayout | None = None,
        privacy_unit=None,
    ):
        self.model = model
        self.units = None  # rows are the units until the checks have run (below)
        model_kwargs = {} if model_kwargs is None else dict(model_kwargs)
        leaves, self._treedef = jax.tree_util.tree_flatten((model_args, model_kwargs))
        trace, shapes = find_structure(model, leaves, self._treedef, data_plate)
        self.data_plate, (plate_dim, self.padded_rows) = find_data_plate(trace, data_plate)
        #: (prior, per-row log-likelihoods) of one run of the model.
        self._split = functools.partial(split_log_density, model, self.data_plate, plate_dim)
        self.layout = row_layout
        check_layout(row_layout, self.padded_rows, self.data_plate)
        self.num_rows = self.padded_rows if row_layout is None else row_layout.num_rows
        check_sites(trace, self.data_plate)
        self.latent_sites = tuple(
            name
            for name, s in trace.items()
            if s["type"] == "sample" and not s["is_observed"]
        )
        #: The latent sites with positive support (noise scales, group sds; structure).
        self.positive_latents = frozenset(
            name for name in self.latent_sites
            if trace[name]["fn"].support is constraints.positive
        )
        #: The observed sites' distribution and support classes (public structure).
        self.observed = tuple(
            ObservedSite(type(s["fn"]), type(s["fn"].support), bool(s["fn"].support.is_discrete))
            for s in trace.values()
            if s["type"] == "sample" and s["is_observed"]
        )
        self._row_leaf_index = find_rows(model_args, model_kwargs, self.padded_rows,
                                         self.data_plate)
        # The public arguments, kept as given; the rows are never stored here.
        self._public_leaves = [
            None if i in self._row_leaf_index else x for i, x in enumerate(leaves)
        ]
        # The rows' shapes and dtypes: all that the checks below read of them.
        self.row_specs = [shape_dtype(leaves[i]) for i in self._row_leaf_index]
        example_u = {n: jnp.zeros(shapes[n].shape, shapes[n].dtype) for n in self.latent_sites}
        self._unravel = ravel_pytree(example_u)[1]
        self.num_params = int(ravel_pytree(example_u)[0].size)
        #: Shape of each latent site in unconstrained space (public structure).
        self.param_shapes = {n: tuple(jnp.shape(v)) for n, v in example_u.items()}
        try:
            self._deterministic = check_data_free(self, self._split, example_u)
        except CONCRETIZATION_ERRORS:
            raise ModelSpecificationError(CONCRETIZATION_MESSAGE) from None
        check_single_row(self, self._split)
        # Last of all: the one check that reads the rows' values (module docstring).
        check_finite(self._row_leaf_index, [leaves[i] for i in self._row_leaf_index])
        #: The row arrays' own shapes and dtypes (the model's view of them).
        self._model_row_specs = self.row_specs
        if privacy_unit is not None:
            units = Units.from_ids(privacy_unit, self.padded_rows)
            if row_layout is not None:
                raise ValueError(
                    "privacy_unit with rows already placed on a mesh: pass the rows "
                    "unplaced (PrivateMCMC(mesh=...) places whole units on the mesh)."
                )
            m = units.max_rows
            self.row_specs = [jax.ShapeDtypeStruct((units.num_units, m) + s.shape[1:], s.dtype)
                              for s in self.row_specs]
            self.row_specs.append(jax.ShapeDtypeStruct((units.num_units, m), np.dtype(bool)))
            self.padded_rows = self.num_rows = units.num_units
            self.units = units

    @functools.cached_property
    def likelihood_coordinates(self) -> np.ndarray:
        """Which flattened unconstrained coordinates the data plate's log-likelihood
        can depend on (bool, shape ``(num_params,)``), site by site.

        Public structure: the program traced on stand-in rows
        (:func:`~numpyro_dp.model.dataflow.inputs_read`), never a value.  A
        latent that only the prior reads (a hierarchical model's group mean and
        sd, where the group effects enter the likelihood) gets no information
        from the rows: its score and curvature are zero by construction, and a
        release need not carry noise along it.
        """
        args, kwargs = self.stand_in_arguments()

        def loglik(params):
            return jnp.sum(self._split(params, args, kwargs)[1])

        dtype = jnp.result_type(float)
        example = {n: np.zeros(shape, dtype) for n, shape in self.param_shapes.items()}
        with quietly():
            read = inputs_read(loglik, example)
        return self._site_mask({n for n, r in read.items() if r})

    def _site_mask(self, names) -> np.ndarray:
        """The flattened coordinates (bool) of the latent sites ``names``, in
        :meth:`ravel`'s order (a dict's leaves: by name), built in NumPy: no JAX
        program compiled for a public structure."""
        return np.concatenate([np.full(math.prod(self.param_shapes[n]), n in names)
                               for n in sorted(self.param_shapes)] or [np.zeros(0, bool)])

    @functools.cached_property
    def likelihood_reads_scale(self) -> bool:
        """Whether the data plate's log-likelihood reads a latent with positive support
        (a noise scale, a dispersion): public structure, :attr:`positive_latents` among
        :attr:`likelihood_coordinates`.  Such a latent sets the scale of every row's
        score, which grows without bound as it shrinks."""
        return bool(np.any(self._site_mask(self.positive_latents) & self.likelihood_coordinates))

    def one_row_loglik(self, model_args: tuple, model_kwargs: dict,
                       expected: bool = False) -> tuple[Callable, list]:
        """``(loglik(theta, row), rows)``: one row's log-likelihood and the row arrays.

        ``theta`` is the flat unconstrained parameter vector and ``row`` one
        entry of each row array; as in :meth:`log_density_terms`, the model
        sees the row alone (a batch of one).  What per-row gradient routes
        differentiate.  With ``expected``, a function whose Hessian at
        ``theta`` is the row's expected one
        (:func:`~numpyro_dp.model.log_density.expected_log_prob`): for curvature
        only, its gradient is not the row's.  With units, ``row`` is one unit's
        block and mask, and ``loglik`` the sum of its rows'
        (:func:`~numpyro_dp.model.inputs.unit_sum`).
        """
        leaves, treedef, mask = self._leaves(model_args, model_kwargs)
        rows = [leaves[i] for i in self._row_leaf_index]

        def loglik(theta, row):
            args, kwargs = self._with_rows(leaves, treedef, [x[None] for x in row])
            return self._split(self.unravel(theta), args, kwargs, expected)[1][0]

        if mask is None:
            return loglik, rows
        return unit_sum(loglik), rows + [mask]

    def log_density_terms(
        self,
        params: dict,
        model_args: tuple,
        model_kwargs: dict,
        idx: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> LogDensityTerms:
        """Prior and per-row log-likelihoods at unconstrained ``params``.

        Parameters
        ----------
        params : dict
            Unconstrained values of the latent sites.
        model_args, model_kwargs : tuple, dict
            The model's arguments (same structure as at construction).
        idx : array of int, optional
            Row indices; when given, the row arrays are indexed first so that
            only ``len(idx)`` rows are evaluated.
        positions : array of int, optional
            Instead of ``idx``: where the rows lie in the arrays given (padding
            included), e.g. offsets in one device's block of rows
            (:func:`~numpyro_dp.primitives.row_blocks.minibatch`).

        Returns
        -------
        LogDensityTerms
            Private values: clip and noise them before anything leaves a kernel.
        """
        leaves, treedef, unit_mask = self._leaves(model_args, model_kwargs)
        row_leaves = [jnp.asarray(leaves[i]) for i in self._row_leaf_index]
        if unit_mask is not None:
            row_leaves.append(jnp.asarray(unit_mask))
        if idx is not None:
            positions = self.positions(idx)
        if positions is not None:
            row_leaves = [x[positions] for x in row_leaves]

        def one_row(_, row):
            # The model sees this row alone, so l_i cannot read another row (a
            # model that, say, standardises X inside would otherwise make every
            # l_i depend on every row, and clipping l_i would bound nothing).
            args, kwargs = self._with_rows(leaves, treedef, [x[None] for x in row])
            return self._split(params, args, kwargs)[1][0]

        fn = one_row if unit_mask is None else unit_sum(one_row)
        rows = jax.vmap(lambda row: fn(None, row))(row_leaves)
        mask = self.row_mask() if positions is None else None
        if mask is not None:  # padding: exactly 0, whatever the model makes of a zero row
            rows = jnp.where(mask, rows, 0.0)
        # The prior is data-free (proved at setup) but may use the public n.
        prior = self._split(params, *self._model_arguments(model_args, model_kwargs))[0]
        return LogDensityTerms(prior, rows)

    # ---------------------------------------------------------- init & output
    def init_params(
        self,
        rng_key: jax.Array,
        model_args: tuple,
        model_kwargs: dict,
        init_strategy: Callable = init_to_uniform,
    ) -> dict:
        """An unconstrained initial point from ``init_strategy`` (prior-based).

        The strategy sees only each site's prior distribution, which the setup
        check proved to be data-free; no likelihood is evaluated (unlike
        NumPyro's ``find_valid_initial_params``).  The model runs on zero
        stand-ins of the rows of ``model_args`` and ``model_kwargs``: nothing
        it does here, a NumPyro check or a warning, can depend on their values.
        """
        model_args, model_kwargs = self._model_arguments(model_args, model_kwargs)
        leaves, treedef = jax.tree_util.tree_flatten((model_args, model_kwargs))
        # zeros_like: on the devices the rows lie on (they may fill a mesh).
        zeros = [jnp.zeros_like(leaves[i]) for i in self._row_leaf_index]
        with quietly():
            tr = structure_trace(self.model, *self._with_rows(leaves, treedef, zeros),
                                 rng_key, init_strategy)
        return {
            n: biject_to(tr[n]["fn"].support).inv(tr[n]["value"]) for n in self.latent_sites
        }

    def ravel(self, params: dict) -> jax.Array:
        """Flatten unconstrained params to the vector theta."""
        return ravel_pytree(params)[0]

    def unravel(self, theta: jax.Array) -> dict:
        """Inverse of :meth:`ravel`."""
        return self._unravel(theta)

    def constrain(self, params: dict, model_args: tuple, model_kwargs: dict) -> dict:
        """Constrained latent values plus the data-free deterministic sites."""
        tr, _ = constrained_trace(self.model, params,
                                  *self._model_arguments(model_args, model_kwargs))
        keep = set(self.latent_sites) | set(self._deterministic)
        return {n: s["value"] for n, s in tr.items() if n in keep}

