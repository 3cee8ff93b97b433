"""The notebook docs/notebooks/first_private_posterior.ipynb runs end to end (issue 18)."""

from pathlib import Path

import nbclient
import nbformat

NOTEBOOK = Path(__file__).parent.parent / "docs" / "notebooks" / "first_private_posterior.ipynb"


def test_first_private_posterior_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "verdict: INFEASIBLE" in text and "verdict: FEASIBLE" in text
