"""What a campaign changes in Hypothesis's process-wide state while it runs, and puts back.

Hypothesis keeps a storage directory and, in recent releases, the constants of the modules the
process has loaded; both are process-wide. A campaign sets them for itself so that it leaves
nothing in the user's project and its examples follow from its seed alone.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def hypothesis_scope() -> Iterator[None]:
    """Both of this module's scopes: a campaign runs inside it."""
    with storage_outside_the_project(), draws_from_the_seed_alone():
        yield


@contextmanager
def storage_outside_the_project() -> Iterator[None]:
    """Point Hypothesis's storage directory at a temporary one for the campaign.

    Database or not, Hypothesis caches the constants of every module of the working directory in
    its storage directory (`.hypothesis/constants/` by default), so a campaign would leave a
    `.hypothesis/` in the user's project. The user's own setting is put back afterwards: their
    Hypothesis tests keep their storage.
    """
    from hypothesis import configuration

    # None: not chosen yet; Hypothesis then chooses again (environment, working directory).
    previous = vars(configuration).get("__hypothesis_home_directory")
    with tempfile.TemporaryDirectory(prefix="graphmode-hypothesis-") as home:
        configuration.set_hypothesis_home_dir(home)
        try:
            yield
        finally:
            configuration.set_hypothesis_home_dir(previous)


@contextmanager
def draws_from_the_seed_alone() -> Iterator[None]:
    """Keep the constants of the process's own modules out of the campaign's draws.

    Hypothesis (since 6.131) draws, in about one integer draw of forty, a constant it found in the
    source of a loaded module outside the standard library and site-packages: the user's runner,
    a conftest, this package where it is installed from a checkout. Which modules those are
    depends on what the process imported before the campaign (which tests an xdist worker ran
    first, whether a runner is imported lazily), and an edit to a number anywhere in them moves
    every draw: one seed would draw other examples in another process or after an unrelated
    edit. Hypothesis's own constants, the same in every process, stay. A release without module
    constants needs nothing here. Campaigns in several threads share one patch: the last to
    leave puts Hypothesis back.
    """
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - a release that moved its internals
        yield
        return
    if not (hasattr(providers, "_get_local_constants") and hasattr(providers, "Constants")):
        yield
        return
    global _inside, _scan
    with _lock:
        if _inside == 0:
            _scan = providers._get_local_constants
            none = providers.Constants()
            _use_scan(providers, lambda: none)
        _inside += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if _inside == 0:
                _use_scan(providers, _scan)


_lock = threading.Lock()
_inside = 0  # campaigns inside the scope now, in all threads
_scan: Callable[[], Any] | None = None  # Hypothesis's own scan, while a campaign runs


def _use_scan(providers: Any, scan: Callable[[], Any] | None) -> None:
    """Make `scan` what Hypothesis calls for the loaded modules' constants. Each provider caches
    what a draw permits under process-wide keys: cleared with every change, so that nothing drawn
    before the campaign leaks into it and nothing of the campaign's into the user's own tests."""
    providers._get_local_constants = scan
    cache = getattr(getattr(providers, "CONSTANTS_CACHE", None), "cache", None)
    if cache is not None:
        cache.clear()
