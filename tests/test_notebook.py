"""notebooks/quickstart.ipynb runs top to bottom in a fresh kernel, and its policy improves."""

from __future__ import annotations

import json

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import ROOT

NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, "clear the notebook's outputs"


@pytest.mark.slow  # a notebook kernel
def test_quickstart_notebook_trains_and_the_score_rises(tmp_path, cache_dir, monkeypatch):
    run_dir = tmp_path / "run"
    # the kernel inherits this process's environment
    monkeypatch.setenv("PPO_QUICKSTART_RUN_DIR", str(run_dir))
    monkeypatch.setenv("PPO_QUICKSTART_STEPS", "20")
    monkeypatch.setenv("PPO_LIGHTNING_CACHE", str(cache_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a tiny model: threads only contend on a shared CPU
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")

    nb = nbformat.read(NOTEBOOK, as_version=4)
    # cwd = notebooks/, as when opened in Jupyter; raises CellExecutionError on the first failing cell
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}
    ).execute()

    assert (run_dir / "metrics.csv").is_file()
    assert (run_dir / "curves.png").stat().st_size > 10_000
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20
    # from ~0.12 (a random byte model) to ~0.25-0.3 after 20 iterations
    assert summary["mean_score_after"] > summary["mean_score_before"] + 0.05, summary
    # the plot cell displayed an image, and the summary line was printed
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert any("mean score (" in o.get("text", "") for o in outputs)
