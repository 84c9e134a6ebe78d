"""The course's package as a learner installs it (issue 33): a wheel and an sdist built from the
sources, the wheel installed into a clean virtual environment that has torch and nothing of the
course's tooling, running a 2-rank job there; and requirements.txt's pins within pyproject's ranges.

The clean environment is made from the interpreter that .venv was made from (not from .venv), with
pip's ``--python``; installing torch there would take a minute, so a ``.pth`` file points it at a
folder of links to the packages the wheel needs at run time (torch, cloudpickle, matplotlib, numpy
and what they require), with their metadata, which pip then counts as installed: it installs the
wheel alone, from no index.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import dpcourse

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
_spec = importlib.util.spec_from_file_location("course_download",
                                               ROOT / "_ext" / "course_download.py")
course_download = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(course_download)
# What a learner's environment must not get from the package: the book, the tests, Jupyter.
TOOLING = ("jupyter_book", "sphinx", "myst_nb", "nbval", "nbclient", "pytest", "ipykernel",
           "jupyterlab", "hypothesis", "yaml")


def declared() -> dict[str, list[Requirement]]:
    """Every requirement of pyproject.toml (dependencies and extras), by canonical name."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.10 has no tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found: dict[str, list[Requirement]] = {}
    for line in project["dependencies"] + sum(project["optional-dependencies"].values(), []):
        req = Requirement(line)
        if canonicalize_name(req.name) != "dpcourse":  # dev's "dpcourse[notebooks,book]"
            found.setdefault(canonicalize_name(req.name), []).append(req)
    return found


def test_requirements_pins_lie_within_pyprojects_ranges():
    ranges = declared()
    assert "torch" in ranges and all(r.specifier for r in ranges["torch"])
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", (ROOT / "requirements.txt").read_text(),
                      re.M)
    assert len(pins) > 10
    for name, version in pins:
        reqs = ranges.get(canonicalize_name(name))
        assert reqs, f"requirements.txt pins {name}, which pyproject.toml does not declare"
        for req in reqs:
            assert req.specifier.contains(version, prereleases=True), (
                f"requirements.txt's {name}=={version} is outside pyproject's {req}")


def runtime_closure(names: list[str]) -> list[metadata.Distribution]:
    """The installed distributions that ``names`` need at run time, recursively, with the extras
    that a requirement names (a CUDA build of torch needs ``cuda-toolkit[cudart, ...]``, whose
    runtime libraries are its extras' requirements)."""
    seen: dict[str, metadata.Distribution] = {}
    done: set[tuple[str, str]] = set()  # (distribution, extra) whose requirements were queued
    todo = [Requirement(n) for n in names]
    while todo:
        req = todo.pop()
        key = canonicalize_name(req.name)
        if key not in seen:
            seen[key] = metadata.distribution(req.name)
        for extra in ("", *sorted(req.extras)):
            if (key, extra) in done:
                continue
            done.add((key, extra))
            for text in seen[key].requires or []:
                need = Requirement(text)
                if need.marker is None or need.marker.evaluate({"extra": extra}):
                    todo.append(need)  # a distribution met twice is looked up once (seen)
    return list(seen.values())


def clean_environment(tmp: Path, names: list[str]) -> Path:
    """A virtual environment in ``tmp/venv`` made from the interpreter .venv was made from, that
    sees ``names`` and what they need at run time (links to this environment's copies, with their
    metadata, through a ``.pth`` file) and nothing else; returns its ``python``."""
    runtime_dir = tmp / "runtime"
    runtime_dir.mkdir()
    for dist in runtime_closure(names):
        for top in {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            target, link = Path(dist.locate_file(top)), runtime_dir / top
            if target.exists() and not link.exists() and not top.endswith((".pth", "__pycache__")):
                link.symlink_to(target)
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    venv = tmp / "venv"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True)
    Path(purelib.stdout.strip(), "runtime-links.pth").write_text(f"{runtime_dir}\n")
    return python


def build(tmp: Path) -> tuple[Path, Path]:
    """An sdist of a copy of the sources, and a wheel built from that sdist (so the sdist is
    complete): what ``python -m build`` makes, through the same setuptools backend."""
    src = course_download.copy_package_sources(ROOT, tmp / "src")
    dist = tmp / "dist"
    backend = "import sys; from setuptools import build_meta as b; b.build_{}(sys.argv[1])"
    subprocess.run([sys.executable, "-c", backend.format("sdist"), str(dist)], cwd=src,
                   check=True, capture_output=True)
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp / "unpacked", filter="data")
    (unpacked,) = (tmp / "unpacked").iterdir()
    subprocess.run([sys.executable, "-c", backend.format("wheel"), str(dist)], cwd=unpacked,
                   check=True, capture_output=True)
    (wheel,) = dist.glob("*.whl")
    return sdist, wheel


def test_the_sdist_and_the_wheel_hold_the_package_and_declare_its_needs(tmp_path):
    sdist, wheel = build(tmp_path)
    assert sdist.name == f"dpcourse-{dpcourse.__version__}.tar.gz"
    assert wheel.name == f"dpcourse-{dpcourse.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as whl:
        meta = whl.read(f"dpcourse-{dpcourse.__version__}.dist-info/METADATA").decode()
        assert "dpcourse/harness/launch/worker.py" in whl.namelist()
    needs = [r for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M) if "extra ==" not in r]
    assert sorted(Requirement(r).name for r in needs) == [
        "cloudpickle", "matplotlib", "numpy", "torch"]


# The introduction (4 ranks) and chapter 1 from the course's archive, as a learner runs them: the
# archive unpacked, each notebook's cells run from the top by the clean environment's Python in a
# network namespace of its own (no network: the install cell must find the wheel beside the
# notebook). Not a Jupyter kernel (the environment has no Jupyter): each notebook's cells run in
# one namespace of their own, as a kernel would run them.
RUN_NOTEBOOKS = textwrap.dedent("""
    import importlib.metadata, importlib.util, json, socket, sys, time
    try:
        socket.create_connection(("1.1.1.1", 443), timeout=3).close()
        sys.exit("the network is reachable from here: this run would not show that none is needed")
    except OSError as error:
        offline = str(error)
    assert importlib.util.find_spec("dpcourse") is None, "dpcourse is there before the run"
    seconds = {}
    for name in sys.argv[1:]:
        cells = [c for c in json.load(open(name))["cells"] if c["cell_type"] == "code"]
        namespace = {"__name__": "__main__"}
        start = time.perf_counter()
        for i, cell in enumerate(cells):
            exec(compile("".join(cell["source"]), f"{name}, code cell {i}", "exec"), namespace)
        seconds[name] = round(time.perf_counter() - start, 1)
    import dpcourse
    print(json.dumps({
        "seconds": seconds, "offline": offline, "file": dpcourse.__file__,
        "version": dpcourse.__version__,
        "metadata_version": importlib.metadata.version("dpcourse"),
        "importable": [m for m in TOOLING if importlib.util.find_spec(m)],
    }))
""").replace("TOOLING", repr(TOOLING))


def network_namespace() -> list[str]:
    """The command prefix that runs a command with no network (a namespace with only loopback),
    or a skip where this machine cannot make one."""
    command = ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("no unshare or ip (util-linux, iproute2): cannot cut the network off")
    if subprocess.run([*command, "true"], capture_output=True).returncode:
        pytest.skip("unshare --net is not permitted here (needs root or CAP_SYS_ADMIN)")
    return command


def course_archive(tmp: Path) -> Path:
    """The archive the built website serves (``make test`` builds it first), else one built now
    from the sources, as ``_ext/course_download.py`` builds it for the site."""
    served = HTML / course_download.FOLDER / f"{course_download.ARCHIVE_NAME}.zip"
    if served.exists():
        return served
    if os.environ.get("DPCOURSE_REQUIRE_SITE"):
        raise AssertionError(f"the website serves no {served.name}: see _ext/course_download.py")
    wheel = course_download.build_wheel(ROOT, tmp / "dist")
    return course_download.write_archive(sorted((ROOT / "chapters").glob("*.ipynb")), wheel,
                                         tmp / "course.zip", "with solutions")


@pytest.mark.timeout(300)
def test_the_course_archive_runs_the_introduction_and_chapter_1_offline_in_a_clean_env(tmp_path):
    offline = network_namespace()
    with zipfile.ZipFile(course_archive(tmp_path)) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "unpacked")
    folder = tmp_path / "unpacked" / course_download.ARCHIVE_NAME
    wheel = f"dpcourse-{dpcourse.__version__}-py3-none-any.whl"
    assert {f"{folder.name}/{n}" for n in ("01_single_device.ipynb", "intro.ipynb", wheel,
                                           "README.txt")} <= set(names)
    # torch, the three needs the wheel declares (what Colab, Kaggle and any scientific Python
    # have) and pip, which the install cell runs; no dpcourse, no Jupyter, no IPython.
    python = clean_environment(tmp_path, ["torch", "numpy", "matplotlib", "cloudpickle", "pip"])
    (tmp_path / "run_notebooks.py").write_text(RUN_NOTEBOOKS)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(MPLBACKEND="Agg", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1",
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    run = subprocess.run([*offline, str(python), str(tmp_path / "run_notebooks.py"),
                          "intro.ipynb", "01_single_device.ipynb"], cwd=folder, env=env,
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert "unreachable" in report["offline"], report
    assert "[rank 3] I hold 4" in run.stdout  # the introduction's 4 ranks ran
    assert Path(report["file"]).is_relative_to(tmp_path / "venv"), report  # the wheel's
    assert report["version"] == report["metadata_version"] == dpcourse.__version__
    assert report["importable"] == [], f"the clean environment has {report['importable']}"
    print(f"from the archive, offline: {report['seconds']}")
