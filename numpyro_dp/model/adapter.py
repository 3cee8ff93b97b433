"""Model adapter: per-row log-likelihoods and the prior of a NumPyro model.

Every kernel of the library talks to a user's model only through
:class:`PrivateModel`.  It splits the model's log-density into

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
sees them: plate sizes, sites, NumPyro's checks of constant arguments and any
exception the model raises are public facts, and are quoted as they are.  Checks
that need numbers (a row's log-likelihood alone and among others) run on
stand-in rows made by a public rule (:func:`_stand_ins`), with NumPyro's
validation off and warnings ignored.  The one exception is the refusal of
NaN/inf in the row arrays (last of all checks): such values lie outside the
data domain that privacy is claimed for, and the refusal tells whoever sees
it that some row holds one.

Bad models are rejected with an error that names the problem and the fix,
before any private value is computed: no data plate, several candidate plates,
observed sites outside the plate, latent sites inside it, discrete latents,
plate subsampling, a size computed from the rows, and priors, transforms or
factors outside the plate that read the data (checked structurally on the
traced program, see :mod:`numpyro_dp.model.dataflow`).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from jax import lax
from jax.flatten_util import ravel_pytree
from numpyro import handlers
from numpyro.distributions import biject_to, constraints
from numpyro.distributions.util import sum_rightmost
from numpyro.infer.initialization import init_to_uniform

from numpyro_dp.model.dataflow import captured_shapes, depends_on_private, inputs_read
from numpyro_dp.model.layout import RowLayout
from numpyro_dp.primitives.compiled import compile_once


class ModelSpecificationError(ValueError):
    """A model or data set that cannot be made differentially private as given."""


class ObservedSite(NamedTuple):
    """Public structure of an observed site (read from a trace with abstract rows)."""

    family: type  # the distribution's class, e.g. numpyro.distributions.Bernoulli
    support: type  # the class of its support constraint
    discrete: bool  # whether that support is discrete


class LogDensityTerms(NamedTuple):
    """The two parts of the log-density at one point (private: never released)."""

    prior: jax.Array  # log p(theta) + log|J|, unconstrained space, data-free
    loglik_rows: jax.Array  # (n,) or (len(idx),) per-row log-likelihoods l_i


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array)) and np.ndim(x) >= 1


def _plates(trace: dict) -> dict[str, tuple[int, int]]:
    """Plate name -> (dim, size) for every plate a sample site sits in."""
    out = {}
    for site in trace.values():
        if site["type"] == "sample":
            for frame in site["cond_indep_stack"]:
                out[frame.name] = (frame.dim, frame.size)
    return out


def _all_finite(x: Any) -> bool:
    # A jax.Array may span devices of other processes: reduce it where it lies.
    xp = jnp if isinstance(x, jax.Array) else np
    x = xp.asarray(x)
    return not xp.issubdtype(x.dtype, xp.inexact) or bool(xp.isfinite(x).all())


def _nonfinite_message(what: str) -> str:
    # Say which array, never where or how many: that is private.
    return (
        f"The data in {what} contain NaN or infinite values. They lie outside the data "
        "domain that the privacy guarantee covers, so the data must be cleaned before "
        "privacy is claimed: remove or impute those rows before inference (imputation "
        "must not be fitted on the private data, or it must be privatised itself). "
        "This refusal is the one check made on the rows' values before anything is "
        "charged: whoever sees it learns that some row holds NaN or inf (not which, "
        "nor how many)."
    )


def _structure_trace(
    model: Callable,
    model_args: tuple,
    model_kwargs: dict,
    rng_key: jax.Array | int = 0,
    init_strategy: Callable = init_to_uniform,
) -> dict:
    """A trace of ``model`` whose latent values come from ``init_strategy``.

    No latent is drawn from its prior by the default strategy, so priors
    without a sampler (NumPyro's ``ImproperUniform``, common in models
    translated from Stan) are accepted.
    """
    seeded = handlers.seed(model, rng_key)
    return handlers.trace(handlers.substitute(seeded, substitute_fn=init_strategy)).get_trace(
        *model_args, **model_kwargs
    )


def _replace(leaves: list, treedef, index: tuple[int, ...], values) -> tuple[tuple, dict]:
    """``(model_args, model_kwargs)`` with ``leaves[index]`` replaced by ``values``."""
    leaves = list(leaves)
    for i, x in zip(index, values, strict=True):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _spec(x: Any) -> jax.ShapeDtypeStruct:
    """Shape and dtype of ``x`` as the compiled sampler receives it (public)."""
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


def _abstract_trace(
    model: Callable, leaves: list, treedef, index: tuple[int, ...], specs: list
) -> tuple[dict, dict]:
    """The structure trace with ``leaves[index]`` abstract (``specs``: shapes and dtypes).

    What the compiled sampler sees: those leaves have no values, so nothing in
    the trace -- plate sizes, sites, NumPyro's checks of the other arguments,
    an exception the model raises -- can depend on theirs.  Returns the trace
    (read its structure only: its values are abstract) and the shapes of the
    continuous latents' unconstrained values.
    """
    found = {}

    def run(rows):
        trace = found["trace"] = _structure_trace(model, *_replace(leaves, treedef, index, rows))
        return {
            name: biject_to(site["fn"].support).inv(site["value"])
            for name, site in trace.items()
            if site["type"] == "sample" and not site["is_observed"] and not site["fn"].is_discrete
        }

    shapes = jax.eval_shape(run, specs)
    return found["trace"], shapes


#: Seed of the stand-in rows (public: they say nothing about the data).
STAND_IN_SEED = 0
#: Stand-in rows on which a row's log-likelihood alone and among others are compared.
PROBE_ROWS = 8


def _stand_ins(specs: list) -> list[jax.Array]:
    """Public rows of the given shapes and dtypes: uniform on (0, 1) for floats, 0 or 1
    otherwise, from :data:`STAND_IN_SEED`.

    Values inside the support of most likelihoods (Bernoulli, Poisson, Beta,
    Exponential, ...) and different from row to row, so that a check on them
    sees a model that mixes rows.
    """
    rng = np.random.default_rng(STAND_IN_SEED)
    return [
        jnp.asarray(
            rng.uniform(size=s.shape) if jnp.issubdtype(s.dtype, jnp.inexact)
            else rng.integers(0, 2, size=s.shape),
            dtype=s.dtype,
        )
        for s in specs
    ]


@contextmanager
def _quietly():
    """NumPyro's validation off and warnings ignored: for runs of the model on
    stand-in rows, whose made-up values may lie outside a likelihood's support."""
    with numpyro.validation_enabled(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


#: What JAX raises when a model turns a traced argument into a Python value.
_CONCRETIZATION_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
)
_CONCRETIZATION_MESSAGE = (
    "The model turns its data into a Python value: a size such as "
    "`int(g.max()) + 1`, a shape, an `if` on data values, or a NumPy call on a data "
    "array. numpyro-dp runs the model with the rows as arguments of a compiled "
    "program, and such a value is a statistic of the private data that no noise "
    "protects. Compute it from public knowledge and pass it as an argument that is "
    "not per-row, e.g. `model(X, g, num_groups=G)` (G the number of groups the data "
    "could have, known without looking at them) and "
    "`numpyro.sample('a', dist.Normal(0, 1).expand([num_groups]))`; use jnp, not np, "
    "on data arrays inside the model."
)


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


def _sequences_of_length(tree: Any, length: int) -> bool:
    """Whether ``tree`` holds a Python list or tuple of ``length`` items (not arrays)."""
    if isinstance(tree, (list, tuple)):
        if len(tree) == length and not hasattr(tree, "_fields"):
            return True
        return any(_sequences_of_length(x, length) for x in tree)
    if isinstance(tree, dict):
        return any(_sequences_of_length(x, length) for x in tree.values())
    return False


def _in_plate(site: dict, plate: str) -> bool:
    return any(f.name == plate for f in site["cond_indep_stack"])


def _is_factor(site: dict) -> bool:
    return (
        site["type"] == "sample"
        and site["is_observed"]
        and site["infer"].get("is_auxiliary", False)
    )


class PrivateModel:
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
        clipped sum, and are not counted in ``num_rows``.

    Attributes
    ----------
    num_rows : int
        The public number of rows ``n`` (real rows: padding excluded).
    padded_rows : int
        The rows of the arrays (``n`` unless padded by ``row_layout``).
    latent_sites : tuple of str
        Names of the latent sample sites, i.e. the parameters.
    data_plate : str
        The plate over rows.
    """

    def __init__(
        self,
        model: Callable,
        model_args: tuple = (),
        model_kwargs: dict | None = None,
        data_plate: str | None = None,
        row_layout: RowLayout | None = None,
    ):
        self.model = model
        model_kwargs = {} if model_kwargs is None else dict(model_kwargs)
        leaves, self._treedef = jax.tree_util.tree_flatten((model_args, model_kwargs))
        trace, shapes = self._structure(leaves, data_plate)
        self.data_plate, (self._plate_dim, self.padded_rows) = self._find_data_plate(
            trace, data_plate
        )
        self.layout = row_layout
        self.num_rows = self.padded_rows
        if row_layout is not None:
            if row_layout.padded_rows != self.padded_rows:
                raise ModelSpecificationError(
                    f"row_layout describes {row_layout.padded_rows} padded rows but the data "
                    f"plate {self.data_plate!r} has {self.padded_rows}: pass the arrays and "
                    "the layout that the same ndp.shard_rows call returned."
                )
            self.num_rows = row_layout.num_rows
        self._check_sites(trace)
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
        self._row_leaf_index = self._find_rows(model_args, model_kwargs)
        # The public arguments, kept as given; the rows are never stored here.
        self._public_leaves = [
            None if i in self._row_leaf_index else x for i, x in enumerate(leaves)
        ]
        # The rows' shapes and dtypes: all that the checks below read of them.
        self._row_specs = [_spec(leaves[i]) for i in self._row_leaf_index]
        example_u = {n: jnp.zeros(shapes[n].shape, shapes[n].dtype) for n in self.latent_sites}
        self._unravel = ravel_pytree(example_u)[1]
        self.num_params = int(ravel_pytree(example_u)[0].size)
        #: Shape of each latent site in unconstrained space (public structure).
        self.param_shapes = {n: tuple(jnp.shape(v)) for n, v in example_u.items()}
        try:
            self._deterministic = self._check_data_free(example_u)
        except _CONCRETIZATION_ERRORS:
            raise ModelSpecificationError(_CONCRETIZATION_MESSAGE) from None
        self._check_single_row()
        # Last of all: the one check that reads the rows' values (module docstring).
        self._check_finite([leaves[i] for i in self._row_leaf_index])

    # ------------------------------------------------------------------ setup
    def _structure(self, leaves: list, data_plate: str | None) -> tuple[dict, dict]:
        """The structure trace, with the rows abstract (:func:`_abstract_trace`).

        Which arrays hold rows depends on the plate's size, read from the trace:
        first every array argument is abstract.  A model that reads a public
        array as a value (``np.linalg.cholesky(prior_cov)``) cannot be traced so;
        then each leading size ``m`` of the arrays (largest first) is tried with
        only the arrays of ``m`` rows abstract, and taken if the data plate then
        has ``m`` rows (the rows are exactly those arrays, as :meth:`_find_rows`
        decides).  Every step reads shapes and public values only.
        """
        arrays = [i for i, x in enumerate(leaves) if _is_array(x)]

        def trace_with(abstract):
            # Quietly: a list argument keeps its values here (refused later if it
            # holds rows), so no NumPyro check may see them.
            with _quietly():
                return _abstract_trace(self.model, leaves, self._treedef, tuple(abstract),
                                       [_spec(leaves[i]) for i in abstract])

        try:
            return trace_with(arrays)
        except _CONCRETIZATION_ERRORS:
            pass
        for size in sorted({np.shape(leaves[i])[0] for i in arrays}, reverse=True):
            try:
                trace, shapes = trace_with([i for i in arrays if np.shape(leaves[i])[0] == size])
                if self._find_data_plate(trace, data_plate)[1][1] == size:
                    return trace, shapes
            except (*_CONCRETIZATION_ERRORS, ModelSpecificationError):
                continue
        raise ModelSpecificationError(_CONCRETIZATION_MESSAGE) from None

    def _find_data_plate(self, trace: dict, data_plate: str | None):
        plates = _plates(trace)
        observed = [
            s for s in trace.values() if s["type"] == "sample" and s["is_observed"]
        ]
        likelihood = [s for s in observed if not _is_factor(s)]
        if not likelihood:
            # A likelihood written only with `numpyro.factor` inside a plate:
            # those factors are the per-row terms, so they locate the plate.
            likelihood = [s for s in observed if s["cond_indep_stack"]]
        if not likelihood:
            raise ModelSpecificationError(
                "The model has no observed sample site, so there is no data to "
                "protect. Pass the data as `obs=` of a sample site inside a "
                "`numpyro.plate` over the rows."
            )
        if data_plate is not None:
            if data_plate not in plates:
                raise ModelSpecificationError(
                    f"data_plate={data_plate!r} is not a plate of the model; the "
                    f"plates found are {sorted(plates)}. Pass one of them."
                )
            chosen = data_plate
        else:
            common = set.intersection(
                *({f.name for f in s["cond_indep_stack"]} for s in likelihood)
            )
            if not common:
                outside = sorted(s["name"] for s in likelihood if not s["cond_indep_stack"])
                where = (
                    f"observed site(s) {outside} lie outside every plate"
                    if outside
                    else "no single plate holds every observed site"
                )
                raise ModelSpecificationError(
                    f"Could not find the data plate: {where} (plates found: "
                    f"{sorted(plates) or 'none'}). Wrap every observed site in one "
                    "`with numpyro.plate('data', n):` block over the rows; an "
                    "observed value outside the row plate cannot be privatised."
                )
            if len(common) > 1:
                raise ModelSpecificationError(
                    f"Several plates hold every observed site: {sorted(common)}. "
                    "Say which one runs over the data rows with `data_plate=`."
                )
            chosen = common.pop()
        outside = sorted(
            s["name"] for s in observed if not _in_plate(s, chosen) and not _is_factor(s)
        )
        if outside:
            raise ModelSpecificationError(
                f"Observed site(s) {outside} lie outside the data plate "
                f"{chosen!r}; their values cannot be privatised. Move them inside "
                f"`numpyro.plate({chosen!r}, n)` or pass them as public constants."
            )
        for name, site in trace.items():
            if site["type"] == "plate" and name == chosen:
                size, subsample_size = site["args"]
                if subsample_size is not None and subsample_size != size:
                    raise ModelSpecificationError(
                        f"Plate {chosen!r} subsamples its rows. The DP kernels choose "
                        "rows themselves and their accounting assumes the full plate: "
                        "remove `subsample_size`."
                    )
        return chosen, plates[chosen]

    def _check_sites(self, trace: dict) -> None:
        for name, site in trace.items():
            if site["type"] != "sample" or site["is_observed"]:
                continue
            if _in_plate(site, self.data_plate):
                raise ModelSpecificationError(
                    f"Latent site {name!r} lies inside the data plate "
                    f"{self.data_plate!r}: its draws would publish per-row "
                    "information. If it is data, pass its values with `obs=`; "
                    "otherwise marginalise it out (e.g. write the row likelihood "
                    "as a mixture) or move it out of the plate."
                )
            if site["fn"].is_discrete:
                raise ModelSpecificationError(
                    f"Latent site {name!r} is discrete; the DP kernels move in "
                    "NumPyro's unconstrained Euclidean space and need continuous "
                    "latents. Marginalise it out or replace it by a continuous "
                    "relaxation."
                )

    def _find_rows(self, model_args: tuple, model_kwargs: dict) -> tuple[int, ...]:
        arguments = (*model_args, *model_kwargs.values())
        if self.padded_rows > 1 and any(
            _sequences_of_length(x, self.padded_rows) for x in arguments
        ):
            raise ModelSpecificationError(
                "A model argument is a Python list or tuple with one item per row. "
                "Rows are recognised as private only in arrays (leading axis = rows); "
                "pass it as an array, e.g. `jnp.asarray(y)`."
            )
        leaves = jax.tree_util.tree_leaves((model_args, model_kwargs))
        rows = tuple(
            i
            for i, x in enumerate(leaves)
            if _is_array(x) and np.shape(x)[0] == self.padded_rows
        )
        if not rows:
            # The plate's size may have been computed from the data (e.g. a count
            # of rows with y > 0): do not quote it.
            sizes = sorted({np.shape(x)[0] for x in leaves if _is_array(x)})
            raise ModelSpecificationError(
                f"The size of the data plate {self.data_plate!r} is not the number of "
                f"rows of any model argument (their leading sizes: {sizes or 'none'}). "
                "Make the plate size the number of rows, e.g. "
                "`numpyro.plate('data', X.shape[0])`, with rows on the leading axis, "
                "and never compute it from the data's values."
            )
        return rows

    def _check_finite(self, rows: list) -> None:
        for i, x in zip(self._row_leaf_index, rows, strict=True):
            if not _all_finite(x):
                raise ModelSpecificationError(_nonfinite_message(f"model argument #{i}"))

    def _check_single_row(self) -> None:
        """Each l_i is computed from row i alone: the model must run on one row.

        Traced on one abstract row; the values compared are computed on
        :data:`PROBE_ROWS` stand-in rows (:func:`_stand_ins`), never the data.
        """
        leaves, treedef, index = self._public_leaves, self._treedef, self._row_leaf_index
        one = [jax.ShapeDtypeStruct((1,) + s.shape[1:], s.dtype) for s in self._row_specs]
        try:
            trace, _ = _abstract_trace(self.model, leaves, treedef, index, one)
            size = self._plate_size(trace)
        except Exception as err:  # noqa: BLE001 - raised on an abstract row: public
            raise ModelSpecificationError(
                "The model fails when given a single row of its data "
                f"({type(err).__name__}: {err}). numpyro-dp "
                "evaluates every row's log-likelihood on that row alone, so that no "
                "row's term can read another row: take every size from the data (e.g. "
                f"`numpyro.plate({self.data_plate!r}, X.shape[0])`) and do not compute "
                "statistics across rows (such as standardising X) inside the model; "
                "do that with public constants before the call."
            ) from err
        if size != 1:
            raise ModelSpecificationError(
                f"The data plate {self.data_plate!r} does not have size 1 when the model "
                "is given a single row. numpyro-dp evaluates every row's log-likelihood "
                "on that row alone, so the plate size must come from the data's shape: "
                f"write `numpyro.plate({self.data_plate!r}, X.shape[0])`, not a constant "
                "or a count computed from the values."
            )
        # Same values as the model on a few rows (else l_i reads other rows or n).
        k = min(self.padded_rows, PROBE_ROWS)
        probe = _stand_ins([jax.ShapeDtypeStruct((k,) + s.shape[1:], s.dtype)
                            for s in self._row_specs])

        def compare(rows):  # compiled once: far faster than NumPyro's ops one by one
            args, kwargs = _replace(leaves, treedef, index, rows)
            params = self.init_params(jax.random.PRNGKey(0), args, kwargs)
            together = self._split(params, args, kwargs)[1]
            alone = self.log_density_terms(params, args, kwargs, positions=jnp.arange(k))
            return together, alone.loglik_rows

        with _quietly():  # one program per model and shapes, shared by later runs
            together, alone = compile_once(compare, probe)(probe)
        if not np.allclose(together, alone, rtol=1e-3, atol=1e-3, equal_nan=True):
            raise ModelSpecificationError(
                "A row's log-likelihood changes when the model is given that row "
                "alone: the likelihood reads other rows (e.g. standardises X or uses "
                "a column mean inside the model) or the number of rows. A row's term "
                "may depend on that row only: compute such statistics from public "
                "constants before the call, and pass n as a separate argument."
            )

    def _check_data_free(self, example_u: dict):
        """Prove that prior terms and transforms do not read the rows.

        Returns the names of deterministic sites that are safe to publish.
        """
        leaves, treedef, rows = self._public_leaves, self._treedef, self._row_specs

        def probe(params, row_leaves):
            args, kwargs = self._with_rows(leaves, treedef, row_leaves)
            tr, log_dets = self._trace(params, args, kwargs)
            out = {}
            for name, site in tr.items():
                if site["type"] == "deterministic":
                    out[("deterministic", name)] = site["value"]
                elif site["type"] == "sample" and not site["is_observed"]:
                    out[("latent", name)] = (site["value"], _site_log_prob(site))
                elif _is_factor(site) and not _in_plate(site, self.data_plate):
                    out[("factor", name)] = _site_log_prob(site)
            out.update({("jacobian", n): v for n, v in log_dets.items()})
            return out

        def log_density(params, row_leaves):  # the whole model, likelihood included
            return self._split(params, *self._with_rows(leaves, treedef, row_leaves))

        captured = [shape for shape in captured_shapes(log_density, example_u, rows)
                    if len(shape) >= 1 and shape[0] == self.padded_rows]
        if self.padded_rows > 1 and captured:
            raise ModelSpecificationError(
                f"The model reads an array with one entry per row ({self.padded_rows} rows) "
                "that is not one of its arguments (a global variable, a closure, or an "
                "array built inside the model from a Python list or NumPy). Such rows "
                "would be treated as public and leak: pass every per-row array as a "
                "model argument. (A public constant of that length built inside the "
                "model with NumPy, such as np.arange(n), triggers this too: build it "
                "with jnp, e.g. jnp.arange(X.shape[0]).)"
            )
        flags = depends_on_private(probe, example_u, rows)
        leaky = sorted(
            f"{kind} {name!r}"
            for (kind, name), f in flags.items()
            if kind != "deterministic" and any(jax.tree_util.tree_leaves(f))
        )
        if leaky:
            raise ModelSpecificationError(
                f"The prior part of the model reads the private data: {leaky}. "
                "Priors, parameter supports and factors outside the data plate "
                "must use public constants only; pass hyperparameters "
                "as numbers, not as functions of the data."
            )
        safe, dropped = [], []
        for (kind, name), f in flags.items():
            if kind == "deterministic":
                (dropped if f else safe).append(name)
        if dropped:
            warnings.warn(
                f"Deterministic site(s) {sorted(dropped)} depend on the private data "
                "and are left out of the returned samples.",
                stacklevel=3,
            )
        return tuple(sorted(safe))

    # ------------------------------------------------------------- inputs
    def row_mask(self) -> jax.Array | None:
        """``True`` on the real rows of padded arrays (None when nothing is padded)."""
        return None if self.layout is None else self.layout.mask()

    def positions(self, idx: jax.Array) -> jax.Array:
        """Where rows ``idx`` of ``[0, num_rows)`` lie in the (possibly padded) arrays."""
        return idx if self.layout is None else self.layout.positions(idx)

    def private_inputs(self, model_args: tuple, model_kwargs: dict) -> tuple:
        """The row arrays of ``(model_args, model_kwargs)``: what a compiled sampler takes."""
        leaves = jax.tree_util.tree_leaves((model_args, model_kwargs))
        return tuple(jnp.asarray(leaves[i]) for i in self._row_leaf_index)

    def rebuild(self, rows) -> tuple[tuple, dict]:
        """``(model_args, model_kwargs)`` from :meth:`private_inputs` (possibly traced)
        and the public arguments given at construction."""
        return self._with_rows(self._public_leaves, self._treedef, rows)

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
        rows = [np.zeros((1,) + tuple(s.shape[1:]), s.dtype) for s in self._row_specs]
        args, kwargs = self.rebuild(rows)

        def loglik(params):
            return jnp.sum(self._split(params, args, kwargs)[1])

        dtype = jnp.result_type(float)
        example = {n: np.zeros(shape, dtype) for n, shape in self.param_shapes.items()}
        with _quietly():
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
        ``theta`` is the row's expected one (:func:`_expected_log_prob`): for
        curvature only, its gradient is not the row's.
        """
        leaves, treedef = jax.tree_util.tree_flatten((model_args, model_kwargs))
        rows = [leaves[i] for i in self._row_leaf_index]

        def loglik(theta, row):
            args, kwargs = self._with_rows(leaves, treedef, [x[None] for x in row])
            return self._split(self.unravel(theta), args, kwargs, expected)[1][0]

        return loglik, rows

    # ------------------------------------------------------------- evaluation
    def _with_rows(self, leaves, treedef, row_leaves):
        return _replace(leaves, treedef, self._row_leaf_index, row_leaves)

    def _trace(self, params: dict, model_args: tuple, model_kwargs: dict):
        """Run the model at unconstrained ``params``; return trace and log-Jacobians."""
        log_dets = {}

        def constrain(site):
            name = site["name"]
            if site["type"] != "sample" or name not in params:
                return None
            u = params[name]
            t = biject_to(site["fn"].support)
            value = t(u)
            ld = t.log_abs_det_jacobian(u, value)
            ld = sum_rightmost(ld, jnp.ndim(ld) - jnp.ndim(value) + len(site["fn"].event_shape))
            if site["scale"] is not None:
                ld = site["scale"] * ld
            log_dets[name] = jnp.sum(ld)
            return value

        tr = handlers.trace(handlers.substitute(self.model, substitute_fn=constrain)).get_trace(
            *model_args, **model_kwargs
        )
        return tr, log_dets

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
        leaves, treedef = jax.tree_util.tree_flatten((model_args, model_kwargs))
        row_leaves = [jnp.asarray(leaves[i]) for i in self._row_leaf_index]
        if idx is not None:
            positions = self.positions(idx)
        if positions is not None:
            row_leaves = [x[positions] for x in row_leaves]

        def one_row(row):
            # The model sees this row alone, so l_i cannot read another row (a
            # model that, say, standardises X inside would otherwise make every
            # l_i depend on every row, and clipping l_i would bound nothing).
            args, kwargs = self._with_rows(leaves, treedef, [x[None] for x in row])
            return self._split(params, args, kwargs)[1][0]

        rows = jax.vmap(one_row)(row_leaves)
        mask = self.row_mask() if positions is None else None
        if mask is not None:  # padding: exactly 0, whatever the model makes of a zero row
            rows = jnp.where(mask, rows, 0.0)
        # The prior is data-free (proved at setup) but may use the public n.
        return LogDensityTerms(self._split(params, model_args, model_kwargs)[0], rows)

    def _split(self, params: dict, model_args: tuple, model_kwargs: dict,
               expected: bool = False):
        """(prior, per-row log-likelihoods) of one run of the model (with
        ``expected``, the likelihood of :func:`_expected_log_prob`)."""
        tr, log_dets = self._trace(params, model_args, model_kwargs)
        num_rows = self._plate_size(tr)
        prior = sum(log_dets.values(), jnp.zeros(()))
        rows = jnp.zeros((num_rows,))
        for site in tr.values():
            if site["type"] != "sample":
                continue
            if not site["is_observed"]:
                prior = prior + jnp.sum(_site_log_prob(site))
            elif _in_plate(site, self.data_plate):
                lp = _expected_log_prob(site) if expected else _site_log_prob(site)
                rows = rows + self._per_row(lp, num_rows)
            else:  # a data-free factor outside the plate (checked at setup)
                prior = prior + jnp.sum(_site_log_prob(site))
        return prior, rows

    def _plate_size(self, trace: dict) -> int:
        return trace[self.data_plate]["args"][0]

    def _per_row(self, log_prob: jax.Array, num_rows: int) -> jax.Array:
        """Sum a site's log-prob over every dimension but the data-plate one."""
        dim = self._plate_dim
        missing = max(0, -dim - jnp.ndim(log_prob))
        log_prob = jnp.reshape(log_prob, (1,) * missing + jnp.shape(log_prob))
        log_prob = jnp.moveaxis(log_prob, dim, 0)
        log_prob = jnp.broadcast_to(log_prob, (num_rows,) + log_prob.shape[1:])
        return jnp.reshape(log_prob, (num_rows, -1)).sum(-1)

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
        leaves, treedef = jax.tree_util.tree_flatten((model_args, model_kwargs))
        # zeros_like: on the devices the rows lie on (they may fill a mesh).
        zeros = [jnp.zeros_like(leaves[i]) for i in self._row_leaf_index]
        with _quietly():
            tr = _structure_trace(self.model, *self._with_rows(leaves, treedef, zeros),
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
        tr, _ = self._trace(params, model_args, model_kwargs)
        keep = set(self.latent_sites) | set(self._deterministic)
        return {n: s["value"] for n, s in tr.items() if n in keep}


def _site_log_prob(site: dict) -> jax.Array:
    if site.get("intermediates"):
        lp = site["fn"].log_prob(site["value"], site["intermediates"])
    else:
        lp = site["fn"].log_prob(site["value"])
    if site["scale"] is not None:
        lp = site["scale"] * lp
    return lp


def _expected_log_prob(site: dict) -> jax.Array:
    """A log-probability whose Hessian in the parameters is, row by row, the expected
    Hessian (the Fisher information, negated) at the parameters it is evaluated at.

    The mean of the site's log-probability at ``y = mean +- sd`` of its own
    distribution, those values held constant (``stop_gradient``): exact where the
    log-probability is quadratic in ``y`` (a normal's, with its scale) or linear (a
    Bernoulli's, a Poisson's, a binomial's: their Hessian does not depend on ``y``);
    a two-point rule elsewhere.  The observed value stands in where a point is not
    finite or outside the support, or where the distribution has no mean or
    variance (a factor).  The Newton steps of Fisher scoring (iteratively
    reweighted least squares) use it: unlike the observed Hessian it is positive
    definite away from the mode, where a regression's coefficients and its noise
    scale couple (``(beta, log sigma)`` far from the least-squares fit).
    """
    fn, value = site["fn"], site["value"]
    try:
        mean, sd = fn.mean, jnp.sqrt(fn.variance)
    except NotImplementedError:
        return _site_log_prob(site)
    total = 0.0
    for sign in (1.0, -1.0):
        point = jnp.broadcast_to(mean + sign * sd, jnp.shape(value))
        ok = jnp.isfinite(point) & fn.support(point)
        ok = jnp.reshape(ok, jnp.shape(ok) + (1,) * (jnp.ndim(point) - jnp.ndim(ok)))
        point = lax.stop_gradient(jnp.where(ok, point, value))
        lp = fn.log_prob(point)
        if site["scale"] is not None:
            lp = site["scale"] * lp
        total = total + 0.5 * lp
    return total
