"""The notebook docs/notebooks/first_private_posterior.ipynb (issue 18) and `make demo` run end
to end."""

import subprocess
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOK = Path(__file__).parent.parent / "docs" / "notebooks" / "first_private_posterior.ipynb"


@pytest.mark.slow  # make test-all: runs the whole notebook (48 s on 2 cores)
def test_first_private_posterior_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "verdict: INFEASIBLE" in text and "verdict: FEASIBLE" in text


@pytest.mark.slow  # make test-all: about 40 s
def test_make_demo_runs_the_route_its_plan_recommends():
    """`make demo` (examples/demo.py): the plan, its route, NUTS beside it (issue 38)."""
    script = Path(__file__).parent.parent / "examples" / "demo.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    assert "route: NoiseAwareNUTS" in out and "verdict: FEASIBLE" in out
    assert "NUTS's mean inside the private 90% interval" in out
