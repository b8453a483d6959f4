"""Builds the draftfeed package: pure Python, or with its compiled module (_draftfeed).

pyproject.toml holds the package's metadata; this file adds what setuptools cannot express:

  DRAFTFEED_NATIVE=auto (default)  build the compiled module when its toolchain is here (cmake,
                                   a C++ compiler, gRPC's CMake package, pybind11), else a
                                   pure-Python wheel (py3-none-any) whose feeds run over the
                                   pip grpcio and protobuf packages;
  DRAFTFEED_NATIVE=1               build the compiled module or fail saying why;
  DRAFTFEED_NATIVE=0               pure Python, whatever is installed.

The compiled module comes from a client-only CMake tree of the repository (no target server,
no CUDA unless DRAFTFEED_CMAKE_ARGS asks for it) for the Python that runs this.
"""

import glob
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = pathlib.Path(__file__).resolve().parent


def _source_dir() -> pathlib.Path:
    """The repository root: this package lives in client/python of it (pip
    builds a local directory in place, so the rest of the tree is there)."""
    root = pathlib.Path(os.environ.get("DRAFTFEED_SOURCE_DIR", HERE.parents[1]))
    cml = root / "CMakeLists.txt"
    if not cml.is_file() or "project(draftfeed" not in cml.read_text():
        raise RuntimeError(
            f"draftfeed: the repository's CMakeLists.txt is not at {cml}; install from a "
            f"clone (pip install ./client/python) or set DRAFTFEED_SOURCE_DIR to one")
    return root


def _version() -> str:
    text = (_source_dir() / "CMakeLists.txt").read_text()
    m = re.search(r"project\(draftfeed VERSION ([0-9.]+)", text)
    if m is None:
        raise RuntimeError("draftfeed: no VERSION in the top-level project() of CMakeLists.txt")
    return m.group(1)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError("draftfeed: building the compiled module needs cmake on PATH")
        build_dir = pathlib.Path(os.environ.get("DRAFTFEED_CMAKE_BUILD_DIR") or
                                 pathlib.Path(self.build_temp).resolve() / "cmake")
        args = [cmake, "-S", str(_source_dir()), "-B", str(build_dir),
                "-DCMAKE_BUILD_TYPE=Release",
                "-DDRAFTFEED_BUILD_SERVER=OFF", "-DDRAFTFEED_BUILD_TESTS=OFF",
                "-DDRAFTFEED_BUILD_BENCH=OFF", "-DDRAFTFEED_BUILD_PYTHON=ON",
                "-DDRAFTFEED_ENABLE_CUDA=OFF",
                # The interpreter running pip (a venv's python): the module's ABI.
                f"-DPython_EXECUTABLE={sys.executable}"]
        if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists():
            args += ["-G", "Ninja"]
        if shutil.which("ccache"):
            args += ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
        args += shlex.split(os.environ.get("DRAFTFEED_CMAKE_ARGS", ""))  # later ones win
        subprocess.run(args, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        subprocess.run([cmake, "--build", str(build_dir), "--target", "_draftfeed", "-j", jobs],
                       check=True)
        built = sorted((build_dir / "python" / "draftfeed").glob("_draftfeed*.so"))
        if len(built) != 1:
            raise RuntimeError(f"draftfeed: expected one _draftfeed*.so in "
                               f"{build_dir / 'python' / 'draftfeed'}, found {built}")
        dest = pathlib.Path(self.get_ext_fullpath(ext.name))
        if built[0].name != dest.name:
            raise RuntimeError(f"draftfeed: CMake built {built[0].name} but this Python "
                               f"({sys.executable}) loads {dest.name}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built[0], dest)


NATIVE_ENV = "DRAFTFEED_NATIVE"


def _native_toolchain_missing() -> str:
    """What the compiled module's build lacks here ("" when nothing): checked before CMake
    runs, so a machine without Debian's gRPC (a stock PyTorch image) gets the pure-Python
    package instead of a failed build."""
    if shutil.which("cmake") is None:
        return "cmake is not on PATH"
    if not any(shutil.which(c) for c in (os.environ.get("CXX", "c++"), "c++", "g++", "clang++")):
        return "no C++ compiler on PATH"
    prefixes = [p for p in os.environ.get("CMAKE_PREFIX_PATH", "").split(os.pathsep) if p]
    prefixes += [sys.prefix, "/usr/local", "/usr"]
    def found(*names):  # where CMake's find_package looks for <name>Config.cmake
        dirs = ("lib*/cmake/*", "lib*/*/cmake/*", "share/cmake/*", "share/*/cmake")
        return any(glob.glob(os.path.join(prefix, d, name))
                   for prefix in prefixes for d in dirs for name in names)
    if not found("gRPCConfig.cmake", "grpc-config.cmake"):
        return "gRPC's C++ CMake package (gRPCConfig.cmake) is not installed"
    try:
        import pybind11  # noqa: F401  pip's pybind11 brings its CMake package
    except ImportError:
        if not found("pybind11Config.cmake", "pybind11-config.cmake"):
            return "pybind11 (its CMake package) is not installed"
    return ""


def _build_native() -> bool:
    mode = os.environ.get(NATIVE_ENV, "auto").strip().lower()
    if mode in ("0", "off", "no", "false"):
        return False
    if mode not in ("auto", "1", "on", "yes", "true"):
        raise RuntimeError(f"draftfeed: {NATIVE_ENV}={mode!r}: use auto, 1 or 0")
    missing = _native_toolchain_missing()
    if not missing:
        return True
    if mode != "auto":
        raise RuntimeError(f"draftfeed: {NATIVE_ENV}={mode} asks for the compiled module, but "
                           f"{missing} (scripts/install-deps.sh on Debian installs what it needs;"
                           f" or build the pure-Python package with {NATIVE_ENV}=0)")
    print(f"draftfeed: building the pure-Python package ({missing}); its feeds use the grpcio "
          f"and protobuf packages. {NATIVE_ENV}=1 insists on the compiled module.",
          file=sys.stderr)
    return False


if _build_native():
    setup(version=_version(), ext_modules=[Extension("draftfeed._draftfeed", sources=[])],
          cmdclass={"build_ext": CMakeBuild}, install_requires=["numpy"])
else:
    # No extension: setuptools makes a py3-none-any wheel.
    setup(version=_version(), install_requires=["numpy", "grpcio", "protobuf"])
