"""Plots of simulator runs (matplotlib, no display): latency CDFs with the SLO bounds, KV
occupancy over time, a comparison chart of several runs (values written on the bars), and
goodput (and goodput per GPU) against rate for a sweep. The rules every kvpool plot keeps: an axis that shows a
rate or a share starts at 0; legends sit outside the axes, so they cover no data; a file's
type is its name's extension (`check_plot_format` refuses one matplotlib cannot write)."""

from __future__ import annotations

import os
from collections import defaultdict


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(report: dict) -> str:
    parts = [report["layout"]]
    if report.get("replicas", 1) > 1:
        parts.append(report["routing"])
    if report["layout"] == "contiguous":  # its "block" is one request's reservation, max_model_len tokens
        parts.append(f"{report['block_size']} tokens a request")
    else:
        parts.append(f"block {report['block_size']}")
    return ", ".join(parts)


def _legend_outside(ax, fontsize: int = 8) -> None:
    """The legend right of the axes, top-aligned: it covers no curve (save_figure keeps it
    inside the image by cropping to the drawn content)."""
    ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def plot_runs(reports: list[dict], directory: str) -> list[str]:
    """latency_cdf.png, kv_occupancy.png and, for several runs, comparison.png."""
    plt = _pyplot()
    os.makedirs(directory, exist_ok=True)
    paths = []
    title = f"{reports[0]['model']} on {reports[0]['gpu']}"

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in reports:
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms"), strict=True):
            values = r["_series"][key]
            if values:
                n = len(values)
                ax.plot(values, [(i + 1) / n for i in range(n)], label=_label(r))
    for ax, name, slo_key in zip(axes, ("TTFT", "TPOT"), ("slo_ttft_ms", "slo_tpot_ms"), strict=True):
        slo_ms = reports[0][slo_key]  # a comparison shares its SLOs
        ax.axvline(slo_ms, color="black", linestyle=":", linewidth=1.2, label=f"{name} SLO {slo_ms:g} ms")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)  # a share of the requests: from 0
        ax.set_xlabel(f"{name} (ms, virtual time)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    # one legend: both panels draw the same runs; each panel adds its SLO line (drawn last)
    handles, labels = axes[0].get_legend_handles_labels()
    tpot_handles, tpot_labels = axes[1].get_legend_handles_labels()
    axes[1].legend(
        [*handles, tpot_handles[-1]],
        [*labels, tpot_labels[-1]],
        fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        borderaxespad=0.0,
    )
    fig.suptitle(f"latency CDFs: {title}")
    paths.append(save_png(fig, directory, "latency_cdf.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    top = 0.0
    for r in reports:
        series_list = r["_series"]["occupancy"]
        # one run: every replica; several: replica 0 of each (a readable chart)
        shown = series_list if len(reports) == 1 else series_list[:1]
        for i, series in enumerate(shown):
            if series:
                ts, used = zip(*series, strict=True)
                suffix = f" / replica {i} of {len(series_list)}" if len(series_list) > 1 else ""
                ax.plot(ts, [100 * u for u in used], label=_label(r) + suffix, linewidth=1)
                top = max(top, 100 * max(used))
    ax.set_xlabel("time (s, virtual)")
    ax.set_ylabel("KV blocks held (% of the pool)")
    ax.set_ylim(0, min(105.0, max(1.0, top * 1.1)))
    ax.grid(alpha=0.3)
    _legend_outside(ax, fontsize=7)
    ax.set_title(f"KV occupancy: {title}")
    paths.append(save_png(fig, directory, "kv_occupancy.png"))

    if len(reports) > 1:
        metrics = [
            ("peak_running", "peak concurrent requests"),
            ("goodput_req_s", "goodput (req/s within SLO)"),
            ("prefix_hit_rate", "prefix hit rate"),
            ("ttft_ms_p99", "TTFT p99 (ms)"),
        ]
        if not any(r["prefix_hit_rate"] for r in reports):  # nothing shared: show throughput instead
            metrics[2] = ("throughput_tok_s", "throughput (tokens/s)")
        fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 4))
        labels = [_label(r) for r in reports]
        for ax, (key, name) in zip(axes, metrics, strict=True):
            values = [r[key] for r in reports]
            bars = ax.bar(range(len(reports)), values, color=[f"C{i}" for i in range(len(reports))])
            ax.bar_label(bars, fmt="%.3g", fontsize=8, padding=2)
            ax.set_ylim(0, max(max(values), 1e-9) * 1.15)  # from 0, with room for the values above the bars
            ax.set_xticks(range(len(reports)), labels, rotation=20, ha="right", fontsize=8)
            ax.set_title(name, fontsize=10)
            ax.grid(axis="y", alpha=0.3)
        fig.suptitle(f"compared: {title}")
        paths.append(save_png(fig, directory, "comparison.png"))
    return paths


def _deployment_label(row: dict, varying: tuple[str, ...]) -> str:
    """What tells a sweep's lines apart beyond the layout: the model, the GPU, the TP and the
    replicas, those of them the rows differ in."""
    parts = [row["model"]] if "model" in varying else []
    if {"gpu", "tp", "replicas"} & set(varying):
        gpus = row["replicas"] * row["tp"]
        split = f" ({row['replicas']} x TP {row['tp']})" if gpus > 1 else ""
        parts.append(f"{gpus} {row['gpu']}{split}")
    return ", ".join([*parts, _label(row)])


def rateless(rows: list[dict]) -> list[dict]:
    """The rows a goodput-vs-rate plot has no x for: rate inf (every session at once) and a
    trace's (its own arrival times). plot_sweep leaves them off; the caller says which."""
    return [r for r in rows if r["request_rate"] in ("inf", "trace")]


def plot_sweep(rows: list[dict], directory: str) -> list[str]:
    """goodput_vs_rate.png and goodput_per_gpu_vs_rate.png: one line per deployment (model,
    GPUs, TP, where the rows differ in them) and (layout, block size, routing). The
    `rateless` rows are left off."""
    plt = _pyplot()
    os.makedirs(directory, exist_ok=True)
    varying = tuple(k for k in ("model", "gpu", "tp", "replicas") if len({r[k] for r in rows}) > 1)
    lines: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    left_off = {id(r) for r in rateless(rows)}
    for r in rows:
        if id(r) in left_off:  # all at once, or a trace's own times: no rate to plot
            continue
        rate = float(r["request_rate"])
        lines[_deployment_label(r, varying)].append((rate, r["goodput_req_s"], r["replicas"] * r["tp"]))
    if varying:
        title = "goodput vs rate"
    else:
        title = f"goodput vs rate: {rows[0]['model']} on {rows[0]['gpu']}"
    paths = []
    for name, per_gpu in (("goodput_vs_rate.png", False), ("goodput_per_gpu_vs_rate.png", True)):
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, points in sorted(lines.items()):
            points = sorted(points)
            if points:
                xs = [rate for rate, _, _ in points]
                ys = [goodput / gpus if per_gpu else goodput for _, goodput, gpus in points]
                ax.plot(xs, ys, marker="o", label=label)
        ax.set_xlabel("arrival rate (sessions / s)")
        ax.set_ylabel("goodput per GPU (requests / s)" if per_gpu else "goodput (requests / s within SLO)")
        ax.set_xlim(left=0)  # both rates: from 0
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        _legend_outside(ax)
        ax.set_title(title.replace("goodput", "goodput per GPU", 1) if per_gpu else title)
        paths.append(save_png(fig, directory, name))
    return paths


def check_plot_format(flag: str, path: str) -> None:
    """ValueError in one line when matplotlib cannot write the file type named by `path`'s
    extension (`--plot kv.txt`), before any work is spent."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    ext = os.path.splitext(path)[1].lower().lstrip(".")
    supported = FigureCanvasAgg.get_supported_filetypes()
    if ext not in supported:
        named = f"matplotlib cannot write .{ext} files" if ext else "no file extension to take the type from"
        raise ValueError(f"{flag} {path}: {named}; name a .png, .svg or .pdf file (or {', '.join(sorted(supported))})")


def save_figure(fig, path: str) -> str:
    """Write `fig` to `path`, the type taken from its extension, atomically: drawn under a
    temporary name beside it, then renamed, so an interrupted or failed save leaves the
    previous image or none, never half. Cropped to what is drawn, legends outside the axes
    included."""
    import matplotlib.pyplot as plt

    directory, name = os.path.split(os.path.abspath(path))
    ext = os.path.splitext(name)[1].lower().lstrip(".")
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    try:
        fig.tight_layout()
        fig.savefig(tmp, dpi=110, format=ext, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def save_png(fig, directory: str, name: str) -> str:
    """save_figure into `directory` (the simulator's plots keep fixed .png names)."""
    return save_figure(fig, os.path.join(directory, name))
