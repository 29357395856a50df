"""What the host sees of device tensors: numpy, printing and formatting, device indices, legacy
type names, loading a file to the device, and the calls around a device that change nothing on
it. Each is a plain `torch` call a runner makes outside any graph API; on sim each runs in the
drop-in, as a runner's code does."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

from pytest_graphmode.runtime import backends
from tests.conformance.case import case


def _replayed_double(be: Any) -> torch.Tensor:
    """The output of a replay of `2 x`, read with no synchronization after the replay."""
    x = torch.arange(1.0, 4.0, device=be.device)
    out = torch.zeros(3, device=be.device)
    g = be.Graph()
    with be.graph(g):
        out.copy_(x * 2)
    out.fill_(-1.0)
    be.synchronize()
    g.replay()
    return out


@case("raises TypeError")
def numpy_of_a_device_tensor(be: Any) -> str:
    with backends.target_scope(be.name):
        torch.ones(2, device=be.device).numpy()
    return "converted"


@case("raises TypeError")
def numpy_asarray_of_a_device_tensor(be: Any) -> str:
    with backends.target_scope(be.name):
        np.asarray(torch.ones(2, device=be.device))
    return "converted"


@case("[2.0, 4.0, 6.0]")
def numpy_forced_waits_for_a_replay(be: Any) -> str:
    with backends.target_scope(be.name):
        return str(_replayed_double(be).numpy(force=True).tolist())


@case("tensor([2., 4., 6.], device='cuda:0')")
def printing_waits_for_a_replay(be: Any) -> str:
    # Printing reads the values, as a download does.
    with backends.target_scope(be.name):
        return repr(_replayed_double(be))


@case("raises CaptureError")
def printing_in_a_capture(be: Any) -> str:
    with backends.target_scope(be.name):
        x = torch.arange(3.0, device=be.device)
        g = be.Graph()
        with be.graph(g):
            repr(x * 2)
    return "captured"


@case("2.50 and 2.5")
def formatting_a_device_scalar(be: Any) -> str:
    # A logging line's `f"{loss:.2f}"`: a 0-dim tensor formats as its number.
    with backends.target_scope(be.name):
        scalar = torch.tensor(2.5, device=be.device)
        return f"{scalar:.2f} and {scalar}"


@case("raises TypeError")
def format_spec_on_a_device_vector(be: Any) -> str:
    with backends.target_scope(be.name):
        return f"{torch.ones(2, device=be.device):.2f}"


@case("cuda:0 cuda:0 cuda:0 cuda:0")
def device_index_moves_to_the_device(be: Any) -> str:
    # `x.to(rank)`, `module.to(device=rank)`: a bare index names a CUDA device.
    with backends.target_scope(be.name):
        moved = [
            torch.ones(2).to(0),
            torch.ones(2).to(device=0, dtype=torch.float16),
            next(torch.nn.Linear(2, 2).to(0).parameters()),
            next(torch.nn.Linear(2, 2).to(device=0).parameters()),
        ]
    return " ".join(str(t.device) for t in moved)


@case("cuda:0 torch.float16")
def module_moved_by_keyword(be: Any) -> str:
    with backends.target_scope(be.name):
        weight = next(torch.nn.Linear(2, 2).to(device="cuda", dtype=torch.float16).parameters())
    return f"{weight.device} {weight.dtype}"


@case("cuda:0")
def default_device_by_index(be: Any) -> str:
    with backends.target_scope(be.name):
        torch.set_default_device(0)
        try:
            made = torch.zeros(1)
        finally:
            torch.set_default_device(None)
    return str(made.device)


@case("0 0 0")
def device_of_a_device_tensor(be: Any) -> str:
    with backends.target_scope(be.name):
        x = torch.ones(1, device=be.device)
        with torch.cuda.device_of(x):
            current = torch.cuda.current_device()
        return f"{x.get_device()} {torch.get_device(x)} {current}"


@case("torch.cuda.FloatTensor cuda:0 torch.float16 cpu")
def legacy_type_names(be: Any) -> str:
    with backends.target_scope(be.name):
        x = torch.ones(2, device=be.device)
        half = torch.ones(2).type("torch.cuda.HalfTensor")
        host = x.type(torch.FloatTensor)
        return f"{x.type()} {half.device} {half.dtype} {host.device}"


@case("cuda:0 cuda:0 3")
def loading_to_the_device(be: Any) -> str:
    with backends.target_scope(be.name):
        saved = io.BytesIO()
        torch.save({"weight": torch.ones(2), "rows": [torch.zeros(1)], "layers": 3}, saved)
        saved.seek(0)
        loaded = torch.load(saved, map_location="cuda")
    return f"{loaded['weight'].device} {loaded['rows'][0].device} {loaded['layers']}"


@case("same memory, shared")
def share_memory_of_a_device_tensor(be: Any) -> str:
    # Device memory is shared by IPC handles: the tensor stays where it is.
    with backends.target_scope(be.name):
        x = torch.ones(2, device=be.device)
        address = x.data_ptr()
        x.share_memory_()
        place = "same memory" if x.data_ptr() == address else "moved"
        return f"{place}, {'shared' if x.is_shared() else 'not shared'}"


@case("value=[4.0, 4.0]")
def sleep_kernel_in_a_capture(be: Any) -> str:
    with backends.target_scope(be.name):
        x = torch.ones(2, device=be.device)
        out = torch.zeros(2, device=be.device)
        g = be.Graph()
        with be.graph(g):
            torch.cuda._sleep(1000)
            out.copy_(x * 2)
        x.fill_(2.0)
        g.replay()
        torch.cuda.ipc_collect()
        be.synchronize()
        return f"value={out.tolist()}"


@case("True True")
def accelerator_current_stream_is_torch_cudas(be: Any) -> str:
    # Device-generic code (`torch.accelerator`) asks for the stream torch.cuda made current.
    with backends.target_scope(be.name):
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            on_side = torch.accelerator.current_stream().stream_id == side.stream_id
        on_default = (
            torch.accelerator.current_stream().stream_id == torch.cuda.default_stream().stream_id
        )
    return f"{on_side} {on_default}"


@case("2 ints, free <= total")
def memory_queries_of_torch_cuda_memory(be: Any) -> str:
    with backends.target_scope(be.name):
        free, total = torch.cuda.memory.mem_get_info()
        allocated = torch.cuda.memory.memory_allocated()
    ok = all(isinstance(n, int) for n in (free, total, allocated)) and free <= total
    return "2 ints, free <= total" if ok else f"{free!r} {total!r} {allocated!r}"


@case("cuda:0 [2.0, 4.0, 6.0], cpu")
def saving_waits_and_loads_back_to_the_device(be: Any) -> str:
    # A checkpoint of device tensors saved right after a replay: saving reads the values, and a
    # plain load puts them back on the device.
    with backends.target_scope(be.name):
        saved = io.BytesIO()
        torch.save({"out": _replayed_double(be)}, saved)
        saved.seek(0)
        back = torch.load(saved)["out"]
        saved.seek(0)
        host = torch.load(saved, map_location="cpu")["out"]
        return f"{back.device} {back.tolist()}, {host.device}"


@case("cuda:0 same memory, cuda:0")
def parameter_made_of_a_device_parameter(be: Any) -> str:
    # Tied weights (`lm_head.weight = nn.Parameter(embed.weight)`) and weight-norm
    # parametrizations make a parameter of a parameter already on the device.
    with backends.target_scope(be.name):
        embed = torch.nn.Embedding(5, 4).to("cuda")
        tied = torch.nn.Parameter(embed.weight)
        same = "same memory" if tied.data_ptr() == embed.weight.data_ptr() else "copied"
        normed = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(3, 3).to("cuda"))
        out = normed(torch.ones(1, 3, device="cuda"))
        return f"{tied.device} {same}, {out.device}"
