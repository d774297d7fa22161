"""Training curves: the series taken from a summary / TrainResult, and the PNG drawn from them."""

import builtins
import math

import pytest

from rsclip_ds.reporting.curves import curve_series, plot_curves
from rsclip_ds.loop import TrainResult

SUMMARY = {"losses": [9.0, 7.5, 6.0, 5.5], "lrs": [0.0, 1e-3, 1e-3, 5e-4],
           "evals": [{"step": 4, "zero_shot/top1": 0.9, "retrieval/t2i_R@1": 0.2},
                     {"step": 2, "zero_shot/top1": 0.5}]}


def test_series_from_summary():
    s = curve_series(SUMMARY)
    assert s["steps"] == [1, 2, 3, 4] and s["loss"] == SUMMARY["losses"] and s["lr"] == SUMMARY["lrs"]
    assert s["eval_steps"] == [2, 4]                        # sorted by step
    assert s["eval"]["zero_shot/top1"] == [0.5, 0.9]
    assert math.isnan(s["eval"]["retrieval/t2i_R@1"][0]) and s["eval"]["retrieval/t2i_R@1"][1] == 0.2


def test_series_from_train_result():
    result = TrainResult(losses=[3.0, 2.0], lrs=[1e-4, 2e-4])
    s = curve_series(result)
    assert s["steps"] == [1, 2] and s["eval"] == {} and s["eval_steps"] == []


def test_series_needs_losses():
    with pytest.raises(ValueError, match="summary.json"):
        curve_series({"lrs": [1.0]})


def test_png_has_three_panels_with_evals(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    with_eval = plot_curves(SUMMARY, tmp_path / "a.png")
    without = plot_curves({"losses": [1.0, 0.5], "lrs": [1.0, 1.0]}, tmp_path / "b.png")
    # figsize 5 inches per panel x 3.6 at 100 dpi
    assert matplotlib.image.imread(with_eval).shape[:2] == (360, 1500)
    assert matplotlib.image.imread(without).shape[:2] == (360, 1000)


def test_missing_matplotlib_skips_with_a_log_line(tmp_path, monkeypatch, caplog):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with caplog.at_level("INFO", logger="rsclip_ds"):
        assert plot_curves(SUMMARY, tmp_path / "c.png") is None
    assert "curves skipped" in caplog.text and not (tmp_path / "c.png").exists()
