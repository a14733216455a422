import pytest
import torch


@pytest.fixture(scope="session")
def megatron_world1():
    """megatron parallel state for a single CPU rank, shared by in-process tests."""
    from megatron_lns.runtime import ParallelLayout, init_distributed

    init_distributed(ParallelLayout(), device="cpu")
    yield


@pytest.fixture()
def private_corpus_cache(tmp_path_factory, monkeypatch):
    """Built-in corpora prepared once per test session, in a private cache."""
    monkeypatch.setenv("MEGATRON_LNS_CACHE", str(tmp_path_factory.getbasetemp() / "corpus_cache"))


@pytest.fixture()
def seeded(megatron_world1):
    torch.manual_seed(1234)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
