import re
from pathlib import Path

import pytest

from gemmfuse import kernel_files
from gemmfuse.epilogue import Epilogue, GroupNormSpec
from gemmfuse.jit import CHAIN_PARTS, HOST_SOURCES
from gemmfuse.kernel_files import CSRC, SUFFIXES, csrc_paths, read_csrc
from gemmfuse.sources import CHAIN_FUNCTIONS, SHARED_FUNCTIONS, extension_sources, flatten


def test_flattened_sources_have_no_local_includes():
    cpp, cuda = extension_sources(Epilogue(norm=GroupNormSpec(1)).structure)
    for text in (cpp, cuda):
        assert not re.search(r'#\s*include\s+"', text)
    assert "struct GeneratedEpilogue" in cuda and "fused_gemm_gn_kernel" in cuda
    assert cuda.count("struct FusedArgs {") == 1  # each header once
    assert "PYBIND11_MODULE" in cpp and "struct GeneratedEpilogue" not in cpp


def test_package_ships_its_kernel_sources():
    names = {p.name for p in CSRC.rglob("*")}
    assert {"fused_linear.cu", "binding.cpp", "gemm_gn_sm80.cuh", "split_rows.cuh"} <= names
    assert set(CHAIN_PARTS) | set(HOST_SOURCES) <= names


def test_the_export_translation_unit_holds_every_part():
    """fused_linear.cu (a standalone export's one library) is the package's two pieces
    together: the host extension's kernels and every part of a chain's library."""
    included = re.findall(r'^#include "([^"]+)"$', read_csrc()["fused_linear.cu"], re.M)
    host_kernels = {name for name in HOST_SOURCES if name.endswith(".cu")}
    assert host_kernels == {"split.cu", "sparse_products.cu", "column_sums.cu", "outer_binary.cu"}
    assert set(included) == set(CHAIN_PARTS) | host_kernels


def test_each_entry_the_table_reaches_apart_is_published_by_the_part_it_names():
    """Built apart (the package), chain_table.cu reaches each part's entry points through
    PartEntries, naming the part file that publishes each (part_entries.h): a wrong file would
    build the wrong part on first use, and the call would then fail."""
    files = read_csrc()
    named = re.findall(r'entry\(&PartEntries::(\w+), "([^"]+)"\)', files["chain_table.cu"])
    forwarded = re.findall(r'GEMMFUSE_FORWARD_TO_PART\((\w+), "([^"]+)"\)',
                           files["chain_table.cu"])  # fmt: skip
    pairs = set(named) | set(forwarded)
    published = {
        (name, part)
        for part in CHAIN_PARTS[1:]
        for name in re.findall(r"publish\(entries->(\w+), ", files[part])
    }
    fields = re.findall(r"(\w+)\{\}", files["part_entries.h"])
    assert pairs == published and len(pairs) == len(fields) == 14
    assert {name for name, _ in pairs} == set(fields)
    for part in CHAIN_PARTS[1:]:
        assert "GEMMFUSE_EXPORT void gemmfuse_part_entries(" in files[part]


def test_the_export_binding_holds_every_host_translation_unit():
    """binding.cpp (a standalone export's one C++ source) includes every C++ file of the host
    extension: one left out fails only when an export loads on a GPU."""
    included = re.findall(r'^#include "([^"]+)"$', read_csrc()["binding.cpp"], re.M)
    assert set(included) == {name for name in HOST_SOURCES if name.endswith(".cpp")}


def test_flatten_reads_the_mapping_it_is_given():
    files = {"main.cu": '#include "a.h"\n#include "epilogue_generated.cuh"\nint main;\n'}
    files["a.h"] = '#pragma once\n#include "b.h"\nint a;\n'
    files["b.h"] = '#include "a.h"\nint b;\n'
    text = flatten(files, "main.cu", "int generated;")
    assert text.index("int b;") < text.index("int a;") < text.index("int generated;")
    assert "#pragma once" not in text and "#include" not in text


def test_flatten_names_a_missing_file():
    with pytest.raises(FileNotFoundError, match="'gone.h'"):
        flatten({"main.cu": '#include "gone.h"\n'}, "main.cu", "")


def test_read_csrc_is_every_shipped_source():
    files = read_csrc()
    assert set(files) == {
        p.name for p in CSRC.rglob("*") if p.suffix in (".cu", ".cuh", ".h", ".cpp")
    }
    assert files["binding.cpp"] == csrc_paths()["binding.cpp"].read_text()
    assert len(files) == sum(p.suffix in SUFFIXES for p in CSRC.rglob("*"))  # no name twice


def test_every_source_lies_where_the_package_data_ships_it():
    """pyproject.toml ships csrc/*/*.{cu,cuh,h,cpp}: a source directly in csrc/ or deeper would
    be read in a checkout and missing from a wheel."""
    import tomllib

    from gemmfuse.kernel_files import ROOT_PACKAGE

    shipped = tomllib.loads((ROOT_PACKAGE.parents[1] / "pyproject.toml").read_text())
    globs = shipped["tool"]["setuptools"]["package-data"]["gemmfuse"]
    sources = [p for p in CSRC.rglob("*") if p.suffix in SUFFIXES]
    for path in sources:
        relative = path.relative_to(ROOT_PACKAGE).as_posix()
        assert any(Path(relative).match(g) for g in globs), f"{relative} is not shipped"
    assert {p.name for p in sources} == set(read_csrc())


def test_a_name_in_two_csrc_folders_is_refused(tmp_path, monkeypatch):
    """Builds flatten by file name: two files of one name would make one of them unreachable."""
    for folder in ("gemm", "epilogue"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "same.cuh").write_text("")
    monkeypatch.setattr(kernel_files, "CSRC", tmp_path)
    kernel_files.csrc_paths.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="same.cuh twice"):
            kernel_files.csrc_paths()
    finally:
        kernel_files.csrc_paths.cache_clear()


def _constant(file: str, name: str) -> int:
    match = re.search(rf"constexpr int {name} = (\d+);", read_csrc()[file])
    assert match, f"{name} not found in {file}"
    return int(match.group(1))


def test_constants_python_shares_with_the_kernels_agree():
    """The values both sides hold, each written once per language: the Python copies must match
    the C++ ones, or arguments and tiles disagree silently."""
    from gemmfuse import dispatch, epilogue

    assert epilogue.MAX_SCALARS == epilogue.MAX_TENSORS == _constant("fused_args.h", "kMaxParams")
    assert dispatch.TILE == epilogue.MAX_POOL == _constant("fused_args.h", "kTile")
    assert dispatch.GEMV_MAX_ROWS == _constant("fused_args.h", "kGemvMaxRows")
    assert dispatch.MAX_K_SPLITS == _constant("fused_args.h", "kMaxKSplits")
    assert dispatch.PORTABLE_KERNEL == _constant("fused_args.h", "kPortableKernel")
    assert dispatch.HOPPER_KERNEL == _constant("fused_args.h", "kHopperKernel")
    assert dispatch.K_ALIGN == _constant("gemm_gn_sm90.cuh", "kBlockK")
    assert dispatch.K_ALIGN == _constant("split.h", "kKAlign")
    assert dispatch.SPARSE_STRIP == _constant("sparse_products.h", "kSparseStrip")
    assert dispatch.SPARSE_BATCH == _constant("sparse_products.h", "kSparseBatch")
    assert dispatch.SPARSE_COUNTERS == _constant("sparse_products.h", "kSparseCounters")
    assert dispatch.SPARSE_MAX_K == 2**30
    assert "kSparseMaxK = int64_t{1} << 30;" in read_csrc()["sparse_products.h"]
    header = read_csrc()["row_reduce.cuh"].replace("\n// ", " ")
    kinds = re.search(r"Kinds are REDUCTIONS in epilogue\.py: (.*?)\.", header)
    documented = {name: int(code) for code, name in re.findall(r"(\d) (\w+)", kinds.group(1))}
    assert documented == epilogue.REDUCTIONS


def test_the_binding_defines_every_function_python_calls():
    """Each name ChainKernels binds is a function of the host extension's module (bind_*.cpp),
    the chain's ones with the table as their first argument."""
    binding = "".join(text for name, text in read_csrc().items() if name.startswith("bind_"))
    defined = dict(re.findall(r'm\.def\("(\w+)", &\w+(, py::arg\("table"\))?', binding))
    assert set(CHAIN_FUNCTIONS) | set(SHARED_FUNCTIONS) <= set(defined)
    assert all(defined[name] for name in CHAIN_FUNCTIONS)
    assert not any(defined[name] for name in SHARED_FUNCTIONS)


def test_the_binding_defines_the_executor():
    """ops.launch_path calls ``launch(spec, cache, tensors, save_z)`` (bind_launch.cpp)."""
    binding = read_csrc()["bind_launch.cpp"]
    # from the def to the next binding or the function's end (its lambda's body holds
    # statements of its own)
    launch = re.search(r'm\.def\(\s*"launch",.*?(?=\n  (?:py::class_|m\.def)|\n\})', binding, re.S)
    assert launch is not None
    names = re.findall(r'py::arg\("(\w+)"\)', launch.group())
    assert names == ["spec", "cache", "tensors", "save_z"]
