"""Shared test setup: GPU tests skip without CUDA.

Without CUDA, Triton runs in its interpreter for the whole test run. The variable must be set before the
first ``import triton`` (Triton's own language library is decorated at import time), and other tests import
Triton indirectly (torch.library.opcheck, Inductor), so it is set here, before any test module loads.
"""

import contextlib
import os

# One OpenMP thread per process unless the caller chose: the suite runs as pytest-xdist workers (scripts/test.sh:
# two on CI's two cores) and launches trainer processes beside them, and torch's default of a thread per core
# then has spinning OpenMP threads contend for the same cores (a model-test subset: 71 s -> 29 s on two cores,
# user CPU 127 s -> 39 s). Set before torch is imported here; launched processes inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--kernels-triton-autotune", choices=("true", "false"), default="true",
                     help="kernels.triton_autotune for the GPU kernel tests (false: default configs, a faster run)")


def pytest_configure(config):
    from lowerings.settings import configure_kernel_settings, refuse_replaced_environment

    try:
        refuse_replaced_environment(os.environ)
    except ValueError as err:
        raise pytest.UsageError(f"{err} (for the tests: --kernels-triton-autotune false)") from None
    autotune = config.getoption("--kernels-triton-autotune") == "true"
    configure_kernel_settings(triton_autotune=autotune)
    if not autotune and torch.cuda.is_available():
        # FLA's kernels at the tests' small shapes take the shipped configs' defaults instead of autotuning each
        # new shape; a user's FLA_* settings win
        from lowerings.kernels.fla_config_cache import use_shipped_fla_configs

        use_shipped_fla_configs(mode="full")


# The once-per-run launches below: the tests reading any of them run in one pytest-xdist worker (--dist
# loadgroup), so each launch still happens once per pytest run however the tests are spread. One group for all of
# them, not one each: then the launches run one after the other. Side by side (6-8 processes on two cores) each
# took about a quarter more CPU time for the same work, which the other worker's tests then wait for.
SHARED_LAUNCHES = ("layout_runs", "parity_runs")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(name in item.fixturenames for name in SHARED_LAUNCHES):
            item.add_marker(pytest.mark.xdist_group("shared_launches"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def layout_runs(tmp_path_factory):
    """The trainer runs of tests/layout_runs.py RUNS (tests/train_runs.py TrainRuns), each launched once per
    pytest run with every run of its world size, however many tests compare with it."""
    from tests.layout_runs import RUNS
    from tests.train_runs import TrainRuns

    return TrainRuns(tmp_path_factory.mktemp("layout_runs"), RUNS)


@pytest.fixture(scope="session")
def parity_runs(tmp_path_factory):
    """tests/parallel_parity_worker.py on 4 gloo ranks with every layout of tests/parity_runs.py LAYOUTS, launched
    once per pytest run, however many tests read it."""
    from tests.parity_runs import ParityRuns

    return ParityRuns(tmp_path_factory.mktemp("parity_runs"))


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo process group (the context-parallel paths on one process), destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def pretend_selected(monkeypatch, op: str, name: str) -> None:
    """``op`` runs ``name`` for the rest of the test, past the availability check (as on a machine that has it);
    monkeypatch puts the resolved choice back."""
    from lowerings.ops import registry

    monkeypatch.setattr(registry, "_RESOLVED", registry.resolved_backends().replaced({op: name}))


@contextlib.contextmanager
def backend_selected(op: str, name: str):
    """``kernels.<op> = name`` (checked as the config would be) inside the block, then the selection it had."""
    from lowerings.ops.registry import configure_backends, install_backends, resolved_backends

    saved = resolved_backends()
    configure_backends({op: name})
    try:
        yield
    finally:
        install_backends(saved)


@pytest.fixture
def flex_backend():
    """kernels.causal_attention = flex for one test, then the selection it had."""
    with backend_selected("causal_attention", "flex"):
        yield


@pytest.fixture
def gpu_kernels():
    """The GPU kernels of the token mixers (FLA's KDA, Triton's indexer top-k and sparse MLA) for one test, then
    the selection it had."""
    from lowerings.ops.registry import configure_backends, install_backends, resolved_backends

    saved = resolved_backends()
    configure_backends({"kda": "fla", "indexer_topk": "triton", "sparse_mla": "triton"})
    try:
        yield
    finally:
        install_backends(saved)
