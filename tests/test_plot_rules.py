"""The rules every plot keeps (sim/plots.py): the file type from the name's extension (one
that matplotlib cannot write refused in one line), rates and shares on axes from 0, the SLO
bounds drawn on the latency CDFs, values written on the bars, legends outside the axes."""

import pytest

from kvpool.cli.main import main
from kvpool.sim import plots


def _run_report(layout: str, goodput: float, ttft_ms: list[float]) -> dict:
    return {
        "model": "m",
        "gpu": "g",
        "layout": layout,
        "replicas": 1,
        "tp": 1,
        "routing": "round_robin",
        "block_size": 16,
        "slo_ttft_ms": 200.0,
        "slo_tpot_ms": 25.0,
        "peak_running": 12,
        "goodput_req_s": goodput,
        "prefix_hit_rate": 0.25,
        "ttft_ms_p99": max(ttft_ms),
        "throughput_tok_s": 900.0,
        "_series": {"ttft_ms": ttft_ms, "tpot_ms": [10.0, 20.0, 30.0], "occupancy": [[(0.0, 0.2), (1.0, 0.6)]]},
    }


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot functions save, kept to be read back."""
    figures = {}
    save = plots.save_figure

    def keep(fig, path):
        figures[path.rsplit("/", 1)[-1]] = fig
        return save(fig, path)

    monkeypatch.setattr(plots, "save_figure", keep)
    return figures


def _legends_cover_no_axes(fig) -> bool:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # saved and closed: drawn again as it was laid out
    canvas.draw()
    renderer = canvas.get_renderer()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends
    return not any(
        legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
        for legend in legends
        for ax in fig.axes
    )


def test_the_extension_names_the_type_and_a_type_matplotlib_cannot_write_is_refused(tmp_path, capsys):
    with pytest.raises(
        ValueError, match=r"^--plot kv.txt: matplotlib cannot write .txt files; name a .png, .svg or .pdf"
    ):
        plots.check_plot_format("--plot", "kv.txt")
    with pytest.raises(ValueError, match=r"^--plot kv: no file extension to take the type from"):
        plots.check_plot_format("--plot", "kv")
    for name in ("kv.png", "kv.SVG", "kv.pdf"):
        plots.check_plot_format("--plot", name)
    target = tmp_path / "kv.txt"
    assert main(["plan", "--plot", str(target), "--plot-models", "llama-3.1-8b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvpool plan: error: --plot {target}: matplotlib cannot write .txt") and err.count("\n") == 1
    assert not target.exists()
    svg = tmp_path / "kv.svg"
    assert main(["plan", "--plot", str(svg), "--plot-models", "llama-3.1-8b"]) == 0
    head = svg.read_text()[:400]
    assert head.startswith("<?xml") and "<svg" in head


def test_latency_cdfs_start_at_0_and_draw_the_slos_and_the_legend_covers_nothing(tmp_path, drawn):
    reports = [_run_report("paged", 3.5, [50.0, 120.0, 400.0]), _run_report("contiguous", 1.25, [80.0, 300.0, 900.0])]
    paths = plots.plot_runs(reports, str(tmp_path))
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["latency_cdf.png", "kv_occupancy.png", "comparison.png"]
    cdf = drawn["latency_cdf.png"]
    for ax, name, slo in zip(cdf.axes, ("TTFT", "TPOT"), (200.0, 25.0), strict=True):
        assert ax.get_ylim()[0] == 0  # a share of the requests
        slo_lines = [line for line in ax.get_lines() if list(line.get_xdata()) == [slo, slo]]
        assert len(slo_lines) == 1 and slo_lines[0].get_label() == f"{name} SLO {slo:g} ms"
    legend = [t.get_text() for t in cdf.axes[1].get_legend().get_texts()]
    assert legend == ["paged, block 16", "contiguous, 16 tokens a request", "TTFT SLO 200 ms", "TPOT SLO 25 ms"]
    assert _legends_cover_no_axes(cdf) and _legends_cover_no_axes(drawn["kv_occupancy.png"])
    assert drawn["kv_occupancy.png"].axes[0].get_ylim()[0] == 0
    bars = drawn["comparison.png"].axes
    assert [ax.get_title() for ax in bars][:2] == ["peak concurrent requests", "goodput (req/s within SLO)"]
    assert all(ax.get_ylim()[0] == 0 for ax in bars)
    assert [t.get_text() for t in bars[1].texts] == ["3.5", "1.25"]  # the values, written on the bars
    assert [t.get_text() for t in bars[3].texts] == ["400", "900"]


def test_goodput_against_rate_from_0_on_both_axes(tmp_path, drawn):
    rows = [
        {**_run_report("paged", g, [1.0]), "request_rate": rate} for rate, g in (("2", 1.9), ("4", 3.2), ("inf", 3.0))
    ]
    plots.plot_sweep(rows, str(tmp_path))
    ax = drawn["goodput_vs_rate.png"].axes[0]
    assert ax.get_xlim()[0] == 0 and ax.get_ylim()[0] == 0
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [2.0, 4.0] and list(line.get_ydata()) == [1.9, 3.2]  # "inf" has no rate
    assert _legends_cover_no_axes(drawn["goodput_vs_rate.png"])
    # per GPU: a second deployment of 2 GPUs serves 4.0 req/s at rate 4, 2.0 a GPU
    rows.append({**_run_report("paged", 4.0, [1.0]), "tp": 2, "request_rate": "4"})
    plots.plot_sweep(rows, str(tmp_path))
    per_gpu = drawn["goodput_per_gpu_vs_rate.png"].axes[0]
    assert per_gpu.get_ylim()[0] == 0 and per_gpu.get_xlim()[0] == 0
    lines = {ln.get_label(): list(zip(ln.get_xdata(), ln.get_ydata(), strict=True)) for ln in per_gpu.get_lines()}
    assert lines == {"1 g, paged, block 16": [(2.0, 1.9), (4.0, 3.2)], "2 g (1 x TP 2), paged, block 16": [(4.0, 2.0)]}
