"""PNG plots of a run (matplotlib, Agg backend, imported only when --plot is given).

matplotlib is optional (``pip install 'xpyd[plot]'``): ``check_available`` is called with the other
argument checks, so a missing matplotlib is a bad argument (exit 2) before any load is sent.

- ``latency_cdf.png``: empirical CDFs of TTFT, ITL and E2E, one line per request class;
- ``itl_over_time.png``: every ITL gap at the time its chunk arrived, one colour per class, with the
  send times of long prompts (prefill-stall) as vertical lines: a stall shows up as a column of high
  gaps right after a long prompt arrives.
"""

from __future__ import annotations

from pathlib import Path

from xpyd.bench.client import RequestResult
from xpyd.bench.workload import LABEL_LONG

FILES = ("latency_cdf.png", "itl_over_time.png")
INSTALL_HINT = "pip install 'xpyd[plot]'"


def check_available() -> None:
    """Raises ValueError (naming the install command) if matplotlib cannot be imported."""
    try:
        _import_pyplot()
    except ImportError as e:
        raise ValueError(f"--plot needs matplotlib, which cannot be imported ({e}): {INSTALL_HINT}") from None


def _import_pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _by_class(results: list[RequestResult]) -> dict[str, list[RequestResult]]:
    out: dict[str, list[RequestResult]] = {}
    for r in results:
        if r.ok:
            out.setdefault(r.label, []).append(r)
    return out


def _cdf(ax, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    xs = sorted(values_ms)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def write_plots(results: list[RequestResult], start: float, out_dir: Path, title: str) -> list[Path]:
    """Writes the PNGs into ``out_dir`` (created) and returns their paths (``check_available`` first)."""
    plt = _import_pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = _by_class(results)
    paths = [out_dir / name for name in FILES]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (name, fn) in zip(axes, (
        ("TTFT", lambda r: [(r.chunk_times[0] - r.send_time) * 1e3]),
        ("ITL (per chunk)", lambda r: [(b - a) * 1e3 for a, b in zip(r.chunk_times, r.chunk_times[1:])]),
        ("E2E", lambda r: [(r.end_time - r.send_time) * 1e3]),
    )):
        for label, rs in groups.items():
            _cdf(ax, [v for r in rs for v in fn(r)], label)
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(True, alpha=0.3)
        if groups:
            ax.legend(loc="lower right", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(12, 4.5))
    for label, rs in groups.items():
        xs = [t - start for r in rs for t in r.chunk_times[1:]]
        ys = [(b - a) * 1e3 for r in rs for a, b in zip(r.chunk_times, r.chunk_times[1:])]
        ax.scatter(xs, ys, s=4, alpha=0.6, label=f"{label} ({len(ys)} gaps)")
    long_sends = [r.send_time - start for r in results if r.label == LABEL_LONG]
    for i, t in enumerate(long_sends):
        ax.axvline(t, color="grey", linestyle=":", linewidth=0.8, label="long prompt sent" if i == 0 else None)
    ax.set_title(f"ITL over time - {title}")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("gap to previous chunk (ms)")
    ax.grid(True, alpha=0.3)
    if groups or long_sends:
        ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths
