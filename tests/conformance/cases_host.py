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


class _LoadedParameter(torch.nn.Parameter):
    """A parameter class of a runner's own, as vLLM's: it carries how to load its weight."""

    def __new__(cls, data: torch.Tensor, weight_loader: Any = None) -> _LoadedParameter:
        return super().__new__(cls, data, requires_grad=False)

    def __init__(self, data: torch.Tensor, weight_loader: Any = None) -> None:
        self.weight_loader = weight_loader


@case("_LoadedParameter cuda:0 rows, _LoadedParameter cuda:0 cols, _LoadedParameter cpu")
def parameter_subclass_keeps_its_class_on_the_device(be: Any) -> str:
    # Made on the device, and moved there with its module: the runner's class, on the device,
    # and back.
    with backends.target_scope(be.name):
        made = _LoadedParameter(torch.zeros(2, device="cuda"), weight_loader="rows")
        layer = torch.nn.Linear(2, 2)
        layer.weight = _LoadedParameter(torch.ones(2, 2), weight_loader="cols")
        layer.to("cuda")
        moved = layer.weight
        moved_device = moved.device  # before the module goes back to the host
        layer.cpu()
        return (
            f"{type(made).__name__} {made.device} {made.weight_loader}, "
            f"{type(moved).__name__} {moved_device} {moved.weight_loader}, "
            f"{type(layer.weight).__name__} {layer.weight.device}"
        )


@case("cpu cpu, cuda:0")
def loading_with_a_map_of_locations(be: Any) -> str:
    # `map_location` as a dict maps the locations a file names: a device checkpoint read on the
    # host, and a host one put on the device.
    with backends.target_scope(be.name):
        on_device, on_host = io.BytesIO(), io.BytesIO()
        torch.save(
            {"w": torch.ones(2, device="cuda"), "b": [torch.ones(1, device="cuda")]}, on_device
        )
        torch.save({"w": torch.ones(2)}, on_host)
        on_device.seek(0)
        on_host.seek(0)
        to_host = torch.load(on_device, map_location={"cuda:0": "cpu"})
        to_gpu = torch.load(on_host, map_location={"cpu": "cuda:0"})
    return f"{to_host['w'].device} {to_host['b'][0].device}, {to_gpu['w'].device}"


@case("cuda:0 cuda:0 True")
def device_class_of_an_index(be: Any) -> str:
    # `torch.device(rank)`, `torch.device(torch.cuda.current_device())`: an index names the GPU.
    with backends.target_scope(be.name):
        by_index = torch.device(0)
        current = torch.device(torch.cuda.current_device())
        return f"{by_index} {current} {isinstance(by_index, torch.device)}"


@case("torch.bfloat16 torch.float16 float32 softmax, stored")
def autocast_on_the_device(be: Any) -> str:
    # A layer under autocast computes in half precision, and its output goes into a half
    # precision cache by index (index_put_ wants matching dtypes); softmax stays in float32.
    with backends.target_scope(be.name):
        x = torch.ones(2, 4, device=be.device)
        weight = torch.ones(4, 4, device=be.device)
        cache = torch.zeros(4, 4, device=be.device, dtype=torch.bfloat16)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = torch.nn.functional.linear(x, weight)
            probs = torch.softmax(out, -1)
            cache[torch.tensor([1, 3], device=be.device)] = out
        with torch.autocast("cuda"):
            default = x @ weight
        stored = "stored" if cache[1].float().sum().item() == 16.0 else "not stored"
        return f"{out.dtype} {default.dtype} {str(probs.dtype)[6:]} softmax, {stored}"


def _under_sync_debug_error(be: Any, call: Any) -> str:
    """`call(x)` under `set_sync_debug_mode("error")`, the mode set back to default after."""
    with backends.target_scope(be.name):
        x = torch.ones(4, device=be.device)
        be.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call(x)
            return f"ran; mode {torch.cuda.get_sync_debug_mode()}"
        except RuntimeError as exc:
            return f"raises RuntimeError: {str(exc).splitlines()[0]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")


@case("raises RuntimeError: called a synchronizing CUDA operation")
def a_host_read_under_sync_debug_error(be: Any) -> str:
    return _under_sync_debug_error(be, lambda x: x.sum().item())


@case("ran; mode 2")
def an_event_wait_under_sync_debug_error(be: Any) -> str:
    # torch checks the mode where it copies and synchronizes streams or the device, not here.
    return _under_sync_debug_error(
        be, lambda x: torch.cuda.current_stream().record_event().synchronize()
    )
