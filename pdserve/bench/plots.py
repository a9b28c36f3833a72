"""PNG plots of ``pdserve bench`` results (matplotlib, the ``bench`` extra, imported lazily).

:func:`write_plots` writes into ``plot_dir`` (created if missing):

- ``latency_cdf.png``: the empirical CDFs of TTFT, TPOT, ITL and E2E (one panel each, one line per pass);
- for a sweep of request rates (two passes or more at finite rates), ``throughput_vs_rate.png`` (request and
  output token throughput against the offered request rate, side by side) and ``goodput_vs_rate.png``.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend switch).
"""

from __future__ import annotations

import os

from pdserve.bench.report import LATENCY_KEYS, load_label

INSTALL_HINT = "plots need matplotlib: pip install 'pdserve[bench]'"


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(plot_dir: str, runs: list[dict], samples_ms: list[dict[str, list[float]]]) -> list[str]:
    """Write the plots of ``runs`` (summaries) with their latency samples (one dict per run, by latency key).

    Returns the paths written. Raises ImportError with :data:`INSTALL_HINT` when matplotlib is missing.
    """
    if len(runs) != len(samples_ms):
        raise ValueError(f"{len(runs)} runs but {len(samples_ms)} sets of samples")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    os.makedirs(plot_dir, exist_ok=True)
    paths = []

    fig = Figure(figsize=(11, 8), layout="constrained")
    for ax, key in zip(fig.subplots(2, 2).flat, LATENCY_KEYS):
        for run, samples in zip(runs, samples_ms):
            values = sorted(samples[key])
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                        label=load_label(run))
        ax.set_title(f"{key.removesuffix('_ms').upper()} CDF")
        ax.set_xlabel("milliseconds")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    paths.append(_save(FigureCanvasAgg, fig, plot_dir, "latency_cdf.png"))

    swept = [run for run in runs if isinstance(run["request_rate"], (int, float))]
    if len(swept) >= 2:
        rates = [run["request_rate"] for run in swept]
        fig = Figure(figsize=(11, 4.5), layout="constrained")
        fig.suptitle("Throughput against offered request rate")
        for ax, key, ylabel in zip(fig.subplots(1, 2), ("request_throughput", "output_throughput"),
                                   ("completed requests/s", "output tokens/s")):
            ax.plot(rates, [run[key] for run in swept], marker="o")
            ax.set_xlabel("offered request rate (requests/s)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        paths.append(_save(FigureCanvasAgg, fig, plot_dir, "throughput_vs_rate.png"))

        fig = Figure(figsize=(7, 5), layout="constrained")
        ax = fig.subplots()
        ax.plot(rates, [run["goodput"] for run in swept], marker="o", label="goodput")
        ax.plot(rates, [run["request_throughput"] for run in swept], marker=".", linestyle="--",
                label="request throughput")
        ax.set_xlabel("offered request rate (requests/s)")
        ax.set_ylabel("requests/s")
        ax.set_title("Goodput (requests/s meeting the SLOs) against request rate")
        ax.grid(alpha=0.3)
        ax.legend()
        paths.append(_save(FigureCanvasAgg, fig, plot_dir, "goodput_vs_rate.png"))
    return paths


def _save(canvas_cls, fig, plot_dir: str, name: str) -> str:
    path = os.path.join(plot_dir, name)
    canvas_cls(fig).print_png(path)
    return path
