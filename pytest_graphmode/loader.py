"""Find the runner under test: a `module:factory` name, then the instance it makes.

Every problem becomes a `TargetError` whose message says what is wrong and what to write instead;
the plugin turns it into a pytest usage error that names the option.
"""

from __future__ import annotations

import importlib
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
            "sys.path)"
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


def _public_names(module: object) -> str:
    names = sorted(n for n in vars(module) if not n.startswith("_"))
    return ", ".join(names) if names else "(none)"
