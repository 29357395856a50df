"""The registry of mutants: name, bug class, the check that must fail it, and its factory."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from pytest_graphmode.contract import TargetFactory

MODULES = (
    "padding_not_reset",
    "padding_slot_wraps",
    "noise_keyed_by_row",
    "global_generator_noise",
    "tables_upload_skipped",
    "slots_from_last_table",
    "buffer_rebound",
    "greedy_flag_baked",
    "context_len_on_host",
    "key_without_query_len",
    "key_without_adapters",
    "weights_rebound",
    "workspace_resized",
    "output_view",
    "result_buffer_reused",
    "staging_buffer_reused",
    "copy_stream_not_awaited",
    "upload_event_skipped",
    "copy_stream_staging_reused",
    "pool_growth",
    "sampling_outside_capture",
    "piecewise_fresh_output",
    "piecewise_out_of_order",
    "plain_padding_stale",
    "plain_output_view",
    "plain_weights_rebound",
)


@dataclass(frozen=True)
class Mutant:
    name: str
    bug_class: int
    check: str
    factory: TargetFactory
    summary: str  # the first paragraph of the module's docstring
    # Other checks that see the same bug when they run first on a step (a module's ALSO_SEEN_BY).
    also: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return f"tests.mutants.{self.name}"


def load(name: str) -> Mutant:
    module = importlib.import_module(f"{__package__}.{name}")
    summary = (module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    also = tuple(getattr(module, "ALSO_SEEN_BY", ()))
    return Mutant(name, module.BUG_CLASS, module.EXPECTED_CHECK, module.make_target, summary, also)


MUTANTS = tuple(load(name) for name in MODULES)
