"""DDP and FSDP2 around an optimized #62 on one GPU: a world of one rank over NCCL
(tests/distributed_cases.py), K = N = 1024, the fused kernel forced, 20 SGD steps' losses
allclose(1e-4) to the unfused model trained the same way.

FSDP2 refills its unsharded parameters in place without bumping their version counters, so a
weight split cached across steps would go stale from the second step on; one rank suffices to
show it (the 2-GPU cases in test_parallel.py need a machine with two)."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from distributed_cases import read_results, run_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
NAMES = ("ddp", "fsdp2")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    os.environ.update(NCCL_NVLS_ENABLE="0")  # inherited by the spawned rank
    out = tmp_path_factory.mktemp("dist1") / "results.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kernel = "hopper" if torch.cuda.get_device_capability() == (9, 0) else "portable"
    mp.spawn(run_cases, args=(1, port, "nccl", str(out), kernel, 1024, NAMES), nprocs=1)
    return read_results(out, 1, NAMES)


@pytest.mark.parametrize("case", NAMES)
def test_case_one_rank(results, case):
    assert results[case] == "", results[case]
