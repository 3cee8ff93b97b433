"""Model-specification checks: what private inference refuses, and why.

:class:`~numpyro_dp.model.adapter.PrivateModel` runs these at construction,
before any private value is computed, and each refusal is a
:class:`ModelSpecificationError` that names the problem and the fix: no data
plate, several candidate plates, observed sites outside the plate, latent
sites inside it, discrete latents, plate subsampling, a size computed from the
rows, rows that reach the model other than as arrays among its arguments, a
row's log-likelihood that reads other rows, and priors, transforms or factors
outside the plate that read the data (checked structurally on the traced
program, see :mod:`numpyro_dp.model.dataflow`).

None of them depends on the rows' values (SPEC: every release is charged).
They read the model's structure traced with the rows abstract
(:func:`~numpyro_dp.model.tracing.abstract_trace`); checks that need numbers
run on stand-in rows (:func:`~numpyro_dp.model.tracing.stand_ins`).  The one
exception is :func:`check_finite`, the refusal of NaN/inf in the row arrays,
run last of all: such values lie outside the data domain that privacy is
claimed for, and the refusal tells whoever sees it that some row holds one.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_dp.model.dataflow import captured_shapes, depends_on_private
from numpyro_dp.model.layout import RowLayout
from numpyro_dp.model.log_density import constrained_trace, plate_size, site_log_prob
from numpyro_dp.model.tracing import (
    abstract_trace,
    in_plate,
    is_array,
    is_factor,
    plates,
    quietly,
    replace_leaves,
    shape_dtype,
    stand_ins,
)
from numpyro_dp.primitives.compiled import compile_once

if TYPE_CHECKING:
    from numpyro_dp.model.adapter import PrivateModel


class ModelSpecificationError(ValueError):
    """A model or data set that cannot be made differentially private as given."""


#: Stand-in rows on which a row's log-likelihood alone and among others are compared.
PROBE_ROWS = 8

#: What JAX raises when a model turns a traced argument into a Python value.
CONCRETIZATION_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
)
CONCRETIZATION_MESSAGE = (
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


def _sequences_of_length(tree: Any, length: int) -> bool:
    """Whether ``tree`` holds a Python list or tuple of ``length`` items (not arrays)."""
    if isinstance(tree, (list, tuple)):
        if len(tree) == length and not hasattr(tree, "_fields"):
            return True
        return any(_sequences_of_length(x, length) for x in tree)
    if isinstance(tree, dict):
        return any(_sequences_of_length(x, length) for x in tree.values())
    return False


def find_structure(
    model: Callable, leaves: list, treedef, data_plate: str | None
) -> tuple[dict, dict]:
    """The structure trace, with the rows abstract
    (:func:`~numpyro_dp.model.tracing.abstract_trace`).

    Which arrays hold rows depends on the plate's size, read from the trace:
    first every array argument is abstract.  A model that reads a public
    array as a value (``np.linalg.cholesky(prior_cov)``) cannot be traced so;
    then each leading size ``m`` of the arrays (largest first) is tried with
    only the arrays of ``m`` rows abstract, and taken if the data plate then
    has ``m`` rows (the rows are exactly those arrays, as :func:`find_rows`
    decides).  Every step reads shapes and public values only.
    """
    arrays = [i for i, x in enumerate(leaves) if is_array(x)]

    def trace_with(abstract):
        # Quietly: a list argument keeps its values here (refused later if it
        # holds rows), so no NumPyro check may see them.
        with quietly():
            return abstract_trace(model, functools.partial(replace_leaves, leaves, treedef,
                                                           tuple(abstract)),
                                  [shape_dtype(leaves[i]) for i in abstract])

    try:
        return trace_with(arrays)
    except CONCRETIZATION_ERRORS:
        pass
    for size in sorted({np.shape(leaves[i])[0] for i in arrays}, reverse=True):
        try:
            trace, shapes = trace_with([i for i in arrays if np.shape(leaves[i])[0] == size])
            if find_data_plate(trace, data_plate)[1][1] == size:
                return trace, shapes
        except (*CONCRETIZATION_ERRORS, ModelSpecificationError):
            continue
    raise ModelSpecificationError(CONCRETIZATION_MESSAGE) from None


def find_data_plate(trace: dict, data_plate: str | None) -> tuple[str, tuple[int, int]]:
    """The data plate's name and ``(dim, size)``: ``data_plate`` if given, else the one
    plate that holds every observed site; refused if there is none, or several."""
    all_plates = plates(trace)
    observed = [
        s for s in trace.values() if s["type"] == "sample" and s["is_observed"]
    ]
    likelihood = [s for s in observed if not is_factor(s)]
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
        if data_plate not in all_plates:
            raise ModelSpecificationError(
                f"data_plate={data_plate!r} is not a plate of the model; the "
                f"plates found are {sorted(all_plates)}. Pass one of them."
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
                f"{sorted(all_plates) or 'none'}). Wrap every observed site in one "
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
        s["name"] for s in observed if not in_plate(s, chosen) and not is_factor(s)
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
    return chosen, all_plates[chosen]


def check_layout(row_layout: RowLayout | None, padded_rows: int, data_plate: str) -> None:
    """Refuse a row layout made for arrays of another number of rows."""
    if row_layout is not None and row_layout.padded_rows != padded_rows:
        raise ModelSpecificationError(
            f"row_layout describes {row_layout.padded_rows} padded rows but the data "
            f"plate {data_plate!r} has {padded_rows}: pass the arrays and "
            "the layout that the same ndp.shard_rows call returned."
        )


def check_sites(trace: dict, data_plate: str) -> None:
    """Refuse latent sites inside the data plate and discrete latent sites."""
    for name, site in trace.items():
        if site["type"] != "sample" or site["is_observed"]:
            continue
        if in_plate(site, data_plate):
            raise ModelSpecificationError(
                f"Latent site {name!r} lies inside the data plate "
                f"{data_plate!r}: its draws would publish per-row "
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


def find_rows(
    model_args: tuple, model_kwargs: dict, padded_rows: int, data_plate: str
) -> tuple[int, ...]:
    """The flat indices of the argument leaves that hold rows: the arrays of
    ``padded_rows`` rows.  Lists or tuples of one item per row are refused."""
    arguments = (*model_args, *model_kwargs.values())
    if padded_rows > 1 and any(
        _sequences_of_length(x, padded_rows) for x in arguments
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
        if is_array(x) and np.shape(x)[0] == padded_rows
    )
    if not rows:
        # The plate's size may have been computed from the data (e.g. a count
        # of rows with y > 0): do not quote it.
        sizes = sorted({np.shape(x)[0] for x in leaves if is_array(x)})
        raise ModelSpecificationError(
            f"The size of the data plate {data_plate!r} is not the number of "
            f"rows of any model argument (their leading sizes: {sizes or 'none'}). "
            "Make the plate size the number of rows, e.g. "
            "`numpyro.plate('data', X.shape[0])`, with rows on the leading axis, "
            "and never compute it from the data's values."
        )
    return rows


def check_finite(row_leaf_index: tuple[int, ...], rows: list) -> None:
    """Refuse NaN or inf in the row arrays: the one check that reads their values."""
    for i, x in zip(row_leaf_index, rows, strict=True):
        if not _all_finite(x):
            raise ModelSpecificationError(_nonfinite_message(f"model argument #{i}"))


def check_single_row(pm: PrivateModel, split: Callable) -> None:
    """Each l_i is computed from row i alone: the model must run on one row.

    Traced on one abstract row; the values compared are computed on
    :data:`PROBE_ROWS` stand-in rows (:func:`~numpyro_dp.model.tracing.stand_ins`),
    never the data.  ``split(params, model_args, model_kwargs)`` is ``pm``'s
    :func:`~numpyro_dp.model.log_density.split_log_density`.
    """
    one = [jax.ShapeDtypeStruct((1,) + s.shape[1:], s.dtype) for s in pm.row_specs]
    try:
        trace, _ = abstract_trace(pm.model, pm.rebuild, one)
        size = plate_size(trace, pm.data_plate)
    except Exception as err:  # noqa: BLE001 - raised on an abstract row: public
        raise ModelSpecificationError(
            "The model fails when given a single row of its data "
            f"({type(err).__name__}: {err}). numpyro-dp "
            "evaluates every row's log-likelihood on that row alone, so that no "
            "row's term can read another row: take every size from the data (e.g. "
            f"`numpyro.plate({pm.data_plate!r}, X.shape[0])`) and do not compute "
            "statistics across rows (such as standardising X) inside the model; "
            "do that with public constants before the call."
        ) from err
    if size != 1:
        raise ModelSpecificationError(
            f"The data plate {pm.data_plate!r} does not have size 1 when the model "
            "is given a single row. numpyro-dp evaluates every row's log-likelihood "
            "on that row alone, so the plate size must come from the data's shape: "
            f"write `numpyro.plate({pm.data_plate!r}, X.shape[0])`, not a constant "
            "or a count computed from the values."
        )
    # Same values as the model on a few rows (else l_i reads other rows or n).
    k = min(pm.padded_rows, PROBE_ROWS)
    probe = stand_ins([jax.ShapeDtypeStruct((k,) + s.shape[1:], s.dtype)
                       for s in pm.row_specs])

    def compare(rows):  # compiled once: far faster than NumPyro's ops one by one
        args, kwargs = pm.rebuild(rows)
        params = pm.init_params(jax.random.PRNGKey(0), args, kwargs)
        together = split(params, args, kwargs)[1]
        alone = pm.log_density_terms(params, args, kwargs, positions=jnp.arange(k))
        return together, alone.loglik_rows

    with quietly():  # one program per model and shapes, shared by later runs
        together, alone = compile_once(compare, probe)(probe)
    if not np.allclose(together, alone, rtol=1e-3, atol=1e-3, equal_nan=True):
        raise ModelSpecificationError(
            "A row's log-likelihood changes when the model is given that row "
            "alone: the likelihood reads other rows (e.g. standardises X or uses "
            "a column mean inside the model) or the number of rows. A row's term "
            "may depend on that row only: compute such statistics from public "
            "constants before the call, and pass n as a separate argument."
        )


def check_data_free(pm: PrivateModel, split: Callable, example_u: dict) -> tuple[str, ...]:
    """Prove that prior terms and transforms do not read the rows.

    ``split`` is as in :func:`check_single_row`, ``example_u`` an example of the
    unconstrained latents.  Returns the names of deterministic sites that are
    safe to publish.
    """
    rows = pm.row_specs

    def probe(params, row_leaves):
        tr, log_dets = constrained_trace(pm.model, params, *pm.rebuild(row_leaves))
        out = {}
        for name, site in tr.items():
            if site["type"] == "deterministic":
                out[("deterministic", name)] = site["value"]
            elif site["type"] == "sample" and not site["is_observed"]:
                out[("latent", name)] = (site["value"], site_log_prob(site))
            elif is_factor(site) and not in_plate(site, pm.data_plate):
                out[("factor", name)] = site_log_prob(site)
        out.update({("jacobian", n): v for n, v in log_dets.items()})
        return out

    def log_density(params, row_leaves):  # the whole model, likelihood included
        return split(params, *pm.rebuild(row_leaves))

    captured = [shape for shape in captured_shapes(log_density, example_u, rows)
                if len(shape) >= 1 and shape[0] == pm.padded_rows]
    if pm.padded_rows > 1 and captured:
        raise ModelSpecificationError(
            f"The model reads an array with one entry per row ({pm.padded_rows} rows) "
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


def row_leaves(model: Callable, model_args: tuple, model_kwargs: dict,
               data_plate: str | None) -> tuple[int, ...]:
    """The flat indices of the argument leaves that hold rows, from the model's
    structure alone (shapes and public values, the rows abstract): what the runner
    places on a mesh before :class:`~numpyro_dp.model.adapter.PrivateModel` analyses
    and validates the model once, on the placed rows."""
    leaves, treedef = jax.tree_util.tree_flatten((model_args, model_kwargs))
    trace, _ = find_structure(model, leaves, treedef, data_plate)
    name, (_, padded_rows) = find_data_plate(trace, data_plate)
    return find_rows(model_args, model_kwargs, padded_rows, name)
