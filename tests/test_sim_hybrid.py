"""The simulator on the hybrid coordinator: models with sliding-window layers (gpt-oss-120b:
18 full + 18 window-128 layers; Gemma-2-9B: 21 + 21, window 4096) get a full group and a
window group drawing pages of half the layers from one shared pool, so a long request
holds about W tokens of window blocks, and the pool fits more long requests than one
full-attention manager whose block holds every layer for the whole context."""

from __future__ import annotations

from kvpool.cli.main import main
from kvpool.sim.cost import CostModel
from kvpool.sim.simulator import SimConfig, simulate
from kvpool.spec.gpus import get_gpu
from kvpool.spec.models import load_preset
from kvpool.workload.sessions import uniform_workload


def _simulate(model_name: str, workload, **config) -> dict:
    model, gpu = load_preset(model_name), get_gpu("h200")
    cfg = SimConfig(**config)
    return simulate(model, gpu, workload, cfg, CostModel(model, gpu, tp=cfg.tp))


def test_a_window_group_holds_the_window_and_the_shared_pool_fits_more_long_requests():
    wl = uniform_workload(120, float("inf"), 201_088, seed=0, prompt_len=(30_000, 32_000), output_len=(200, 400))
    hybrid = _simulate("gpt-oss-120b", wl)  # the default layout of a windowed model
    paged = _simulate("gpt-oss-120b", wl, layout="paged")
    assert (hybrid["layout"], paged["layout"]) == ("hybrid", "paged")
    # One pool: a page holds half the layers, so twice the pages of the same bytes.
    assert hybrid["kv_pool_bytes"] == paged["kv_pool_bytes"]
    assert 2 * hybrid["block_bytes"] == paged["block_bytes"] and hybrid["num_blocks"] == 2 * paged["num_blocks"]
    # Measured from the pool: a running request holds about W = 128 tokens of window blocks
    # (W / 16 = 8 blocks, one more when the window straddles a block boundary, one for the
    # step's position), while the full group holds its whole context (~31k tokens: ~1,950).
    per_request = hybrid["group_blocks_per_request"]
    assert 8 <= per_request["sliding-128"] <= 10, per_request
    assert per_request["full"] > 100 * per_request["sliding-128"]
    # So about twice the long requests run at once, with fewer preemptions; all finish.
    assert hybrid["peak_running"] >= 1.8 * paged["peak_running"], (hybrid["peak_running"], paged["peak_running"])
    assert hybrid["preemptions"] < paged["preemptions"]
    assert hybrid["num_finished"] == paged["num_finished"] == 120
    assert "group_blocks_per_request" not in paged


def test_gemma2_at_its_full_context_holds_half_the_window_layers():
    # 8k-token requests, window 4096: a request holds ~8k / 16 full blocks and ~4k / 16
    # window blocks, 3/4 of what uniform paging holds, so about 4/3 of the requests fit.
    wl = uniform_workload(200, float("inf"), 256_000, seed=1, prompt_len=(7000, 7800), output_len=(100, 300))
    hybrid = _simulate("gemma-2-9b", wl)
    paged = _simulate("gemma-2-9b", wl, layout="paged")
    per_request = hybrid["group_blocks_per_request"]
    assert 4096 / 16 * 0.8 <= per_request["sliding-4096"] <= 4096 / 16 + 2, per_request
    assert hybrid["peak_running"] >= 1.2 * paged["peak_running"], (hybrid["peak_running"], paged["peak_running"])


def test_the_hybrid_layout_is_refused_in_one_line_for_a_model_without_windows(capsys):
    assert main(["simulate", "--requests", "4", "--model", "llama-3.1-8b", "--layout", "hybrid"]) == 2
    err = capsys.readouterr().err
    assert "layout 'hybrid' is for models with sliding-window layers" in err and len(err.strip().splitlines()) == 1
