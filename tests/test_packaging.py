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


def build(tmp: Path) -> tuple[Path, Path]:
    """An sdist of a copy of the sources, and a wheel built from that sdist (so the sdist is
    complete): what ``python -m build`` makes, through the same setuptools backend."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "LICENSE-CC-BY-4.0.txt"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
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


JOB = textwrap.dedent("""
    import importlib.metadata, importlib.util, json, sys
    import torch
    import torch.distributed as dist
    import dpcourse
    from dpcourse import runtime
    from dpcourse.harness.launch import run_ranks

    def rank_sum():
        t = torch.full((3,), float(dist.get_rank() + 1), device=runtime.device())
        dist.all_reduce(t)
        return t.tolist()

    if __name__ == "__main__":
        print(json.dumps({
            "results": run_ranks(rank_sum, 2),
            "file": dpcourse.__file__,
            "version": dpcourse.__version__,
            "metadata_version": importlib.metadata.version("dpcourse"),
            "importable": [m for m in sys.argv[1:] if importlib.util.find_spec(m)],
        }))
""")


@pytest.mark.timeout(120)
def test_the_wheel_alone_runs_two_ranks_in_a_clean_environment(tmp_path):
    sdist, wheel = build(tmp_path)
    assert sdist.name == f"dpcourse-{dpcourse.__version__}.tar.gz"
    assert wheel.name == f"dpcourse-{dpcourse.__version__}-py3-none-any.whl"
    # The packages the wheel needs at run time, as links, with their metadata.
    with zipfile.ZipFile(wheel) as whl:
        meta = whl.read(f"dpcourse-{dpcourse.__version__}.dist-info/METADATA").decode()
    needs = [r for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M) if "extra ==" not in r]
    assert sorted(Requirement(r).name for r in needs) == [
        "cloudpickle", "matplotlib", "numpy", "torch"]
    runtime_dir = tmp_path / "runtime"
    runtime_dir.mkdir()
    for dist in runtime_closure([Requirement(r).name for r in needs]):
        for top in {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            target, link = Path(dist.locate_file(top)), runtime_dir / top
            if target.exists() and not link.exists() and not top.endswith((".pth", "__pycache__")):
                link.symlink_to(target)
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    venv = tmp_path / "venv"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True)
    Path(purelib.stdout.strip(), "runtime-links.pth").write_text(f"{runtime_dir}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
         "--no-compile", "--disable-pip-version-check", "--quiet", str(wheel)],
        env=env, cwd=tmp_path, capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    (tmp_path / "job.py").write_text(JOB)
    run = subprocess.run([str(python), "job.py", *TOOLING], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["results"] == [[3.0, 3.0, 3.0]] * 2
    assert Path(report["file"]).is_relative_to(venv), report["file"]  # the wheel, not src/
    assert report["version"] == report["metadata_version"] == dpcourse.__version__
    assert report["importable"] == [], f"the clean environment has {report['importable']}"
