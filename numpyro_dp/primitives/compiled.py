"""Programs compiled once per process, looked up by what they compute.

``jax.jit`` caches a compiled program on the Python function it wraps.  A
sampler's loop is a new closure on every run (NumPyro's ``fori_collect``
builds one per ``MCMC.run``; a notebook cell builds a new kernel, runner and
often a new model function), so the same program is compiled again on every
run.  The opposite failure is worse: a *cached* function whose closure has
changed since it was traced (another public argument of the model, say) runs
the stale program silently.

:func:`compile_once` therefore traces and lowers the function on every call
(cheap) and looks the compiled executable up by a fingerprint of the lowered
module: its text, with the pytree structure of its inputs and outputs and the
placement of its arguments.  Every value a closure captures is a constant of
that text or a shape in it, so a hit runs exactly the program just traced,
and no key can miss what the program depends on.  Three things would live
outside the text, and are handled: arguments the program does not use
(``keep_unused=True``: every argument is one of the module's, in order);
constants that JAX passes as hidden arguments (``jax.const`` in the text,
under ``jax_use_simplified_jaxpr_constants``), whose values join the key;
and Python callbacks (``jax.debug.print``, ``jax.debug.callback``,
``jax.pure_callback``: the text holds an index, the function is the
executable's): a program that calls back into Python is compiled for its own
use and never shared.  Neither side holds private data: the rows and the run
secret are arguments, never constants
(:class:`~numpyro_dp.kernels.running.RunInputs`).
"""

from __future__ import annotations

import collections
import hashlib
import re
import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

#: Compiled programs kept per process (least recently used dropped first):
#: each holds memory and memory maps until it is dropped or :func:`clear` ed.
MAX_PROGRAMS = 16

_programs: collections.OrderedDict[str, jax.stages.Compiled] = collections.OrderedDict()
_lock = threading.Lock()
#: Compilations and cache hits of this process (what the tests read to check
#: that a program is shared).
stats = {"compiled": 0, "reused": 0}
#: A custom call into Python (the callbacks of every backend).
_PYTHON_CALLBACK = re.compile(r"custom_call @\w*python\w*callback")
#: How the text marks a constant that JAX passes as a hidden argument
#: (``jax_use_simplified_jaxpr_constants``): its value is not in the text.
_HIDDEN_CONSTANT = "jax.const = true"


def _hidden_constants(lowered: jax.stages.Lowered, text: str) -> list | None:
    """Constants JAX passes as hidden arguments (``jax.const`` in the text), or None
    where the program has some but they cannot be read (then it is not shared)."""
    if _HIDDEN_CONSTANT not in text:
        return []
    consts = getattr(getattr(lowered, "_lowering", None), "const_args", None)
    return None if consts is None else [np.asarray(c) for c in consts]


def _fingerprint(lowered: jax.stages.Lowered, text: str, args: Sequence,
                 constants: list) -> str:
    placement = [str(getattr(leaf, "sharding", None)) for leaf in jax.tree.leaves(args)]
    digest = hashlib.sha256()
    for part in (text, str(lowered.in_tree), str(lowered.out_tree),
                 jax.default_backend(), str(jax.config.jax_default_device), *placement):
        digest.update(part.encode())
        digest.update(b"\0")
    for c in constants:  # public values (the rows and the secret are arguments)
        digest.update(f"{c.dtype}{c.shape}".encode())
        digest.update(c.tobytes())
    return digest.hexdigest()


def compile_once(
    fun: Callable, *args, donate_argnums: int | tuple[int, ...] = ()
) -> Callable:
    """``jax.jit(fun).lower(*args).compile()``, compiled once per program.

    Parameters
    ----------
    fun : callable
        A jit-able function (any closure; it is traced afresh).
    *args
        Example arguments: arrays or abstract values of the calls to come.
    donate_argnums : int or tuple of int
        As in :func:`jax.jit`.

    Returns
    -------
    callable
        A ``jax.stages.Compiled`` with arguments of the same structure, shapes
        and placement; ``fun`` itself under ``jax.disable_jit()``, which runs
        op by op and has no ahead-of-time path.
    """
    if jax.config.jax_disable_jit:
        return fun
    lowered = jax.jit(fun, donate_argnums=donate_argnums, keep_unused=True).lower(*args)
    text = lowered.as_text()
    constants = _hidden_constants(lowered, text)
    shared = not _PYTHON_CALLBACK.search(text) and constants is not None
    key = _fingerprint(lowered, text, args, constants) if shared else None
    with _lock:
        compiled = _programs.get(key) if shared else None
        if compiled is not None:
            _programs.move_to_end(key)
            stats["reused"] += 1
            return compiled
    compiled = lowered.compile()
    with _lock:
        stats["compiled"] += 1
        if shared:
            _programs[key] = compiled
            while len(_programs) > MAX_PROGRAMS:
                _programs.popitem(last=False)
    return compiled


#: Bytes per element of the HLO types a collective carries.
_BYTES = {"s32": 4, "f32": 4, "u32": 4, "s64": 8, "f64": 8, "u64": 8, "pred": 1}
_COLLECTIVE = re.compile(r"(all-gather|all-reduce|all-to-all|collective-permute)(?:-start)?\(")


def collectives(hlo: str) -> list[dict]:
    """Each collective instruction of an HLO module's text (``Compiled.as_text()``):
    its kind and the bytes of its operands (what the benchmarks and tests read to
    see what moves between devices)."""
    out = []
    for line in hlo.splitlines():
        found = _COLLECTIVE.search(line)
        if not found or "=" not in line:
            continue
        result_type = line.split("=", 1)[1].split(found.group(1))[0]
        size = 0
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result_type):
            count = 1
            for d in filter(None, dims.split(",")):
                count *= int(d)
            size += count * _BYTES.get(dtype, 4)
        out.append({"kind": found.group(1), "bytes": size})
    return out


def clear() -> None:
    """Forget every compiled program (as :func:`jax.clear_caches` does for JAX's own)."""
    with _lock:
        _programs.clear()


def jit_once(fun: Callable) -> Callable:
    """``jax.jit(fun)`` whose executables are shared through :func:`compile_once`.

    Within the returned function's life a program is looked up by its
    arguments' structure and abstract values (as ``jax.jit`` does); the first
    call with new ones traces ``fun`` and takes the executable of any earlier
    program with the same text.  For closures built anew on every run.
    """
    programs: dict = {}

    def call(*args):
        leaves, tree = jax.tree.flatten(args)
        key = (tree, tuple(jax.typeof(leaf) for leaf in leaves))
        if key not in programs:
            programs[key] = compile_once(fun, *args)
        return programs[key](*args)

    return call
