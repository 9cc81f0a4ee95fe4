import os

import pytest
import torch


def pin_worker_gpu(environ=os.environ) -> None:
    """Under GEMMFUSE_TEST_GPUS (device ids, comma-separated: scripts/gpu_check.py
    --split-gpus), a pytest-xdist worker sees one of those GPUs alone, worker gwN the N-th
    modulo their count, so that one pytest process spreads the suite over the GPUs test by test
    (xdist hands more to whichever worker is free). Called as this file is imported, which
    pytest-xdist does in each worker after naming it (PYTEST_XDIST_WORKER) and before any test
    module could initialise CUDA. Elsewhere it changes nothing."""
    gpus = [g for g in environ.get("GEMMFUSE_TEST_GPUS", "").split(",") if g]
    worker = environ.get("PYTEST_XDIST_WORKER", "")
    if gpus and worker.startswith("gw"):
        environ["CUDA_VISIBLE_DEVICES"] = gpus[int(worker[2:]) % len(gpus)]


pin_worker_gpu()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (sm_80+); skipped without one")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU: GPU tests are skipped, not passed")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
