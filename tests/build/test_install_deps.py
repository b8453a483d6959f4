"""scripts/install-deps.sh installs what each of the README's two commands needs: the main job's
packages alone by default (no test, fuzzing, Slurm or plotting packages), the tests' on top with
--for-tests; and a tree configured with only the main job's packages builds the main job."""

import pathlib
import re
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install-deps.sh"
# What only the tests, fuzzers, Slurm checks, metrics lint and plots use.
TEST_ONLY = {"libgtest-dev", "libgmock-dev", "libbenchmark-dev", "clang", "libclang-rt-14-dev",
             "python3-pytest", "python3-pytest-timeout", "slurm-wlm", "munge", "python3-yaml",
             "python3-matplotlib", "prometheus", "python3-venv", "python3-pip", "python3-torch"}
# What building the target and the Python module and running the synthetic trainer need.
MAIN_NEEDS = {"build-essential", "cmake", "libgrpc++-dev", "protobuf-compiler-grpc",
              "libabsl-dev", "libcpp-httplib-dev", "pybind11-dev", "python3-dev",
              "python3-numpy"}


def packages(*args, env=None):
    r = subprocess.run(["bash", str(SCRIPT), *args, "--list"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return {line.split()[0] for line in r.stdout.splitlines()}


def test_the_main_job_gets_its_packages_and_no_test_ones():
    main, tests = packages(), packages("--for-tests")
    assert MAIN_NEEDS <= main, sorted(MAIN_NEEDS - main)
    assert not main & TEST_ONLY, sorted(main & TEST_ONLY)
    assert main | TEST_ONLY <= tests, sorted(main | TEST_ONLY - tests)
    target = packages(env={"DRAFTFEED_DEPS": "target", "PATH": "/usr/bin:/bin"})
    assert target < main and "python3-dev" not in target and "cmake" in target


def test_the_two_commands_ask_for_what_they_run():
    main_job = (REPO / "scripts" / "run_main_job.sh").read_text()
    run_tests = (REPO / "scripts" / "run_tests.sh").read_text()
    assert re.search(r"^bash scripts/install-deps.sh$", main_job, re.M), main_job
    assert re.search(r"^bash scripts/install-deps.sh --for-tests$", run_tests, re.M), run_tests
    # The tests' tree has its suites whatever configured it first (the main job turns them off).
    assert "-DDRAFTFEED_BUILD_TESTS=ON -DDRAFTFEED_BUILD_BENCH=ON" in run_tests
    assert "bash scripts/run_tests.sh" in (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    assert "bash scripts/run_main_job.sh\nbash scripts/run_tests.sh\n" in readme
    assert "`scripts/install-deps.sh\n--for-tests`" in readme or \
        "`scripts/install-deps.sh --for-tests`" in readme


def test_unknown_arguments_are_refused():
    r = subprocess.run(["bash", str(SCRIPT), "--for-test"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown argument '--for-test'" in r.stderr, r.stderr


def test_every_package_is_in_the_archive():
    if shutil.which("apt-cache") is None:
        pytest.skip("no apt-cache (not Debian)")
    names = sorted(packages("--for-tests"))
    r = subprocess.run(["apt-cache", "show", "--no-all-versions", *names], capture_output=True,
                       text=True, timeout=120)
    if "No packages found" in r.stderr and not r.stdout:
        pytest.skip("apt-cache has no package lists (apt-get update has not run)")
    found = set(re.findall(r"^Package: (\S+)$", r.stdout, re.M))
    assert found == set(names), sorted(set(names) - found)


def test_a_second_run_installs_nothing():
    """Idempotent: with every package present (run_tests.sh installed them) it calls no apt."""
    missing = [p for p in packages("--for-tests") if subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True).stdout
        != "install ok installed"]
    if missing or shutil.which("dpkg-query") is None:
        pytest.skip(f"not every package is installed here: {missing}")
    for args in ([], ["--for-tests"]):
        r = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and r.stdout == "install-deps: all packages present\n", r


def configure(tmp_path, *args):
    return subprocess.run(
        ["cmake", "-S", str(REPO), "-B", str(tmp_path / "tree"), "-DDRAFTFEED_ENABLE_CUDA=OFF",
         # As on a machine with the main job's packages only.
         "-DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON", "-DCMAKE_DISABLE_FIND_PACKAGE_benchmark=ON",
         *args], capture_output=True, text=True, timeout=300)


def test_without_googletest_and_benchmark_the_main_job_configures(tmp_path):
    if shutil.which("cmake") is None:
        pytest.skip("no cmake")
    r = configure(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    cache = (tmp_path / "tree" / "CMakeCache.txt").read_text()
    assert "DRAFTFEED_BUILD_TESTS:BOOL=OFF" in cache and "DRAFTFEED_BUILD_BENCH:BOOL=OFF" in cache
    r = subprocess.run(["cmake", "--build", str(tmp_path / "tree"), "--target", "help"],
                       capture_output=True, text=True, timeout=120)
    assert "draftfeed-target" in r.stdout and "_draftfeed" in r.stdout, r.stdout
    # Asked for explicitly (as run_tests.sh does), a missing GoogleTest fails the configure.
    r = configure(tmp_path, "-DDRAFTFEED_BUILD_TESTS=ON")
    assert r.returncode != 0 and "GTest" in r.stdout + r.stderr, r.stdout + r.stderr
