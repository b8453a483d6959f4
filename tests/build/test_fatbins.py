"""The built CUDA binaries hold the GPU architectures the build promises.

The kernels are built for CMake's DRAFTFEED_CUDA_ARCHS, by default sm_90a,
sm_100a and sm_120a SASS plus compute_90 PTX (Hopper, B200, RTX PRO 6000 /
RTX 50, and PTX for any other sm_90+ GPU). Every fat binary in the target
server and the CUDA tests must hold exactly the configured set; CI (CI=true)
must build the default set. fatbin.py reads the binaries; its reading is
first checked on objects the build's own nvcc compiles here.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import fatbin  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("DRAFTFEED_BUILD_DIR", REPO / "build"))
SUPPORTED = ["compute_90", "sm_100a", "sm_120a", "sm_90a"]


def cache():
    path = BUILD / "CMakeCache.txt"
    if not path.exists():
        pytest.skip(f"no CMake tree at {BUILD} (DRAFTFEED_BUILD_DIR)")
    values = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z_0-9]+):[A-Z]+=(.*)$", line)
        if m:
            values[m.group(1)] = m.group(2)
    if values.get("DRAFTFEED_ENABLE_CUDA") != "ON":
        pytest.skip(f"{BUILD} is built without CUDA")
    return values


def build_nvcc():
    """The nvcc the tree was configured with (CMake records it beside the cache)."""
    cache()
    for f in sorted(BUILD.glob("CMakeFiles/*/CMakeCUDACompiler.cmake")):
        m = re.search(r'set\(CMAKE_CUDA_COMPILER "([^"]+)"\)', f.read_text())
        if m and pathlib.Path(m.group(1)).exists():
            return m.group(1)
    pytest.fail(f"{BUILD} is built with CUDA but records no nvcc (CMakeCUDACompiler.cmake)")


def expected_entries(archs):
    """CUDA_ARCHITECTURES entries ("90a-real", "90-virtual", "120a") as fat binary entry names."""
    names = set()
    for arch in archs.split(";"):
        m = re.fullmatch(r"(\d+[af]?)(-real|-virtual)?", arch.strip())
        assert m, f"DRAFTFEED_CUDA_ARCHS entry {arch!r} is not <sm>[a|f][-real|-virtual]"
        if m.group(2) != "-virtual":
            names.add(f"sm_{m.group(1)}")
        if m.group(2) != "-real":
            names.add(f"compute_{m.group(1)}")
    return sorted(names)


def default_archs():
    text = (REPO / "CMakeLists.txt").read_text()
    m = re.search(r'set\(DRAFTFEED_CUDA_ARCHS "([^"]+)" CACHE STRING', text)
    assert m, "CMakeLists.txt sets no DRAFTFEED_CUDA_ARCHS default"
    return m.group(1)


def test_the_default_is_hopper_and_both_blackwells_plus_ptx():
    assert expected_entries(default_archs()) == SUPPORTED


def test_reader_names_what_nvcc_writes(tmp_path):
    nvcc = build_nvcc()
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k(float* p) { p[threadIdx.x] = 2.f * p[threadIdx.x]; }\n")
    # Each object alone, so that a flag misread cannot hide behind another entry.
    cases = {
        "sm_90": "arch=compute_90,code=sm_90",
        "sm_90a": "arch=compute_90a,code=sm_90a",
        "sm_100a": "arch=compute_100a,code=sm_100a",
        "sm_100f": "arch=compute_100f,code=sm_100f",
        "sm_120": "arch=compute_120,code=sm_120",
        "sm_120a": "arch=compute_120a,code=sm_120a",
        "compute_90": "arch=compute_90,code=compute_90",
        "compute_90a": "arch=compute_90a,code=compute_90a",
    }
    objs = {}
    for name, gencode in cases.items():
        objs[name] = tmp_path / f"{name}.o"
        subprocess.run([nvcc, "-c", str(src), "-o", str(objs[name]), "-gencode", gencode],
                       check=True, capture_output=True)
    for name, obj in objs.items():
        assert fatbin.fatbins(obj) == [[name]], name
    # The build's own mix in one object, compressed payloads included.
    mixed = tmp_path / "mixed.o"
    subprocess.run([nvcc, "-c", str(src), "-o", str(mixed), "-Xfatbin", "-compress-all",
                    "-gencode", "arch=compute_90a,code=sm_90a",
                    "-gencode", "arch=compute_100a,code=sm_100a",
                    "-gencode", "arch=compute_120a,code=sm_120a",
                    "-gencode", "arch=compute_90,code=compute_90"],
                   check=True, capture_output=True)
    assert fatbin.fatbins(mixed) == [SUPPORTED]


def test_reader_refuses_a_damaged_fat_binary(tmp_path):
    nvcc = build_nvcc()
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k(float* p) { p[0] = 1.f; }\n")
    obj = tmp_path / "k.o"
    subprocess.run([nvcc, "-c", str(src), "-o", str(obj), "-no-compress", "-gencode",
                    "arch=compute_100a,code=sm_100a"], check=True, capture_output=True)
    data = bytearray(obj.read_bytes())
    section = fatbin.elf_section(bytes(data), ".nv_fatbin")
    start = bytes(data).index(section)
    # The header's SM number says 90 while the cubin inside says 100.
    entry = start + 16
    data[entry + 28:entry + 32] = (90).to_bytes(4, "little")
    obj.write_bytes(bytes(data))
    with pytest.raises(fatbin.FatbinError, match="its cubin says sm_100"):
        fatbin.fatbins(obj)


def cuda_binaries(values):
    bins = []
    if values.get("DRAFTFEED_BUILD_SERVER", "ON") == "ON":
        target = BUILD / "bin" / "draftfeed-target"
        assert target.exists(), f"{target} is not built"
        bins.append(target)
    for name in ("tests/kernels/cuda/kernel_paths_cuda_test", "tests/kernels/cuda/gdn_cuda_test",
                 "tests/kernels/cuda/attention_cuda_test"):
        if (BUILD / name).exists():
            bins.append(BUILD / name)
    bins += sorted((BUILD / "python").glob("**/_draftfeed*.so"))
    return bins


def test_built_binaries_hold_the_configured_architectures():
    values = cache()
    archs = values.get("DRAFTFEED_CUDA_ARCHS")
    assert archs, f"{BUILD}/CMakeCache.txt has no DRAFTFEED_CUDA_ARCHS: configure the tree again"
    want = expected_entries(archs)
    seen = 0
    for path in cuda_binaries(values):
        bins = fatbin.fatbins(path)
        if path.name.startswith("_draftfeed") and not bins:
            continue  # a client module without the NCCL transport has no GPU code
        assert bins, f"{path} holds no CUDA fat binary"
        for i, entries in enumerate(bins):
            assert entries == want, f"{path}: fat binary {i} holds {entries}, not {want}"
        seen += 1
        print(f"{path.relative_to(BUILD)}: {len(bins)} fat binaries, each {' '.join(want)}")
    assert seen, f"no CUDA binary found under {BUILD}"
    if os.environ.get("CI") == "true":
        assert want == SUPPORTED, (
            f"CI builds the supported set {SUPPORTED}, this tree DRAFTFEED_CUDA_ARCHS={archs}")

