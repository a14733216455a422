import pytest
import torch
from factory import Factory, shared_root
from helpers import TWO_RANK_RUN_OVERRIDES


@pytest.fixture(scope="session")
def megatron_world1():
    """megatron parallel state for a single CPU rank, shared by in-process tests."""
    from megatron_lns.runtime import ParallelLayout, init_distributed

    init_distributed(ParallelLayout(), device="cpu")
    yield


@pytest.fixture(scope="session")
def factory(tmp_path_factory) -> Factory:
    """Builds the tokenizers, datasets and tiny runs tests share, once per session for all
    pytest-xdist workers (tests/factory.py)."""
    return Factory(shared_root(tmp_path_factory))


@pytest.fixture()
def private_corpus_cache(factory, monkeypatch):
    """Built-in corpora prepared once per test session, in the session's cache (not the
    user's)."""
    monkeypatch.setenv("MEGATRON_LNS_CACHE", str(factory.corpus_cache))


@pytest.fixture(scope="session")
def straight_tiny_run(factory):
    """The six-step tiny run (``tiny_run_config`` as it is) trained once, straight
    through, for the tests that compare a resumed or re-pointed run with it: the run is
    deterministic on CPU, so one straight run serves them all. Its run directory (with
    checkpoints at steps 3 and 6) is shared: read it, never write to it."""
    return factory.tiny_run()


@pytest.fixture(scope="session")
def straight_two_rank_run(factory):
    """The run directory of ``TWO_RANK_RUN_OVERRIDES`` trained once through ``megatron-lns
    train``, without a fault: the losses the in-job restart tests expect of a faulted run
    that restarted (tests/training/test_in_job_restart.py, test_hang_watchdog.py)."""
    return factory.cli_run(*TWO_RANK_RUN_OVERRIDES)


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
