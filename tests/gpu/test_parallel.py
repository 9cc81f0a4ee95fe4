"""gemmfuse.parallelize, DDP and FSDP2 over NCCL, one GPU per rank (tests/distributed_cases.py):
K = N = 1024, the Hopper kernel forced (the fused kernel in every rank), outputs and gradients
allclose(1e-4) to the same optimized model unsplit on one GPU, and to eager PyTorch's where
eager's are allclose to float64's (else no further from float64 than eager's: _check_split);
20-step training losses allclose(1e-4) to the unfused model's. Needs 2 GPUs; NVLink
multicast stays off (NCCL_NVLS_ENABLE=0 and friends: it can take a shared host's GPUs down)."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from distributed_cases import CASES, read_results, run_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)"),
]
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    os.environ.update(NO_MULTICAST)  # inherited by the spawned ranks
    out = tmp_path_factory.mktemp("dist") / "results.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kernel = "hopper" if torch.cuda.get_device_capability() == (9, 0) else "portable"
    mp.spawn(run_cases, args=(2, port, "nccl", str(out), kernel, 1024), nprocs=2)
    return read_results(out, 2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_case(results, case):
    assert results[case] == "", results[case]
