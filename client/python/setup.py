"""Builds draftfeed's compiled module (_draftfeed) with the repository's CMake.

pyproject.toml holds the package's metadata; this file only adds the build
step setuptools cannot express: configure a client-only CMake tree (no target
server, no CUDA unless DRAFTFEED_CMAKE_ARGS asks for it) for the Python that
runs it, build the pybind11 target and put it where the wheel takes it from.
"""

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


setup(version=_version(), ext_modules=[Extension("draftfeed._draftfeed", sources=[])],
      cmdclass={"build_ext": CMakeBuild})
