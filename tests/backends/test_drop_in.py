"""The drop-in: plain torch.cuda resolves to the sim inside `drop_in()`, torch is exactly restored
after it, and what the sim cannot run is refused by name."""

import io
import types
import warnings

import pytest
import torch

from pytest_graphmode.fuzz import GraphmodeFailure, run_campaign
from pytest_graphmode.runtime.backends import cuda_available
from pytest_graphmode.runtime.backends.sim import (
    SimEvent,
    SimGraph,
    SimStream,
    SimUnsupportedError,
    drop_in,
)
from pytest_graphmode.runtime.backends.sim.drop_in import SIM_MEMORY, is_active
from tests.runners.plain_target import make_target

# Globals torch.cuda rebinds itself, the first time CUDA initialises or (once initialised) a device
# count is asked for, and submodules it imports on first use (`_pin_memory_utils`, at the first
# pinned allocation): on a GPU host, whether that happens during a test depends on the tests an
# xdist worker ran before it, not on the drop-in (seen on the H200: `_cached_device_count`).
_TORCH_LAZY_STATE = frozenset(
    {"_initialized", "_queued_calls", "_cached_device_count", "_cached_hip_to_amdsmi"}
)


def _torch_cuda() -> dict[str, object]:
    return {
        k: v
        for k, v in vars(torch.cuda).items()
        if k not in _TORCH_LAZY_STATE and not isinstance(v, types.ModuleType)
    }


def _rebound(before: dict[str, object], after: dict[str, object]) -> list[str]:
    return sorted(name for name in before if after[name] is not before[name])


# The modules of torch.cuda whose names the drop-in rebinds too.
_SUBMODULES = (torch.cuda.graphs, torch.cuda.streams, torch.cuda.nvtx, torch.cuda.memory)


def test_torch_cuda_names_resolve_to_the_sim_inside() -> None:
    with drop_in() as backend:
        assert is_active()
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        assert torch.cuda.current_device() == 0
        torch.cuda.set_device(0)
        torch.cuda.set_device("cuda:0")
        assert isinstance(torch.cuda.CUDAGraph(), SimGraph)
        assert isinstance(torch.cuda.Stream(), SimStream)
        assert isinstance(torch.cuda.Event(enable_timing=True), SimEvent)
        assert torch.cuda.current_stream() is backend.current_stream()
        assert torch.cuda.default_stream() is backend.default_stream()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            assert torch.cuda.current_stream() is side
        free, total = torch.cuda.mem_get_info()
        assert free <= total == SIM_MEMORY == torch.cuda.get_device_properties(0).total_memory
        allocated = torch.cuda.memory_allocated()
        assert (
            0 <= allocated <= torch.cuda.max_memory_allocated() <= torch.cuda.max_memory_reserved()
        )
        assert allocated <= torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()


def test_torchs_device_generic_names_answer_for_the_sim_inside() -> None:
    # Runners written for any accelerator (transformers 5.19 onwards) ask these, not torch.cuda.
    with drop_in():
        assert torch.accelerator.is_available() and torch.accelerator.device_count() == 1
        assert torch.accelerator.current_accelerator() == torch.device("cuda")
        assert torch.get_device_module() is torch.cuda
        assert torch.get_device_module("cuda:0") is torch.cuda
        assert torch.get_device_module("cpu") is torch.cpu
        torch.accelerator.synchronize()


def test_another_device_is_refused() -> None:
    with drop_in(), pytest.raises(ValueError, match="one device, cuda:0"):
        torch.cuda.set_device(1)


def test_manual_seed_seeds_the_sims_draws() -> None:
    with drop_in():
        torch.cuda.manual_seed(5)
        first = torch.randn(3, device="cuda")
        torch.cuda.manual_seed_all(5)
        assert torch.equal(torch.randn(3, device="cuda"), first)


def test_a_generator_on_cuda_draws_on_the_sim() -> None:
    with drop_in():
        generator = torch.Generator(device="cuda").manual_seed(7)
        assert generator.device == torch.device("cuda", 0)
        drawn = torch.randn(3, device="cuda", generator=generator)
        assert drawn.is_cuda
        assert torch.Generator().device == torch.device("cpu")
        # Its seed (and offset) decide the draw, as on CUDA: another generator of that seed
        # draws the same, one of another seed does not.
        again = torch.randn(3, device="cuda", generator=torch.Generator("cuda").manual_seed(7))
        other = torch.randn(3, device="cuda", generator=torch.Generator("cuda").manual_seed(8))
    assert torch.equal(drawn, again)
    assert not torch.equal(drawn, other)


def test_a_capture_through_torch_cuda_graph_replays_on_the_sim() -> None:
    with drop_in():
        x = torch.zeros(4, device="cuda")
        y = x * 2  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
            assert torch.cuda.is_current_stream_capturing()
            y = x * 2 + 1
        x.copy_(torch.arange(4.0, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert y.tolist() == [1.0, 3.0, 5.0, 7.0]


def test_torch_cuda_is_restored_exactly_after_a_sim_campaign() -> None:
    before, generator = _torch_cuda(), torch.Generator
    accelerator, device_module = dict(vars(torch.accelerator)), torch.get_device_module
    load, set_default_device = torch.load, torch.set_default_device
    device, autocasts = torch.device, (torch.autocast, torch.amp.autocast, torch.cuda.amp.autocast)
    autocast_enabled = torch.is_autocast_enabled
    compile_ = torch.compile
    alias_check = torch._library.utils._c_check_aliasing_constraint
    parameter_new = torch.nn.Parameter.__dict__["__new__"]
    submodules = {m: dict(vars(m)) for m in _SUBMODULES}
    stats = run_campaign(make_target, backend="sim", max_examples=2, max_steps=4, seed=1)
    assert stats.failures == []
    after = _torch_cuda()
    assert after.keys() == before.keys()
    assert _rebound(before, after) == []
    for module, names in submodules.items():
        assert vars(module).keys() == names.keys()
        assert _rebound(names, dict(vars(module))) == [], module
    assert torch.Generator is generator
    assert vars(torch.accelerator) == accelerator
    assert all(vars(torch.accelerator)[name] is accelerator[name] for name in accelerator)
    assert torch.get_device_module is device_module
    assert torch.load is load and torch.set_default_device is set_default_device
    assert torch.device is device and torch.is_autocast_enabled is autocast_enabled
    assert torch.compile is compile_
    assert (torch.autocast, torch.amp.autocast, torch.cuda.amp.autocast) == autocasts
    assert torch._library.utils._c_check_aliasing_constraint is alias_check
    assert torch.nn.Parameter.__dict__["__new__"] is parameter_new
    assert not is_active()
    assert torch.cuda.is_available() is cuda_available()


def test_nested_drop_ins_restore_only_at_the_outermost() -> None:
    original = torch.cuda.CUDAGraph
    with drop_in():
        with drop_in():
            pass
        assert torch.cuda.CUDAGraph is SimGraph
    assert torch.cuda.CUDAGraph is original


@pytest.mark.skipif(cuda_available(), reason="a CPU-only host's answer")
def test_without_a_gpu_is_available_is_false_again() -> None:
    with drop_in():
        assert torch.cuda.is_available()
    assert not torch.cuda.is_available()
    assert not torch.accelerator.is_available()


_LIBRARY = torch.library.Library("graphmode_sim_test", "DEF")
_LIBRARY.define("only_cuda(Tensor x) -> Tensor")
_LIBRARY.impl("only_cuda", lambda x: x + 1, "CUDA")


def test_an_op_with_only_a_cuda_kernel_is_refused_by_name() -> None:
    with drop_in():
        x = torch.ones(2, device="cuda")
        with pytest.raises(SimUnsupportedError, match=r"only_cuda.*pure-PyTorch runners"):
            torch.ops.graphmode_sim_test.only_cuda(x)


def test_device_properties_beyond_the_plausible_ones_are_refused() -> None:
    with drop_in():
        properties = torch.cuda.get_device_properties(0)
        assert properties.multi_processor_count > 0 and properties.warp_size == 32
        with pytest.raises(SimUnsupportedError, match=r"uuid.*pure-PyTorch"):
            _ = properties.uuid


def test_a_module_moved_to_cuda_runs_on_the_sim_device() -> None:
    with drop_in():
        layer = torch.nn.Linear(3, 4).to("cuda")
        assert isinstance(layer.weight, torch.nn.Parameter) and layer.weight.is_cuda
        out = layer(torch.ones(2, 3, device="cuda"))
        assert out.is_cuda
        layer.cpu()
        assert not layer.weight.is_cuda and type(layer.weight) is torch.nn.Parameter


def test_set_stream_and_what_a_stream_tells_of_itself() -> None:
    with drop_in() as backend:
        side = torch.cuda.Stream()
        assert isinstance(torch.cuda.streams.Stream(), SimStream)
        torch.cuda.set_stream(side)
        assert torch.cuda.current_stream() is side is backend.current_stream()
        torch.cuda.set_stream(torch.cuda.default_stream())
        assert torch.cuda.current_stream() is backend.default_stream()
        assert torch.cuda.default_stream().cuda_stream == 0
        assert side.cuda_stream not in (0, torch.cuda.Stream().cuda_stream)
        assert side.device == torch.device("cuda", 0) and side.device_index == 0


def test_record_stream_of_a_device_tensor_is_accepted() -> None:
    with drop_in():
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            made = torch.ones(4, device="cuda") * 2
        torch.cuda.current_stream().wait_stream(side)
        made.record_stream(torch.cuda.current_stream())
        assert made.sum().item() == 8
        with pytest.raises(TypeError, match="stream of the sim"):
            made.record_stream("not a stream")


def test_make_graphed_callables_captures_and_replays_sim_graphs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    replays = []
    replay = SimGraph.replay
    monkeypatch.setattr(SimGraph, "replay", lambda graph: (replays.append(graph), replay(graph)))
    with drop_in():
        torch.manual_seed(0)
        layer = torch.nn.Linear(3, 2).cuda()
        eager = torch.nn.Linear(3, 2).cuda()
        eager.load_state_dict(layer.state_dict())
        graphed = torch.cuda.make_graphed_callables(layer, (torch.zeros(4, 3, device="cuda"),))
        x = torch.randn(4, 3, device="cuda")
        replays.clear()
        out = graphed(x)
        assert replays and all(isinstance(g, SimGraph) for g in replays)
        assert torch.allclose(out, eager(x))
        out.sum().backward()  # the backward graph replays too
        assert len(replays) >= 2


def test_factories_follow_torchs_default_device_set_to_cuda() -> None:
    with drop_in():
        torch.set_default_device("cuda")
        try:
            made = [torch.zeros(2), torch.arange(3), torch.tensor([1, 2]), torch.empty(2, 2)]
            assert all(t.is_cuda for t in made)
            assert not torch.zeros(2, device="cpu").is_cuda
        finally:
            torch.set_default_device(None)
        assert not torch.zeros(2).is_cuda
        with torch.device("cuda"):
            assert torch.ones(1).is_cuda


def test_type_as_moves_to_the_others_device_and_dtype() -> None:
    with drop_in():
        on_device = torch.ones(2, device="cuda", dtype=torch.float16)
        moved = torch.arange(2.0).type_as(on_device)
        assert moved.is_cuda and moved.dtype == torch.float16
        back = on_device.type_as(torch.zeros(1, dtype=torch.float64))
        assert not back.is_cuda and back.dtype == torch.float64
        assert back.tolist() == [1.0, 1.0]


def test_nvtx_ranges_and_marks_do_nothing_on_the_sim() -> None:
    with drop_in():
        with torch.cuda.nvtx.range("step"):
            torch.cuda.nvtx.range_push("inner")
            torch.cuda.nvtx.mark("here")
            torch.cuda.nvtx.range_pop()
        torch.cuda.nvtx.range_end(torch.cuda.nvtx.range_start("span"))


def test_memory_reports_answer_and_nvml_questions_are_refused_by_name() -> None:
    with drop_in():
        assert "sim" in torch.cuda.memory_summary()
        assert torch.cuda.memory_snapshot() == []
        for call, name in [
            (torch.cuda.utilization, "utilization"),
            (torch.cuda.temperature, "temperature"),
            (lambda: torch.cuda.ExternalStream(1234), "ExternalStream"),
        ]:
            with pytest.raises(SimUnsupportedError, match=rf"{name}.*pure-PyTorch"):
                call()


def test_a_stream_named_by_its_id_and_an_event_shared_between_processes_are_refused_by_name():
    # Before, a bare TypeError (an unexpected keyword) and AttributeError (no such method).
    with drop_in():
        event = torch.cuda.Event(interprocess=True)
        for call, name in [
            (lambda: torch.cuda.Stream(stream_id=3, device_index=0, device_type=1), "stream_id"),
            (event.ipc_handle, "ipc_handle"),
            (lambda: torch.cuda.Event.from_ipc_handle(0, b"handle"), "from_ipc_handle"),
        ]:
            with pytest.raises(SimUnsupportedError, match=rf"{name}.*cannot run on the sim"):
                call()
        assert torch.cuda.Stream(priority=-1).priority == -1  # a stream of its own still made


def test_the_default_device_generator_is_the_one_the_sims_draws_use() -> None:
    with drop_in():
        (default,) = torch.cuda.default_generators
        default.manual_seed(5)
        first = torch.randn(3, device="cuda")
        torch.cuda.manual_seed(5)
        assert torch.equal(torch.randn(3, device="cuda"), first)


def test_a_graph_kept_for_instantiation_replays_and_a_driver_dump_names_itself() -> None:
    with drop_in():
        x = torch.zeros(4, device="cuda")
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with pytest.raises(RuntimeError, match="never captured"):
            graph.instantiate()
        with torch.cuda.graph(graph):
            y = x + 1
        graph.instantiate()
        graph.replay()
        torch.cuda.synchronize()
        assert y.tolist() == [1.0] * 4
        with pytest.raises(SimUnsupportedError, match="debug_dump"):
            graph.debug_dump("graph.dot")


def test_cudas_autocast_casts_stay_out_of_the_hosts_autocast() -> None:
    # The casts CUDA's autocast adds to the CPU's (softmax to float32) apply inside an enabled
    # CUDA autocast block on the sim only: the host's own autocast, after it, casts as before.
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    with drop_in():
        on_device = x.to("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            inside = torch.softmax(on_device, -1).dtype
            with torch.autocast("cuda", enabled=False):
                disabled = torch.softmax(on_device, -1).dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        host = torch.softmax(x, -1).dtype
    assert (inside, disabled, host) == (torch.float32, torch.bfloat16, torch.bfloat16)


def test_a_saved_view_of_a_capture_output_carries_none_of_the_sims_references() -> None:
    # A view of a capture's output holds the output (so its pool block stays the graph's while
    # the view lives); saving the view saves its values, not that reference.
    with drop_in():
        x = torch.ones(4, 4, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            first, _ = (x * 2).split(2, dim=1)
        graph.replay()
        saved = io.BytesIO()
        torch.save(first, saved)
        saved.seek(0)
        loaded = torch.load(saved)
        assert vars(first) and not vars(loaded)
        assert loaded.device == first.device and loaded.tolist() == [[2.0, 2.0]] * 4


def test_a_kernel_the_cpu_lacks_for_these_dtypes_raises_at_the_call() -> None:
    # Queued on a side stream or recorded in a capture, the operation runs later; its CPU kernel
    # has no float8 case. The error comes at the call, as a dtype check does on a GPU, and is a
    # NotImplementedError, so a runner's fallback for a missing kernel takes it.
    with drop_in():
        cache = torch.zeros(8, 4, device="cuda").to(torch.float8_e4m3fn)
        rows = torch.ones(2, 4, device="cuda").to(torch.float8_e4m3fn)
        slots = torch.tensor([1, 2], device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), pytest.raises(NotImplementedError, match="index_copy_"):
            cache.index_copy_(0, slots, rows)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(NotImplementedError, match="Float8_e4m3fn"), torch.cuda.graph(graph):
            cache.index_copy_(0, slots, rows)
        torch.cuda.synchronize()  # nothing left queued raises later
        cache[slots] = rows  # the fallback, index_put_, has a float8 kernel
        assert cache.float()[1:3].tolist() == [[1.0] * 4] * 2


@torch.library.custom_op("graphmode_sim_test::doubled", mutates_args=())
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.library.custom_op("graphmode_sim_test::same", mutates_args=())
def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def test_a_custom_ops_outputs_in_a_capture_are_told_from_aliases_by_their_bytes() -> None:
    # A capture's outputs share one pool chunk's storage on sim (distinct storages on CUDA):
    # torch's check that a custom op's output aliases none of its inputs must not take them for
    # aliases, and must still refuse an output that is its input.
    with drop_in():
        x = torch.ones(4, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            first = x * 3  # a capture output: the input below lives in the same chunk
            second = torch.ops.graphmode_sim_test.doubled(first)
        graph.replay()
        assert second.tolist() == [6.0] * 4
        with pytest.raises(RuntimeError, match="may not alias"):
            torch.ops.graphmode_sim_test.same(x)


def test_a_device_generators_seed_and_offset_are_unsigned_64_bit_numbers() -> None:
    # As torch's binding reads them: a negative value wraps around, 2**64 does not fit, and an
    # offset moved past the top wraps to 0 as CUDA's unsigned counter does.
    with drop_in():
        generator = torch.Generator(device="cuda").manual_seed(-1)
        assert generator.initial_seed() == 2**64 - 1
        generator.set_offset(-4)
        assert generator.get_offset() == 2**64 - 4
        assert bytes(generator.get_state()[8:].tolist()) == b"\xfc" + b"\xff" * 7
        torch.rand(4, device="cuda", generator=generator)
        assert generator.get_offset() == 0
        with pytest.raises(ValueError, match="Overflow"):
            generator.set_offset(2**64)
        with pytest.raises(ValueError, match="Overflow"):
            generator.manual_seed(2**64)


def test_compiled_code_runs_its_python_on_the_sim_and_is_captured_like_it() -> None:
    # Dynamo skips every frame under the sim's modes: fullgraph=True no longer refuses that.
    with drop_in():
        weight = torch.randn(8, 8, device="cuda")

        def layer(x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x @ weight) + 1

        compiled = torch.compile(layer, fullgraph=True)
        static = torch.zeros(4, 8, device="cuda")
        compiled(static)  # warm-up outside the capture, as on a GPU
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(static)
        x = torch.randn(4, 8, device="cuda")
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), layer(x).cpu())
        module = torch.nn.Linear(8, 8).cuda()
        module.compile(fullgraph=True, mode="max-autotune-no-cudagraphs")
        assert torch.equal(
            module(x).cpu(), torch.nn.functional.linear(x, *module.parameters()).cpu()
        )


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"mode": "reduce-overhead"}, "mode='reduce-overhead' (CUDAGraph Trees)"),
        ({"mode": "max-autotune"}, "mode='max-autotune' (CUDAGraph Trees)"),
        ({"backend": "cudagraphs"}, "backend='cudagraphs'"),
        ({"options": {"triton.cudagraphs": True}}, "'triton.cudagraphs': True"),
        ({"backend": lambda gm, inputs: gm}, "a backend of the runner's own"),
    ],
)
def test_a_compile_whose_cuda_graphs_the_sim_would_never_build_is_refused_by_name(
    arguments: dict[str, object], named: str
) -> None:
    # Before, such a runner ran eagerly on sim while it claimed graph mode.
    with drop_in(), pytest.raises(SimUnsupportedError, match=r"torch\.compile with") as refused:
        torch.compile(torch.nn.Linear(2, 2).cuda(), **arguments)  # type: ignore[call-overload]
    assert named in str(refused.value)


class _CompilesWithItsOwnGraphs:
    """A runner whose graph mode hands its capture to torch.compile's CUDAGraph Trees."""

    def __init__(self, mode: str, *, seed: int, backend: str) -> None:
        self.target = make_target(mode, seed=seed, backend=backend)
        if mode == "graph":
            torch.compile(torch.nn.Identity(), mode="reduce-overhead")

    def __getattr__(self, name: str) -> object:
        return getattr(self.target, name)


def test_a_runner_the_sim_refuses_is_reported_as_the_sims_limit_not_a_finding() -> None:
    with pytest.raises(GraphmodeFailure) as failed:
        run_campaign(_CompilesWithItsOwnGraphs, backend="sim", max_examples=2, max_steps=2, seed=0)
    message = str(failed.value)
    assert "sim_unsupported: the sim cannot run a call this runner makes" in message
    assert "mode='reduce-overhead'" in message.split("sim_unsupported", 1)[1].splitlines()[1]


def test_a_mem_pool_is_the_sims_by_torch_cuda_memorys_names_too() -> None:
    # vLLM's sleep-mode allocator spells them torch.cuda.memory.MemPool / use_mem_pool.
    with drop_in():
        pool = torch.cuda.memory.MemPool()
        with torch.cuda.memory.use_mem_pool(pool):
            cache = torch.zeros(4, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool.id):
            doubled = cache * 2
        cache.fill_(3.0)
        graph.replay()
        torch.cuda.synchronize()
        assert doubled.tolist() == [6.0] * 4
        assert pool.snapshot() == []
        with pytest.raises(SimUnsupportedError, match=r"MemPool\(\)\.use_count"):
            pool.use_count()


def test_the_allocators_statistics_fraction_and_history_answer_as_torchs_do() -> None:
    # vLLM-style memory profiling reads these before it sizes its cache and captures; before, the
    # fraction and the history raised AttributeError (no CUDA binding in a CPU build of torch) and
    # memory_stats() held six keys.
    host_snapshot = torch.cuda.memory._snapshot
    with drop_in():
        flat, nested = torch.cuda.memory_stats(), torch.cuda.memory_stats_as_nested_dict()
        assert 0 <= flat["requested_bytes.all.current"] <= flat["allocated_bytes.all.current"]
        assert (
            flat["allocated_bytes.large_pool.peak"]
            == nested["allocated_bytes"]["large_pool"]["peak"]
        )
        assert len(flat) == 9 * 3 * 4 + 2 * 4 + 6
        assert torch.cuda.get_per_process_memory_fraction() == 1.0
        torch.cuda.set_per_process_memory_fraction(0.9, 0)
        assert torch.cuda.memory.get_per_process_memory_fraction(0) == 0.9
        with pytest.raises(ValueError, match="Allowed range"):
            torch.cuda.set_per_process_memory_fraction(1.5)
        with pytest.raises(TypeError, match="must be `float`"):
            torch.cuda.set_per_process_memory_fraction(1)
        torch.cuda.memory._record_memory_history(max_entries=100)
        assert torch.cuda.memory._snapshot()["segments"] == []
        torch.cuda.memory._record_memory_history(enabled=None)
        assert torch.cuda.get_allocator_backend() == "native"
        with pytest.raises(SimUnsupportedError, match="caching_allocator_alloc"):
            torch.cuda.caching_allocator_alloc(1024)
    assert torch.cuda.memory._snapshot is host_snapshot


def test_sync_debug_mode_warns_or_raises_where_torch_checks_it() -> None:
    # Before, set_sync_debug_mode raised AttributeError (no CUDA binding in a CPU build).
    with drop_in():
        x, pinned = torch.ones(4, device="cuda"), torch.empty(4, pin_memory=True)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            assert torch.cuda.get_sync_debug_mode() == 1
            with pytest.warns(UserWarning, match="called a synchronizing CUDA operation"):
                x.sum().item()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                pinned.copy_(x, non_blocking=True)  # neither is checked by torch
                torch.cuda.current_stream().record_event().synchronize()
            torch.cuda.set_sync_debug_mode(2)
            with pytest.raises(RuntimeError, match="called a synchronizing CUDA operation"):
                torch.cuda.synchronize()
            with pytest.raises(RuntimeError, match="expected one of"):
                torch.cuda.set_sync_debug_mode("loud")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.cuda.get_sync_debug_mode() == 0
