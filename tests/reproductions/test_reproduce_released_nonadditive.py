"""Smoke test of reproductions/reproduce_released_nonadditive.py: its --quick mode."""

import csv
import pathlib
import subprocess
import sys

import pytest

SCRIPT = (pathlib.Path(__file__).resolve().parents[2] / "reproductions"
          / "reproduce_released_nonadditive.py")


def rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # a reproduction run (about 35 s on 2 cores): make test-all
def test_quick_mode_writes_the_table_and_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out-dir", str(tmp_path)],
                   check=True, timeout=300, capture_output=True)
    table = rows(tmp_path / "released_nonadditive.csv")
    assert {(r["statistic"], float(r["theta"])) for r in table} == {
        (s, t) for s in ("median", "max") for t in (0.5, 1.0, 2.0)}
    for r in table:
        assert float(r["mse"]) >= 0 and float(r["mse_se"]) >= 0
        assert 0 < float(r["accept"]) < 1
        assert float(r["thesis_mse"]) > 0
    figure = rows(tmp_path / "released_nonadditive_figure.csv")
    fisher = [r for r in figure if r["panel"] == "fisher"]
    assert {r["statistic"] for r in fisher} == {"median", "max"}
    assert all(float(r["stderr"]) >= 0 for r in fisher)
    acf = [r for r in figure if r["panel"] == "acf" and r["x"] == "0"]
    assert [float(r["value"]) for r in acf] == [1.0, 1.0]  # lag 0 of each statistic
    assert (tmp_path / "released_nonadditive.png").stat().st_size > 0
