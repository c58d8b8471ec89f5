"""The dependency lists in pyproject.toml and environment.yml agree."""

import re
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
# conda-forge spells a few packages differently from PyPI
CONDA_TO_PYPI = {"pytorch": "torch"}


def split(requirement: str):
    "'jupyter-book>=1,<2' -> ('jupyter-book', '>=1,<2'); names normalised as PyPI does"
    name, spec = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", requirement).groups()
    name = re.sub(r"[-_.]+", "-", name).lower()
    return CONDA_TO_PYPI.get(name, name), spec.replace(" ", "")


def pyproject_requirements():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs = list(project["dependencies"])
    for items in extras.values():
        reqs += [r for r in items if not r.startswith("paligemma_lib")]
    return dict(split(r) for r in reqs)


def conda_requirements():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = [
        d
        for d in env["dependencies"]
        if isinstance(d, str) and not d.startswith(("python", "pip"))
    ]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    return dict(split(r) for r in conda), pip


def test_same_packages_and_version_bounds():
    ours = pyproject_requirements()
    conda, _ = conda_requirements()
    assert set(ours) == set(conda), (
        f"only in pyproject: {set(ours) - set(conda)}; "
        f"only in environment.yml: {set(conda) - set(ours)}"
    )
    for name, spec in ours.items():
        assert conda[name] == spec, (
            f"{name}: pyproject says {spec!r}, environment.yml says {conda[name]!r}"
        )


def test_conda_installs_the_package_with_dev_extra():
    _, pip = conda_requirements()
    assert pip == ["-e .[dev]"]


def test_dev_extra_is_all_the_others():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["dev"] == [
        "paligemma_lib[" + ",".join(sorted(k for k in extras if k != "dev")) + "]"
    ]


def test_runtime_dependencies_are_what_the_library_imports():
    "Every third-party module paligemma_lib imports is a runtime dependency"
    import_names = {
        "torch": "torch",
        "numpy": "numpy",
        "PIL": "pillow",
        "safetensors": "safetensors",
        "sentencepiece": "sentencepiece",
        "matplotlib": "matplotlib",
        "tqdm": "tqdm",
    }
    imported = set()
    for path in (ROOT / "paligemma_lib").glob("*.py"):
        if path.name == "_nbdev.py":  # build tooling, runs inside nbdev-export only
            continue
        for module in re.findall(
            r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", path.read_text(), re.M
        ):
            imported.add(module)
    third_party = {
        m for m in imported if m not in _stdlib() and m not in {"paligemma_lib"}
    }
    unknown = third_party - set(import_names)
    assert not unknown, (
        f"paligemma_lib imports {unknown}, which are not runtime dependencies"
    )
    runtime = {
        split(r)[0]
        for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
            "dependencies"
        ]
    }
    assert {import_names[m] for m in third_party} <= runtime


def _stdlib():
    import sys

    return set(sys.stdlib_module_names)
