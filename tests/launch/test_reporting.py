"""``launch/jobs/reporting.py``: the files and console output the launch jobs produce
(one process, no DeepSpeed; a fraction of a second)."""
import csv
import json

import pytest

from launch.jobs.reporting import (
    Curve,
    plot_loss_curve,
    print_summary_table,
    rank0_logger,
    write_metrics_csv,
    write_summary_json,
)


def test_files_round_trip(tmp_path):
    rows = [{"step": 1, "loss": 2.5, "eval_loss": ""}, {"step": 2, "loss": 2.25, "eval_loss": 2.0}]
    write_metrics_csv(tmp_path / "a" / "metrics.csv", rows)
    with open(tmp_path / "a" / "metrics.csv") as f:
        back = list(csv.DictReader(f))
    assert back == [{"step": "1", "loss": "2.5", "eval_loss": ""},
                    {"step": "2", "loss": "2.25", "eval_loss": "2.0"}]
    write_metrics_csv(tmp_path / "empty.csv", [])
    assert not (tmp_path / "empty.csv").exists()
    with pytest.raises(ValueError):
        write_metrics_csv(tmp_path / "bad.csv", [{"step": 1}, {"step": 2, "loss": 1.0}])

    write_summary_json(tmp_path / "b" / "summary.json", {"x": 1.5, "y": {"z": [1, 2]}})
    assert json.loads((tmp_path / "b" / "summary.json").read_text()) == {"x": 1.5,
                                                                        "y": {"z": [1, 2]}}

    for secondary in ((), [Curve("acc", [1, 2], [0.1, 0.4], style={"color": "tab:orange"})]):
        png = tmp_path / f"curve{len(secondary)}.png"
        plot_loss_curve(png, [Curve("train", [1, 2], [2.5, 2.25]),
                              Curve("eval", [0, 2], [2.6, 2.0], "o-")],
                        title="t", ylabel="nats", secondary=secondary,
                        secondary_ylabel="acc", grid=not secondary)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_console_output(capsys):
    print_summary_table("job", [("metric a", "1.0", "0.5")], "3 steps")
    out = capsys.readouterr().out
    assert "job" in out and "metric a" in out and "0.5" in out and "3 steps" in out
    with pytest.raises(ValueError, match="rows"):
        print_summary_table("job", [("only two", "1.0")])

    rank0_logger("lm", rank=0)("hello")
    rank0_logger("lm", rank=1)("not printed")
    out = capsys.readouterr().out
    assert out.startswith("[lm ") and "s] hello" in out and "not printed" not in out
