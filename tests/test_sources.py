import re

from gemmfuse.epilogue import Epilogue, GroupNormSpec
from gemmfuse.sources import CSRC, extension_sources


def test_flattened_sources_have_no_local_includes():
    cpp, cuda = extension_sources(Epilogue(norm=GroupNormSpec(1)).structure)
    for text in (cpp, cuda):
        assert not re.search(r'#\s*include\s+"', text)
    assert "struct GeneratedEpilogue" in cuda and "fused_gemm_gn_kernel" in cuda
    assert cuda.count("struct FusedArgs {") == 1  # each header once
    assert "torch/extension.h" in cpp and "struct GeneratedEpilogue" not in cpp


def test_package_ships_its_kernel_sources():
    names = {p.name for p in CSRC.iterdir()}
    assert {"fused_linear.cu", "binding.cpp", "gemm_gn_sm80.cuh", "split_rows.cuh"} <= names
