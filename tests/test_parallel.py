"""gemmfuse.parallelize, DDP and FSDP2 on the CPU: two processes over gloo
(tests/distributed_cases.py), the PyTorch path in every rank. tests/gpu/test_parallel.py runs
the same cases over NCCL on two GPUs."""

import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from distributed_cases import CASES, read_results, run_cases

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "results.json"
    mp.spawn(run_cases, args=(2, free_port(), "gloo", str(out)), nprocs=2)
    return read_results(out, 2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_case(results, case):
    assert results[case] == "", results[case]
