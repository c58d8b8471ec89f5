"""A simulated Colab runtime runs the setup cell, then chapter 1.

Colab gives a notebook a Python that already has torch (a CUDA build), an older
`transformers`, and Jupyter, and imports `google.colab` into every kernel. This test
makes such a runtime in a fresh virtual environment: torch (this machine's build),
transformers 4.x, ipykernel and nbclient, and a stand-in `google.colab` imported at
start-up by `sitecustomize`. Chapter 1 then runs top to bottom in that environment,
setup cell first. It checks that the setup cell installed the library and the
chapters' extra from this checkout (PALIGEMMA_LIB_SOURCE stands in for the git URL),
upgraded transformers to 5.x before anything imported it, and left torch alone.

It installs packages from the package index, so it takes minutes and is not part of
the default run: CI runs it with `python -m pytest tests/test_colab.py -m colab`.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.colab


def run(*args, **kw):
    "Run a command; on failure show its output"
    done = subprocess.run(args, capture_output=True, text=True, **kw)
    assert done.returncode == 0, f"{args}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_setup_cell_then_chapter_1_in_a_simulated_colab(tmp_path):
    venv = tmp_path / "colab"
    run(sys.executable, "-m", "venv", str(venv))
    python = str(venv / "bin" / "python")
    torch_version = torch.__version__
    run(
        python,
        "-m",
        "pip",
        "install",
        "-q",
        f"torch=={torch_version}",
        "transformers>=4.40,<5",
        "ipykernel",
        "nbclient",
        "nbformat",
    )

    # What Colab imports into every kernel before the first cell runs
    site = run(
        python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    )
    site = Path(site.strip())
    (site / "google" / "colab").mkdir(parents=True)
    (site / "google" / "colab" / "__init__.py").write_text('"Stand-in for Colab"\n')
    (site / "sitecustomize.py").write_text("import google.colab  # as in Colab\n")

    def versions():
        code = (
            "from importlib.metadata import version as v; "
            "print(v('torch'), v('transformers'))"
        )
        return run(python, "-c", code).split()

    before_torch, before_transformers = versions()
    assert before_torch == torch_version and before_transformers.startswith("4.")

    # Chapter 1, every cell, in a kernel of that environment; the setup cell installs
    execute = textwrap.dedent(
        """
        import sys, nbformat
        from nbclient import NotebookClient
        nb = nbformat.read(sys.argv[1], as_version=4)
        NotebookClient(nb, timeout=900, kernel_name="python3",
                       resources={"metadata": {"path": sys.argv[2]}}).execute()
        print("executed", len(nb.cells), "cells")
        """
    )
    env = {
        **os.environ,
        "PALIGEMMA_LIB_SOURCE": ROOT.as_uri(),
        "PYTHONPATH": "",
        "PYTHONNOUSERSITE": "1",
    }
    chapter = ROOT / "book" / "01_images_to_patches.ipynb"
    work = tmp_path / "book"
    work.mkdir()
    out = run(python, "-c", execute, str(chapter), str(work), env=env, cwd=tmp_path)
    assert "executed" in out

    after_torch, after_transformers = versions()
    assert after_torch == torch_version, "the setup cell replaced Colab's torch"
    assert int(after_transformers.split(".")[0]) >= 5
    where = run(
        python,
        "-c",
        "import paligemma_lib; print(paligemma_lib.__file__)",
        env=env,
        cwd=tmp_path,
    )
    assert Path(where.strip()).is_relative_to(site), (
        where
    )  # installed, not this checkout
