"""Loads the compiled half of the client (_draftfeed), or says why it cannot.

A pybind11 module loads only into the CPython version it was compiled for
(its file name says which: _draftfeed.cpython-311-x86_64-linux-gnu.so).
Run under another interpreter, Python finds no module it can load and
reports a "partially initialized module (most likely due to a circular
import)", which names neither cause nor fix; this names both.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import pathlib
import re
import sys


def _built_for(path: pathlib.Path) -> str:
    """'CPython 3.11' from _draftfeed.cpython-311-x86_64-linux-gnu.so."""
    m = re.match(r"_draftfeed\.(cpython|pypy)-?(\d)(\d+)", path.name)
    if m is None:
        return path.name
    impl = "CPython" if m.group(1) == "cpython" else "PyPy"
    return f"{impl} {m.group(2)}.{m.group(3)}"


def missing_module_message(package_dir: pathlib.Path) -> str:
    """Why `draftfeed._draftfeed` is not importable from `package_dir`."""
    here = f"Python {sys.version_info.major}.{sys.version_info.minor} ({sys.executable})"
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    built = sorted(p for p in package_dir.glob("_draftfeed*") if p.suffix in (".so", ".pyd"))
    rebuild = ("build it for this interpreter: `pip install --no-build-isolation ./client/python` "
               "run by this Python, or cmake -DPython_EXECUTABLE=" + sys.executable)
    if not built:
        return (f"draftfeed's compiled module _draftfeed is missing from {package_dir}; {rebuild}")
    loadable = {"_draftfeed" + s for s in suffixes}  # the names this Python tries
    if not any(p.name in loadable for p in built):
        names = ", ".join(f"{p.name} ({_built_for(p)})" for p in built)
        return (f"draftfeed's compiled module was built for another Python: {names}, "
                f"but this is {here}, which loads _draftfeed{suffixes[0]}. Run it with the "
                f"Python it was built for, or {rebuild}")
    return ""


def load():
    try:
        return importlib.import_module("draftfeed._draftfeed")
    except ImportError as e:
        why = missing_module_message(pathlib.Path(__file__).resolve().parent)
        if not why:
            # The right file, but it does not load (a shared library missing,
            # ...): the loader's own message says which.
            why = f"draftfeed's compiled module _draftfeed failed to load: {e}"
        raise ImportError(why) from None
