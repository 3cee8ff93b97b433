"""The model adapter's tests run in float64 (hand-written float64 references) and
share the cases of ``_support.model_cases``, each built once per module."""

import jax
import pytest
from _support.model_cases import CASES, _pm


@pytest.fixture(scope="module")
def model_x64():
    """Float64 for exact comparisons with the hand-written references (module-wide)."""
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, model_x64):
    """Each case is built once per module (model construction traces the model)."""
    c = CASES[request.param]()
    c.pm = _pm(c)
    return c
