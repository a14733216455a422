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


@pytest.fixture(scope="session")
def straight_tiny_run(tmp_path_factory):
    """The six-step tiny run (``tiny_run_config`` as it is) trained once, straight
    through, for the tests that compare a resumed or re-pointed run with it: the run is
    deterministic on CPU, so one straight run serves them all. Its run directory (with
    checkpoints at steps 3 and 6) is shared: read it, never write to it."""
    from helpers import train_tiny_run

    cache = tmp_path_factory.getbasetemp() / "corpus_cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEGATRON_LNS_CACHE", str(cache))
        return train_tiny_run(tmp_path_factory.mktemp("straight_tiny_run"))


@pytest.fixture()
def seeded(megatron_world1):
    torch.manual_seed(1234)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield


# Modules whose tests pytest-xdist must run one at a time, on one worker: the SLURM jobs
# share the test cluster's nodes (a multi-node test waits for all of them idle).
ONE_AT_A_TIME = ("tests/cluster/test_slurm_",)


@pytest.hookimpl(optionalhook=True)  # without xdist (-p no:xdist) there is nothing to schedule
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` (make test) by module: a module's tests run on one worker, so
    its module-scoped fixtures (trained runs, multi-rank results) are built once; the
    modules of :data:`ONE_AT_A_TIME` count as one."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "one-at-a-time" if module.startswith(ONE_AT_A_TIME) else module

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
