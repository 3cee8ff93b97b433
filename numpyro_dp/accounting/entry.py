"""A ledger's entries: one charged call each, and their events written as JSON.

A :class:`LedgerEntry` is what :class:`~numpyro_dp.accounting.ledger.PrivacyLedger`
holds and composes; :func:`event_to_json` and :func:`event_from_json` write and
read its events field by field, so that a ledger file
(:mod:`~numpyro_dp.accounting.ledger_file`) rebuilds them exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator

import dp_accounting as dpa

from numpyro_dp.accounting.events import count_releases, noise_multipliers
from numpyro_dp.accounting.rdp import BarkerDpEvent
from numpyro_dp.model.units import ROW


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    """One charged call of a kernel: ``num_chains x num_iterations`` iterations.

    ``chain_event``, when given, is the event of one chain's ``num_iterations``
    iterations (for kernels whose cost changes over time; ``per_iteration``
    is then the first iteration's).  ``reproducible_noise`` marks a run that
    drew its noise from the test-only reproducible source (so released
    nothing private); ``label`` is free text naming the charge.
    """

    kernel: str
    phase: str
    num_chains: int
    num_iterations: int
    per_iteration: dpa.DpEvent
    chain_event: dpa.DpEvent | None = None
    reproducible_noise: bool = False
    label: str = ""
    privacy_unit: str = ROW

    @property
    def event(self) -> dpa.DpEvent:
        if self.chain_event is not None:
            return dpa.SelfComposedDpEvent(self.chain_event, self.num_chains)
        return dpa.SelfComposedDpEvent(self.per_iteration, self.num_chains * self.num_iterations)

    def to_dict(self) -> dict:
        return {
            "kernel": self.kernel,
            "phase": self.phase,
            "num_chains": self.num_chains,
            "num_iterations": self.num_iterations,
            "releases": count_releases(self.event),
            "noise_multipliers": list(noise_multipliers(self.event)),
            "per_iteration_event": repr(self.per_iteration),
            "reproducible_noise": self.reproducible_noise,
            "label": self.label,
            "privacy_unit": self.privacy_unit,
        }


# ------------------------------------------------------------ serialisation
#: The events a ledger file stores, with each field's kind: "float", "int",
#: "event" (a nested event) or "events" (a list of them).
_EVENT_FIELDS: dict[type, tuple[tuple[str, str], ...]] = {
    dpa.NoOpDpEvent: (),
    dpa.GaussianDpEvent: (("noise_multiplier", "float"),),
    dpa.LaplaceDpEvent: (("noise_multiplier", "float"),),
    dpa.RandomizedResponseDpEvent: (("noise_parameter", "float"), ("num_buckets", "int")),
    dpa.SelfComposedDpEvent: (("event", "event"), ("count", "int")),
    dpa.ComposedDpEvent: (("events", "events"),),
    dpa.PoissonSampledDpEvent: (("sampling_probability", "float"), ("event", "event")),
    dpa.SampledWithoutReplacementDpEvent: (
        ("source_dataset_size", "int"), ("sample_size", "int"), ("event", "event"),
    ),
    dpa.TruncatedSubsampledGaussianDpEvent: (
        ("dataset_size", "int"), ("sampling_probability", "float"),
        ("truncated_batch_size", "int"), ("noise_multiplier", "float"),
    ),
    BarkerDpEvent: (("batch_size", "int"),),
}
_EVENT_TYPES = {cls.__name__: cls for cls in _EVENT_FIELDS}


def event_to_json(event: dpa.DpEvent) -> dict:
    """``event`` as ``{"type": class name, field: value, ...}`` (floats exact).

    Raises
    ------
    ValueError
        For an event type that a ledger file does not store, or a value that
        is not a finite number of its field's kind.
    """
    fields = _EVENT_FIELDS.get(type(event))
    if fields is None:
        raise ValueError(
            f"A ledger file cannot store a {type(event).__name__}; it stores "
            f"{', '.join(sorted(_EVENT_TYPES))}. Use an in-memory PrivacyLedger."
        )
    out = {"type": type(event).__name__}
    for name, kind in fields:
        value = getattr(event, name)
        if kind == "event":
            out[name] = event_to_json(value)
        elif kind == "events":
            out[name] = [event_to_json(e) for e in value]
        else:
            out[name] = stored_number(value, kind, f"{type(event).__name__}.{name}")
    return out


def stored_number(value, kind: str, name: str) -> int | float:
    """``value`` as a Python int or finite float; ValueError if it is not one."""
    number = None
    if not isinstance(value, (str, bytes)):
        with contextlib.suppress(TypeError, ValueError):
            number = operator.index(value) if kind == "int" else float(value)
    if number is None or (kind == "float" and not math.isfinite(number)):
        raise ValueError(f"{name}={value!r} is not a finite {kind}; a ledger file cannot store it.")
    return number


def event_from_json(data: dict) -> dpa.DpEvent:
    """The event that :func:`event_to_json` wrote as ``data``.

    Raises
    ------
    ValueError
        If ``data`` is not something :func:`event_to_json` writes.
    """
    cls = _EVENT_TYPES.get(data.get("type")) if isinstance(data, dict) else None
    if cls is None:
        raise ValueError(f"not a stored event: {data!r}")
    fields = _EVENT_FIELDS[cls]
    if set(data) != {"type", *(name for name, _ in fields)}:
        raise ValueError(f"{cls.__name__} with fields {sorted(data)}")
    kwargs = {}
    for name, kind in fields:
        value = data[name]
        if kind == "event":
            kwargs[name] = event_from_json(value)
        elif kind == "events" and isinstance(value, list):
            kwargs[name] = [event_from_json(e) for e in value]
        elif kind == "int" and type(value) is int:
            kwargs[name] = value
        elif kind == "float" and type(value) is float and math.isfinite(value):
            kwargs[name] = value
        else:
            raise ValueError(f"{cls.__name__}.{name}={value!r} is not of kind {kind}")
    return cls(**kwargs)
