import pytest
import torch

from pytest_graphmode.runtime import backends


@pytest.fixture(params=["sim", pytest.param("cuda", marks=pytest.mark.graphmode_cuda)])
def be(request: pytest.FixtureRequest):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("cuda backend: no CUDA GPU on this machine")
    backend = backends.get(request.param)
    backend.set_scheduler_seed(0)
    with backend.active():
        yield backend
        backend.synchronize()


@pytest.fixture
def sim():
    backend = backends.get("sim")
    with backend.active():
        backend.synchronize()
        yield backend
        backend.synchronize()
