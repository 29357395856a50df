"""torch.cuda's sync debug mode on the sim: a synchronizing operation warns or raises, as torch's
`warn_or_error_on_sync` makes it on CUDA.

Synchronizing, as torch counts it: the host waits for the device's work, through a read of device
memory (`item()`, a blocking copy, `nonzero`), `Stream.synchronize()` or `torch.cuda.synchronize()`.
An event's `synchronize()` or `query()` does not count (torch does not check there). Engines set
"warn" or "error" around their replay path in tests, to catch a host sync hidden in it.
"""

from __future__ import annotations

import warnings

_LEVELS = {"default": 0, "warn": 1, "error": 2}
_MESSAGE = "called a synchronizing CUDA operation"


class SyncDebugMode:
    """The process's mode (torch keeps one per process): 0 off, 1 warn, 2 raise."""

    level = 0


def set_sync_debug_mode(debug_mode: int | str) -> None:
    if isinstance(debug_mode, str):
        if debug_mode not in _LEVELS:
            raise RuntimeError(
                "invalid value of debug_mode, expected one of `default`, `warn`, `error`"
            )
        debug_mode = _LEVELS[debug_mode]
    SyncDebugMode.level = int(debug_mode)


def get_sync_debug_mode() -> int:
    return SyncDebugMode.level


def warn_or_error_on_sync() -> None:
    if SyncDebugMode.level == 1:
        warnings.warn(_MESSAGE, UserWarning, stacklevel=2)
    elif SyncDebugMode.level >= 2:
        raise RuntimeError(_MESSAGE)
