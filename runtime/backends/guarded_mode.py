"""The base of the harness's dispatch modes on cuda: torch's compile guard only once needed."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class GuardedOnceCompiling(TorchDispatchMode):
    """A dispatch mode that applies torch's compile guard itself, only once the compiler stack is
    imported, and that Dynamo does not trace into. A subclass implements `dispatch`."""

    # torch keeps torch.compile out of a mode's frames by wrapping `__torch_dispatch__` in a guard
    # whose first call imports its whole compiler stack (about a second, and some 300,000 objects
    # that every later full collection walks). Nothing can be compiling while that stack is not
    # imported, so the guard is needed only once it is: `__torch_dispatch__` checks, per call.
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    # While Dynamo traces, a mode it does not ignore is traced into, and the guard above is a
    # graph break there: a runner's `torch.compile(fullgraph=True)` would fail under the mode.
    # Ignored, the mode is off while compiling and on again while the compiled code runs.
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if "torch._dynamo" in sys.modules:
            return _dispatch_unseen_by_compiler(self, func, types, args, kwargs or {})
        return self.dispatch(func, types, args, kwargs or {})

    def dispatch(
        self, func: Any, types: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> Any:
        """What the mode does with `func(*args, **kwargs)`: at least run it."""
        raise NotImplementedError


def _dispatch(
    mode: GuardedOnceCompiling,
    func: Any,
    types: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> Any:
    return mode.dispatch(func, types, args, kwargs)


# torch's own guard, as it would have wrapped `__torch_dispatch__` (its import is lazy too).
_dispatch_unseen_by_compiler = torch._disable_dynamo(_dispatch, recursive=True)
