"""Find the runner under test: a `module:factory` name, then the instance it makes.

Every problem becomes a `TargetError` whose message says what is wrong and what to write instead;
the plugin turns it into a pytest usage error that names the option.
"""

from __future__ import annotations

import contextlib
import importlib
import traceback
from typing import Any, cast

from pytest_graphmode.contract import TARGET_METHODS, TargetFactory, TargetSpec, spec_problems

DEFAULT_TARGET = "pytest_graphmode.runtime.target:make_target"


class TargetError(Exception):
    """The configured target cannot be loaded or does not follow the contract."""


def load_factory(spec_str: str) -> TargetFactory:
    """Import `module:factory` and return the factory, a callable `(mode, *, seed, backend)`."""
    module_name, sep, attr_path = spec_str.partition(":")
    if not sep or not module_name or not attr_path or ":" in attr_path:
        raise TargetError(
            f"target {spec_str!r} is not of the form 'module:factory', e.g. {DEFAULT_TARGET!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TargetError(
            f"cannot import module {module_name!r} of target {spec_str!r}: {exc}; "
            "check the spelling and that it is importable from the test run (installed or on "
            "sys.path: `python -m pytest` puts the current directory there, a bare `pytest` only "
            "the folders of the test and conftest.py files it loads; or set PYTHONPATH)"
        ) from exc
    factory: Any = module
    for part in attr_path.split("."):
        if not hasattr(factory, part):
            raise TargetError(
                f"module {module_name!r} has no attribute {attr_path!r} (target {spec_str!r}); "
                f"public names there: {_public_names(module)}"
            )
        factory = getattr(factory, part)
    if not callable(factory):
        raise TargetError(
            f"target {spec_str!r} is a {type(factory).__name__}, not callable; it must be a "
            "factory `(mode, *, seed, backend) -> GraphTarget`"
        )
    return cast(TargetFactory, factory)


def check_target(target: object) -> None:
    """Raise `TargetError` listing every way `target` breaks the contract's shape."""
    problems = [
        f"method {name}() missing"
        for name in TARGET_METHODS
        if not callable(getattr(target, name, None))
    ]
    spec = getattr(target, "spec", None)
    if spec is None:
        problems.append("attribute `spec` missing (a pytest_graphmode.TargetSpec)")
    elif not isinstance(spec, TargetSpec):
        problems.append(f"`spec` is a {type(spec).__name__}, not a pytest_graphmode.TargetSpec")
    else:
        problems.extend(f"spec: {problem}" for problem in spec_problems(spec))
    if problems:
        raise TargetError(
            f"{type(target).__module__}.{type(target).__qualname__} does not follow the target "
            "contract (see docs/contract.md): " + "; ".join(problems)
        )


def check_twins(factory: TargetFactory, *, seed: int, backend: str) -> None:
    """Make both twins once and check them before any campaign: the contract's shape
    (`check_target`), `state()` against the spec, and one spec for both twins.

    Raises one `TargetError` naming the first thing to fix; a factory or method that raises is
    reported as one line (exception and where it was raised), not as a traceback per test. A graph
    twin whose construction raises (other than a device fault) while its eager twin is made and
    checked without a problem is not a problem of the target's shape but a graph-mode failure (a
    capture that reads a tensor it cannot, say): it is left to the campaigns, which report it as a
    failure of a check with a replay snippet.
    """
    from pytest_graphmode.runtime import backends

    # Made as a campaign makes them: with the backend active (on sim a runner that captures while
    # it is built needs torch routed through the sim).
    with backends.target_scope(backend):
        _check_twins(factory, seed=seed, backend=backend)


def _check_twins(factory: TargetFactory, *, seed: int, backend: str) -> None:
    made: list[Any] = []
    graph_raised: TargetError | None = None
    try:
        for mode in ("graph", "eager"):
            try:
                target = _call(
                    f"factory({mode!r}, seed={seed}, backend={backend!r})",
                    factory,
                    mode,
                    seed=seed,
                    backend=backend,
                )
            except TargetError as exc:
                if mode == "graph" and not _faulted(exc):
                    graph_raised = exc  # a graph-mode failure, unless the eager twin raises too
                    continue
                if graph_raised is not None:  # both raised: the first is the one to report
                    raise graph_raised from graph_raised.__cause__
                raise
            made.append(target)
            check_target(target)
            problems = _state_problems(target, target.spec)
            if problems:
                raise TargetError(
                    f"the {mode} twin's state() disagrees with its spec (see docs/contract.md, "
                    "'State is slot-major'): " + "; ".join(problems)
                )
        if graph_raised is None:
            graph, eager = made
            if graph.spec != eager.spec:
                raise TargetError(
                    "the graph and the eager twin made with the same seed must have the same "
                    f"spec: {graph.spec} != {eager.spec}"
                )
    except TargetError:
        for target in reversed(made):
            with contextlib.suppress(Exception):  # the first problem is the one to report
                target.close()
        raise
    for target in reversed(made):
        _call(f"{type(target).__qualname__}.close()", target.close)


def _faulted(exc: TargetError) -> bool:
    """Whether the factory's error left the device unusable: nothing more can be made then, and
    the isolated campaign's parent names the fault (`no_device_fault`) as it is."""
    from pytest_graphmode.fuzz.registry import is_device_fault

    return exc.__cause__ is not None and is_device_fault(exc.__cause__)


def _state_problems(target: Any, spec: TargetSpec) -> list[str]:
    """What in `state()` disagrees with `spec`: the KV cache must be there one row per slot (the
    tensors the harness marks, poisons and checks slot by slot); other tensors (a recurrent state,
    a state per block) are compared whole, but one laid out per block and slot, as an unflattened
    cache, would escape every slot check and is refused."""
    state = _call(f"{type(target).__qualname__}.state()", target.state)
    if not hasattr(state, "items"):
        return [f"state() returned a {type(state).__name__}, not a mapping of name -> tensor"]
    problems, shapes, per_slot = [], [], False
    for name, tensor in state.items():
        if not hasattr(tensor, "shape"):
            problems.append(f"state()[{name!r}] is a {type(tensor).__name__}, not a tensor")
            continue
        shape = tuple(tensor.shape)
        if shape[:1] == (spec.num_slots,):
            per_slot = True
        elif shape[:2] == (spec.num_blocks, spec.block_size):
            problems.append(
                f"state()[{name!r}] has shape {shape}, one row per block and slot: expose it one "
                f"row per slot, as tensor.view({spec.num_slots}, ...), so that the harness checks "
                "it slot by slot"
            )
        else:
            shapes.append(f"state()[{name!r}] has {shape[0] if shape else 0} rows")
    if not per_slot and not problems:
        problems.append(
            f"no state() tensor has spec.num_blocks * spec.block_size = {spec.num_blocks} * "
            f"{spec.block_size} = {spec.num_slots} rows, one per KV slot ({'; '.join(shapes)}): "
            "the spec must describe the runner's own KV cache"
        )
    return problems


def _call(what: str, function: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return function(*args, **kwargs)
    except Exception as exc:
        raise TargetError(f"{what} raised {_one_line(exc)}") from exc


def _one_line(exc: BaseException) -> str:
    """`Type: message (file:line)`, the line being the innermost frame that raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[0] if message else ''}{where}"


def _public_names(module: object) -> str:
    names = sorted(n for n in vars(module) if not n.startswith("_"))
    return ", ".join(names) if names else "(none)"
