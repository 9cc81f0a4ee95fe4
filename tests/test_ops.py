import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import gemmfuse.dispatch
from gemmfuse import (
    Epilogue,
    GroupNormSpec,
    Param,
    Pointwise,
    Reduction,
    fused_epilogue,
    fused_linear,
    fused_linear_with_path,
)
from gemmfuse.dispatch import (
    HOPPER_KERNEL,
    PORTABLE_KERNEL,
    SPARSE_MAX_K,
    _channel_param_problem,
    backward_products,
    fused_k_splits,
    fused_kernel_code,
    select_path,
    sparse_fits,
    sparse_gradient,
)
from gemmfuse.weight_cache import SplitWeightCache

EPI = Epilogue(norm=GroupNormSpec(4))


def args(m=5, k=8, n=16):
    return torch.randn(m, k), torch.randn(n, k), torch.randn(n), torch.ones(n), torch.zeros(n)


@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (lambda a: {**a, "x": [1.0]}, TypeError, "x must be a torch.Tensor"),
        (lambda a: {**a, "x": torch.randn(5, 9)}, ValueError, r"x must have shape \(batch, 8\)"),
        (lambda a: {**a, "x": torch.randn(2, 5, 8)}, ValueError, "x must have shape"),
        (lambda a: {**a, "weight": torch.randn(16)}, ValueError, "weight must be a 2-D"),
        (lambda a: {**a, "weight": [[1.0] * 8]}, TypeError, "weight must be a torch.Tensor"),
        (
            lambda a: {**a, "weight_cache": "cache"},
            TypeError,
            "weight_cache must be a SplitWeightCache or None, got str",
        ),
        (lambda a: {**a, "x": a["x"].double()}, ValueError, "must share dtype and device"),
        (lambda a: {**a, "bias": torch.randn(3)}, ValueError, r"bias must have shape \(16,\)"),
        (lambda a: {**a, "epilogue": "gn"}, TypeError, "epilogue must be a gemmfuse.Epilogue"),
        (lambda a: {**a, "gn_weight": None}, ValueError, "gn_weight and gn_bias"),
        (lambda a: {**a, "gn_bias": torch.zeros(4)}, ValueError, r"gn_bias must have shape"),
        (
            lambda a: {**a, "epilogue": Epilogue(norm=GroupNormSpec(3))},
            ValueError,
            "num_groups=3 must divide out_features=16",
        ),
        (
            lambda a: {**a, "epilogue": Epilogue()},
            ValueError,
            "the epilogue has no GroupNorm",
        ),
    ],
)
def test_bad_input_raises_naming_the_argument(mutate, error, message):
    x, w, b, gw, gb = args()
    kwargs = mutate(
        {"x": x, "weight": w, "bias": b, "epilogue": EPI, "gn_weight": gw, "gn_bias": gb}
    )
    with pytest.raises(error, match=message):
        fused_linear(**kwargs)


def test_one_value_per_group_raises_like_pytorch():
    x, w, b, _, _ = args(m=1, n=4)
    with pytest.raises(ValueError, match="more than 1 value per group"):
        fused_linear(x, w, b, Epilogue(norm=GroupNormSpec(4, affine=False)))


def test_a_pooling_window_wider_than_the_row_raises_like_pytorch():
    x, w, b, _, _ = args(n=16)
    pooled = Epilogue(reduce=Reduction("sum", pool=32))
    with pytest.raises(RuntimeError):  # PyTorch's own error for such a max_pool1d
        torch.nn.functional.max_pool1d(torch.randn(5, 1, 16), 32)
    with pytest.raises(ValueError, match="max-pooling window of 32 channels .* wider than the "
                                         "chain's 16 channels"):  # fmt: skip
        fused_linear(x, w, b, pooled)
    assert fused_linear(x, w, b, Epilogue(reduce=Reduction("sum", pool=16))).shape == (5,)


def test_no_output_channels_give_what_pytorch_gives():
    """N = 0 without a reduction: an (M, 0) result, as F.linear and the ops after it give (a
    pooling window was once checked against the row with no pooling in the chain)."""
    x, w, b, _, _ = args(n=0)
    epilogue = Epilogue(pre=(Pointwise("relu"),))
    out = fused_linear(x, w, b, epilogue)
    assert out.shape == (5, 0) and torch.equal(out, torch.relu(torch.nn.functional.linear(x, w, b)))
    assert fused_epilogue(torch.randn(5, 0), epilogue).shape == (5, 0)
    summed = fused_linear(x, w, b, Epilogue(reduce=Reduction("sum")))
    assert torch.equal(summed, torch.zeros(5))


def test_cpu_takes_reference_path_without_warning(recwarn):
    x, w, b, gw, gb = args()
    out, path = fused_linear_with_path(x, w, b, EPI, gw, gb)
    assert path == "torch" and out.shape == (5, 16)
    assert not recwarn.list


def test_select_path_reasons():
    x, w, _, _, _ = args()
    assert select_path(x, w, EPI) == ("torch", "cpu tensors run the PyTorch reference path")


@pytest.mark.parametrize(
    "kernel, capability, code",
    [
        ("auto", (9, 0), HOPPER_KERNEL),
        ("auto", (8, 0), PORTABLE_KERNEL),
        ("auto", (10, 0), PORTABLE_KERNEL),  # sm_90a's wgmma runs on 9.0 alone
        ("hopper", (9, 0), HOPPER_KERNEL),
        ("portable", (9, 0), PORTABLE_KERNEL),
        ("epilogue", (9, 0), 0),  # no fused kernel: launch_fused refuses code 0
    ],
)
def test_the_fused_kernel_is_decided_in_python(monkeypatch, kernel, capability, code):
    """kernel="auto" resolves to a launch code here (dispatch.fused_kernel_code); the chain
    library's launch_fused runs the code it gets and checks the device, choosing nothing."""
    monkeypatch.setattr(gemmfuse.dispatch, "_capability", lambda index: capability)
    x = torch.empty(4, 8, device="meta")
    x_cuda = type("CudaLike", (), {"device": torch.device("cuda", 0)})()
    assert fused_kernel_code(kernel, x_cuda) == code
    assert fused_kernel_code("auto", x) == 0  # off the GPU no fused kernel runs


@pytest.mark.parametrize(
    "m, n, k, precision, code, dtype, path, splits",
    [
        (16, 4096, 4096, "fp32", HOPPER_KERNEL, torch.float32, "fused", 4),  # 32 tiles
        (128, 8192, 8192, "fp32", HOPPER_KERNEL, torch.float32, "fused", 2),  # 64 tiles
        (129, 4096, 4096, "fp32", HOPPER_KERNEL, torch.float32, "fused", 2),  # 2 x 32 tiles
        (16, 1024, 8192, "fp32", HOPPER_KERNEL, torch.float32, "fused", 8),  # 128 k-tiles / 16
        (129, 1024, 4160, "fp32", HOPPER_KERNEL, torch.float32, "fused", 4),  # 65 k-tiles / 16
        (128, 1024, 1024, "fp32", HOPPER_KERNEL, torch.float32, "fused", 1),  # 16 k-tiles: one
        (16, 4000, 4100, "fp32", HOPPER_KERNEL, torch.float32, "fused", 4),  # 32 tiles, 65 k-tiles
        (16, 12800, 4096, "fp32", HOPPER_KERNEL, torch.float32, "fused", 1),  # 100 tiles > 132 / 2
        (1024, 8192, 8192, "fp32", HOPPER_KERNEL, torch.float32, "fused", 1),  # 512 tiles
        (16, 4096, 4096, "tf32", HOPPER_KERNEL, torch.float32, "fused", 1),  # the split variant's
        (16, 4096, 4096, "fp32", PORTABLE_KERNEL, torch.float32, "fused", 1),  # the Hopper kernel's
        (16, 4096, 4096, "fp32", HOPPER_KERNEL, torch.bfloat16, "fused", 1),  # float32's
        (16, 4096, 4096, "fp32", HOPPER_KERNEL, torch.float32, "epilogue", 1),  # the fused path's
    ],
)  # fmt: skip
def test_split_k_fills_the_sms_at_few_tiles(monkeypatch, m, n, k, precision, code, dtype, path,
                                             splits):  # fmt: skip
    """dispatch.fused_k_splits: the Hopper kernel's split variant cuts K into slices where its
    128 x 128 output tiles are fewer than the SMs (132 here), at least 16 k-tiles of 64 a slice;
    nothing else splits."""
    monkeypatch.setattr(gemmfuse.dispatch, "_sm_count", lambda index: 132)
    x = SimpleNamespace(shape=(m, k), dtype=dtype, device=torch.device("cuda", 0))
    assert fused_k_splits(path, x, n, code, precision) == splits
    off_the_gpu = torch.empty(m, k, dtype=dtype, device="meta")
    assert fused_k_splits(path, off_the_gpu, n, code, precision) == 1


@pytest.mark.parametrize(
    "norm, reduce, sparse",
    [
        (GroupNormSpec(512), "min", True),  # #75: groups of 16 channels of 8192
        (GroupNormSpec(512), "max", True),
        (None, "max", True),  # the extremes' columns alone
        (GroupNormSpec(8), "min", True),  # groups of 1024: an eighth of the row
        (GroupNormSpec(4), "min", False),  # groups of 2048: a quarter
        (GroupNormSpec(1, layer=True), "min", False),  # a LayerNorm spreads it over the row
        (GroupNormSpec(512), "sum", False),  # every channel gets a gradient
        (GroupNormSpec(512), "mean", False),
        (GroupNormSpec(512), "logsumexp", False),
        (GroupNormSpec(512), None, False),
    ],
)
def test_min_and_max_after_small_groups_take_the_sparse_products(norm, reduce, sparse):
    """dz is zero but for the extremes' groups after a min or max: the backward's products take
    its nonzero entries (csrc/operands/sparse_products.cu) where a group is at most an eighth of
    a row, before any split kernel; the PyTorch path and other dtypes keep PyTorch's products."""
    epilogue = Epilogue(norm=norm, reduce=None if reduce is None else Reduction(reduce))
    assert sparse_gradient(epilogue, 8192) == sparse
    x, w = torch.randn(4, 8), torch.randn(8192, 8)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        chosen = backward_products("epilogue", x.to(dtype), w.to(dtype), "auto", epilogue)
        assert chosen == (sparse, False, False)
    assert backward_products("torch", x, w, "auto", epilogue)[0] is False
    assert backward_products("epilogue", x.double(), w.double(), "auto", epilogue)[0] is False


def test_the_sparse_products_keep_to_their_kernels_sizes():
    """Beyond the kernels' bounds (K over 2^30; N or the scratch beyond int32) the
    products stay PyTorch's, where the host extension would refuse the call in the backward."""
    assert sparse_fits(1024, 8192, 8192)
    assert sparse_fits(8, 64, SPARSE_MAX_K) and not sparse_fits(8, 64, SPARSE_MAX_K + 1)
    assert not sparse_fits(8, 2**31 - 2048, 64)
    assert not sparse_fits(2**20, 2**20, 64)  # the strips' row lists: 2^36 ints
    epilogue = Epilogue(reduce=Reduction("max"))
    x, w = (torch.empty(rows, SPARSE_MAX_K + 1, device="meta") for rows in (8, 64))
    assert backward_products("epilogue", x, w, "auto", epilogue) == (False, False, False)


def test_bf16_reductions_take_the_epilogue_path_where_eager_is_reproduced(monkeypatch):
    """A bf16 chain with a min or max (no norm, or a GroupNorm of groups dividing 128 channels,
    where this torch's eager statistics are recognised) takes the epilogue path whatever
    ``kernel`` says; other reductions and norms stay on PyTorch, saying why."""
    monkeypatch.setattr(gemmfuse.dispatch, "_device_problem", lambda x: "")
    monkeypatch.setattr(gemmfuse.dispatch, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(gemmfuse.dispatch, "eager_bf16_group_stats", lambda index: 2)
    x, w = torch.randn(64, 256).bfloat16(), torch.randn(512, 256).bfloat16()

    def path(epilogue, kernel="auto"):
        return select_path(x, w, epilogue, kernel)

    gn_min = Epilogue(norm=GroupNormSpec(32), reduce=Reduction("min"))
    for kernel in ("auto", "hopper", "portable", "epilogue"):
        assert path(gn_min, kernel) == ("epilogue", "")
    assert path(Epilogue(reduce=Reduction("max"))) == ("epilogue", "")
    assert path(Epilogue(reduce=Reduction("sum")))[0] == "torch"
    assert "sum reduction" in path(Epilogue(reduce=Reduction("sum")))[1]
    wide = Epilogue(norm=GroupNormSpec(2), reduce=Reduction("min"))  # groups of 256
    assert path(wide) == ("torch", path(wide)[1]) and "divide 128" in path(wide)[1]
    layer = Epilogue(norm=GroupNormSpec(1, layer=True), reduce=Reduction("min"))
    assert path(layer)[0] == "torch"
    monkeypatch.setattr(gemmfuse.dispatch, "eager_bf16_group_stats", lambda index: 0)
    assert path(gn_min)[0] == "torch" and "not one gemmfuse reproduces" in path(gn_min)[1]
    assert path(Epilogue(reduce=Reduction("min"))) == ("epilogue", "")  # no norm: no statistics


def test_float16_models_take_the_hopper_kernels_for_every_chain(monkeypatch):
    """A float16 model's chain, every reduction included (one fp16 ulp of a reduced value of
    magnitude under 16 is within KernelBench's 1e-2 fp16 tolerance, unlike bf16's), takes a
    Hopper path on sm_90 from the size thresholds up: under kernel="auto" and "epilogue" the
    epilogue path where the chain norms or reduces in tiles (model16_in_tiles), the fused
    kernel for the others and under "hopper"; below the thresholds, with the portable kernel,
    a pointwise chain forced onto the epilogue path, unaligned rows or off sm_90 it stays on
    PyTorch, saying why."""
    monkeypatch.setattr(gemmfuse.dispatch, "_device_problem", lambda x: "")
    monkeypatch.setattr(gemmfuse.dispatch, "_capability", lambda index: (9, 0))
    x, w = torch.randn(1024, 1024).half(), torch.randn(1024, 1024).half()
    chains = [Epilogue(norm=GroupNormSpec(32), reduce=None if r is None else Reduction(r))
              for r in (None, "min", "max", "sum", "mean", "logsumexp")]  # fmt: skip
    for epilogue in chains:
        assert select_path(x, w, epilogue, "auto") == ("epilogue", "")
        assert select_path(x, w, epilogue, "hopper") == ("fused", "")
    pointwise = Epilogue(pre=(Pointwise("relu"),))  # the chain kernel reads float32 there
    wide = Epilogue(norm=GroupNormSpec(4))  # groups of 256 straddle the tiles
    softmax = Epilogue(norm=GroupNormSpec(1, layer=True, affine=False, softmax=True))
    for epilogue in (pointwise, wide, softmax):
        assert select_path(x, w, epilogue, "auto") == ("fused", "")
    chain = chains[1]
    path, reason = select_path(x[:8], w, chain)
    assert path == "torch" and "eager float16 is as fast" in reason
    assert "Hopper kernel only" in select_path(x, w, chain, "portable")[1]
    assert select_path(x, w, chain, "epilogue") == ("epilogue", "")
    path, reason = select_path(x, w, pointwise, "epilogue")
    assert path == "torch" and "norm or reduce within 128-channel tiles" in reason
    unaligned = torch.randn(1024, 1001).half()
    assert "16-byte aligned" in select_path(unaligned, unaligned, chain)[1]
    monkeypatch.setattr(gemmfuse.dispatch, "_capability", lambda index: (8, 0))
    assert "float16 models are fused by the Hopper kernel only" in select_path(x, w, chain)[1]
    assert "float64 inputs run the PyTorch path" in select_path(x.double(), w.double(), chain)[1]


def test_float32_copies_track_changes():
    cache = SplitWeightCache()
    v = torch.randn(16).bfloat16()
    first = cache.float32(v, "bias")
    assert first.dtype == torch.float32 and torch.equal(first, v.float())
    assert cache.float32(v, "bias") is first  # converted once
    v.mul_(3)  # in place: version bump
    again = cache.float32(v, "bias")
    assert again is not first and torch.equal(again, v.float())
    cache.clear()
    assert cache.float32(v, "bias") is not again
    strided = torch.randn(32)[::2]  # float32 but not dense: copied
    dense = cache.float32(strided, "gn_weight")
    assert dense.is_contiguous() and torch.equal(dense, strided)
    other = torch.randn(16).bfloat16()  # a new tensor in a slot replaces the slot's copy
    cache.float32(other, "bias")
    assert len(cache._entries) == 2
    f = torch.randn(16)
    assert cache.float32(f, "bias") is f and cache.float32(None, "bias") is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kernel": "fastest"}, "kernel must be one of"),
        ({"precision": "fp16"}, "precision must be"),
        ({"kernel": ["auto"]}, r"kernel must be one of .*, got \['auto'\]"),
        ({"precision": ["fp32"]}, r"precision must be one of .*, got \['fp32'\]"),
    ],
)
def test_bad_kernel_or_precision_raises(kwargs, message):
    x, w, b, gw, gb = args()
    with pytest.raises(ValueError, match=message):
        fused_linear(x, w, b, EPI, gw, gb, **kwargs)


@pytest.mark.parametrize(
    "params, error, message",
    [
        ({"a": 1}, TypeError, "params must be a tuple or list"),
        ((3.0,), TypeError, r"params\[0\] must be a torch.Tensor"),
        ((), ValueError, r"reads params\[0\] but 0 tensor"),
        ((torch.ones(17),), ValueError, r"params\[0\] of shape \(17,\) does not broadcast"),
        ((torch.ones(2, 1, 16),), ValueError, r"params\[0\] of shape \(2, 1, 16\) does not"),
    ],
)
def test_bad_params_raise(params, error, message):
    x, w, b, gw, gb = args()
    epi = Epilogue(norm=GroupNormSpec(4), post=(Pointwise("mul", (Param(0),)),))
    with pytest.raises(error, match=message):
        fused_linear(x, w, b, epi, gw, gb, params=params)


@pytest.mark.parametrize(
    "shape, dtype, fits",
    [((16,), torch.float32, True), ((1, 16), torch.float32, True), ((1,), torch.float32, True),
     ((), torch.float32, True), ((5, 16), torch.float32, True), ((16, 1), torch.float32, False),
     ((1, 1, 16), torch.float32, False), ((16,), torch.float64, False)],
)  # fmt: skip
def test_only_per_channel_or_per_element_params_of_x_dtype_reach_the_kernel(shape, dtype, fits):
    x, w, _, _, _ = args()
    epi = Epilogue(pre=(Pointwise("add", (Param(0),)),))
    problem = _channel_param_problem(epi, (torch.ones(shape, dtype=dtype),), x, 16)
    assert (problem == "") == fits, problem


FSDP_PROBE = """
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from gemmfuse.weight_cache import SplitWeightCache, cache_for_call, fsdp_in_use

cache = SplitWeightCache()
assert not fsdp_in_use() and cache_for_call(cache) is cache
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = fully_shard(nn.Linear(8, 8), mesh=init_device_mesh("cpu", (1,)))
assert fsdp_in_use(), "fully_shard went unseen"
assert cache_for_call(cache) is not cache, "the cache was kept under FSDP2"
dist.destroy_process_group()
print("ok")
"""


def test_no_weight_cache_under_fsdp2():
    """FSDP2 refills unsharded weights in place with no version bump (fsdp_in_use): calls made
    while it manages modules get a fresh cache. In a subprocess: the process group and FSDP2's
    module registry are process-wide. (GPU: tests/gpu/test_data_parallel_one_gpu.py trains.)"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", FSDP_PROBE], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
