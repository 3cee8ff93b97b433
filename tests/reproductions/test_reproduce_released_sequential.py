"""Smoke test of reproductions/reproduce_released_sequential.py: its --quick mode
(paper 002, Figure 6.4), run as a script in a subprocess (about 25 s on 2 cores)."""

import csv
import pathlib
import subprocess
import sys

import pytest

SCRIPT = (pathlib.Path(__file__).resolve().parents[2] / "reproductions"
          / "reproduce_released_sequential.py")


@pytest.mark.slow  # a reproduction run (about 30 s on 2 cores): make test-all
def test_quick_mode_writes_the_csv_and_figure(tmp_path):
    pytest.importorskip("matplotlib")
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    with (tmp_path / "released_sequential.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {(r["statistic"], float(r["epsilon"])) for r in rows} == {
        (s, e) for s in ("|x|", "x^2") for e in (2.0, 20.0)}
    for r in rows:
        # the releases' Laplace scale is the statistic's bound over epsilon
        bound = 10.0 if r["statistic"] == "|x|" else 100.0
        assert float(r["noise_scale"]) == pytest.approx(bound / float(r["epsilon"]), rel=1e-9)
        assert float(r["mse"]) >= 0 and float(r["mse_se"]) >= 0
        assert float(r["fisher"]) > 0
        assert 0.05 < float(r["accept_prob"]) < 0.95
        assert float(r["ess_min"]) > 1
    fisher = {(r["statistic"], float(r["epsilon"])): float(r["fisher"]) for r in rows}
    for eps in (2.0, 20.0):  # Example 4: |x| is the more informative release
        assert fisher[("|x|", eps)] > fisher[("x^2", eps)]
    assert fisher[("|x|", 20.0)] > fisher[("|x|", 2.0)]  # less noise, more information
    # the paired difference (x^2 minus |x|) sits on the x^2 rows only
    assert all((r["paired_diff"] == "") == (r["statistic"] == "|x|") for r in rows)
    assert (tmp_path / "released_sequential.png").stat().st_size > 0
