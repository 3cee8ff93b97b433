"""Smoke test of reproductions/reproduce_released_selection.py: its --quick mode
(paper 002, Figures 6.1, 6.2 and 6.5) run as a script into a temporary folder."""

import csv
import math
import pathlib
import subprocess
import sys

import pytest

SCRIPT = (pathlib.Path(__file__).resolve().parents[2] / "reproductions"
          / "reproduce_released_selection.py")
#: Every row has these, finite.
REQUIRED = ["epsilon", "theta_star", "runs", "mse", "mse_se", "mean_estimate", "accept_prob",
            "stuck_chains", "seconds"]


@pytest.mark.slow  # a reproduction run (about 30 s on 2 cores): make test-all
def test_quick_mode_writes_the_csv_and_figure(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with (tmp_path / "released_selection.csv").open() as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        fields = reader.fieldnames
    for column in REQUIRED + ["experiment", "method", "statistic", "fisher", "log_fisher",
                              "paired_diff", "paired_diff_se", "selected_a_median"]:
        assert column in fields
    assert {r["experiment"] for r in rows} == {"6.1", "6.2", "6.5"}
    for r in rows:
        for column in REQUIRED:
            assert math.isfinite(float(r[column])), (column, r)
        assert float(r["mse"]) >= 0 and float(r["mse_se"]) >= 0
        assert 0 < float(r["accept_prob"]) < 1
        for column in fields:  # the optional columns are blank or finite
            if column not in ("experiment", "method", "statistic") and r[column] != "":
                assert math.isfinite(float(r[column])), (column, r)
    additive = [r for r in rows if r["experiment"] in ("6.1", "6.2")]
    assert {r["statistic"] for r in additive} == {"|x|", "x^2"}
    for r in additive:  # F(theta*) from the library, and its log
        assert float(r["fisher"]) > 0
        assert math.isclose(math.log(float(r["fisher"])), float(r["log_fisher"]), rel_tol=1e-4)
    selection = [r for r in rows if r["method"] == "selection"]
    assert selection and len(selection) == len([r for r in rows if r["method"] == "no_selection"])
    for r in selection:
        assert 0 < float(r["selected_a_median"]) <= 2
    assert (tmp_path / "released_selection.png").stat().st_size > 0
