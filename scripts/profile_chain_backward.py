"""The chain backward kernel alone on a problem's chain and shape: its time per call, for
reading under ncu (``ncu --kernel-name regex:chain_backward python scripts/...``).

Usage: python scripts/profile_chain_backward.py [62|75] [--bf16]. Prints the plan (column slabs,
row blocks) and the median of 50 calls (CUDA events, L2 not flushed), random z and gradient.
"""

import sys

import torch

from gemmfuse.autograd import _kernel_chain_backward, kernel_plan
from gemmfuse.epilogue import Epilogue
from gemmfuse.kernelbench.models import epilogue_62, epilogue_75


def main() -> None:
    number = int(next((a for a in sys.argv[1:] if a.isdigit()), 62))
    dtype = torch.bfloat16 if "--bf16" in sys.argv else torch.float32
    m, n, groups = 1024, 8192, 512
    if number == 62:
        full = epilogue_62(groups, 1e-5, True, 0.01)
    else:
        full = epilogue_75(groups, 1e-5, True)
    chain = Epilogue(full.pre, full.norm, full.post, full.reduce)
    g = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(m, n, device="cuda", generator=g).to(dtype)
    grad_shape = (m, n) if chain.reduce is None else (m, 1)
    grad = torch.randn(grad_shape, device="cuda", generator=g).to(dtype)
    tensors = [1 + 0.1 * torch.randn(n, device="cuda", generator=g).to(dtype),
               0.1 * torch.randn(n, device="cuda", generator=g).to(dtype)]  # fmt: skip
    plan = kernel_plan(chain.structure, m, n, n // groups, z.device)
    times = []
    for _ in range(55):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _kernel_chain_backward(chain, z, grad, tensors, [True, True])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    median = sorted(times[5:])[len(times[5:]) // 2]
    print(f"#{number} {dtype} M={m} N={n} groups={groups}: plan {plan}, {median * 1e3:.1f} us")


if __name__ == "__main__":
    main()
