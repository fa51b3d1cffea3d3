"""``xpyd bench --plot``: matplotlib is optional, and its absence is a bad argument found before any load."""

from __future__ import annotations

import argparse
import sys

import pytest

from xpyd.bench import main as bench_main
from xpyd.bench import plot


def _hide_matplotlib(monkeypatch) -> None:
    """As if matplotlib were not installed: importing it (or any submodule) raises ImportError."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_check_names_the_extra_when_matplotlib_is_missing(monkeypatch):
    _hide_matplotlib(monkeypatch)
    with pytest.raises(ValueError, match=r"--plot needs matplotlib.*pip install 'xpyd\[plot\]'"):
        plot.check_available()


def test_check_passes_when_matplotlib_is_installed():
    pytest.importorskip("matplotlib")
    plot.check_available()


def test_missing_matplotlib_exits_2_before_any_request(monkeypatch, tmp_path, capsys):
    _hide_matplotlib(monkeypatch)

    async def no_load(config, plan):
        raise AssertionError("the run started although --plot cannot be honoured")

    monkeypatch.setattr(bench_main, "_bench", no_load)
    parser = argparse.ArgumentParser(prog="xpyd bench")
    bench_main.add_arguments(parser)
    args = parser.parse_args(["--url", "http://127.0.0.1:9", "--num-requests", "2", "--no-progress",
                              "--plot", str(tmp_path / "plots")])
    assert bench_main.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("xpyd bench: error: --plot needs matplotlib") and "pip install 'xpyd[plot]'" in err
    assert "Traceback" not in err and not (tmp_path / "plots").exists()
