"""The GPU cost model fitted to a measured run: efficiencies and host overheads from figures.

A measurement file (JSON; `src/kvpool/sim/data/` holds the shipped ones, named in
`SHIPPED`) names a GPU preset, a model preset and the weight and KV formats, and lists
measured figures. The cost model (sim/cost.py) predicts each one, with ce / be the compute /
bandwidth efficiency, P the GPU's dense peak at bf16 and B its HBM bandwidth:

    gemm    (m, k, n; TFLOP/s)  2mkn / t,  t = max(2mkn / (P x ce), 2 (mk + kn + mn) / (B x be))
                                (bf16 operands read once, the bf16 result written once)
    copy    (TB/s)              B x be     (bytes read + bytes written per second)
    decode  (batch, context_len, host_mode; ms)  CostModel.step_time of `batch` decodes
                                over context_len tokens each (a step of (1, context_len) chunks)
    prefill (tokens, host_mode; ms)  CostModel.step_time of one fresh chunk of `tokens`

A layer's fixed GPU time (`layer_fixed_s`, cost.py) stays at the GPU preset's in the fit:
in one model's steps it and the per-step host overhead are the same constant (num_layers x
layer_fixed_s + step_overhead_s), so no set of one model's figures can tell them apart.
The preset's figure comes from this file's own batch-1 CUDA-graph decode, a bare forward
whose host does nothing but launch the graph (`derive_layer_fixed_s`):

    layer_fixed_s = (t_decode(batch 1, graph) - bytes / copy_bandwidth) / num_layers

with bytes the step's weight and KV bytes (CostModel.step_cost) and copy_bandwidth the
file's measured device copy: the most a batch-1 GEMV streams. The fit then puts what the
bare forward spends per step on the host in step_overhead_s (a few tens of microseconds).

The fit is the theta = (ce, be, step_overhead_s, layer_launch_s) that minimises

    sum_i log(predicted_i(theta) / measured_i)^2

(relative errors: a 5 ms decode weighs as much as a 200 ms prefill) with ce, be in (0, 1]
and the overheads >= 0, by Levenberg-Marquardt over a central-difference Jacobian, projected
onto those bounds, from the cuda defaults (`DEVICE_DEFAULTS["cuda"]`). With four parameters
and, in the shipped H200 file, six figures, the fit is a compromise where the figures
disagree (a large GEMM alone reaches a higher fraction of the peak than a whole prefill
step); `GPUFit.rows` says, figure by figure, the predicted / measured ratio with the defaults
("before") and with the fit ("after").

    python3 -m kvpool.sim.calibrate --fit h200-issue31      (or --fit FILE.json; --json)
    kvpool simulate --calibration h200-issue31 ...          (the fit's four parameters)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

from kvpool.sim.cost import DEVICE_DEFAULTS, HOST_MODES, CostModel
from kvpool.spec.gpus import GPUSpec, get_gpu
from kvpool.spec.models import ModelSpec, load_preset

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
# The measurement files shipped with kvpool, by the name --calibration and --fit take.
SHIPPED: dict[str, str] = {"h200-issue31": "h200_issue31.json"}
KINDS: dict[str, tuple[str, ...]] = {  # each kind's fields beyond name, kind, value, unit
    "gemm": ("m", "k", "n"),
    "copy": (),
    "decode": ("batch", "context_len", "host_mode"),
    "prefill": ("tokens", "host_mode"),
}
UNITS: dict[str, str] = {"gemm": "TFLOP/s", "copy": "TB/s", "decode": "ms", "prefill": "ms"}
PARAMS: tuple[str, ...] = ("compute_efficiency", "bandwidth_efficiency", "step_overhead_s", "layer_launch_s")


@dataclass(frozen=True)
class Measurement:
    name: str
    kind: str  # a key of KINDS
    value: float  # in UNITS[kind]
    shape: dict  # the kind's fields (KINDS)


@dataclass(frozen=True)
class MeasuredRun:
    """One measurement file: where it was measured, on what, and its figures."""

    name: str
    gpu: GPUSpec
    model: ModelSpec
    weight_dtype: str
    kv_dtype: str
    measurements: tuple[Measurement, ...]
    source: str = ""


@dataclass(frozen=True)
class FitRow:
    name: str
    unit: str
    measured: float
    before: float  # predicted with the cuda defaults
    after: float  # predicted with the fit

    @property
    def ratio_before(self) -> float:
        return self.before / self.measured

    @property
    def ratio_after(self) -> float:
        return self.after / self.measured


@dataclass(frozen=True)
class GPUFit:
    """The fitted parameters of one measured run, and each figure's prediction before / after."""

    run: MeasuredRun
    compute_efficiency: float
    bandwidth_efficiency: float
    step_overhead_s: float
    layer_launch_s: float
    rows: tuple[FitRow, ...]

    def overrides(self) -> dict[str, float]:
        """CostModel keyword arguments: the four fitted parameters."""
        return {p: getattr(self, p) for p in PARAMS}

    def to_json(self) -> dict:
        return {
            "calibration": self.run.name,
            "gpu": self.run.gpu.name,
            "model": self.run.model.name,
            "weight_dtype": self.run.weight_dtype,
            "kv_dtype": self.run.kv_dtype,
            **self.overrides(),
            "layer_fixed_s": self.run.gpu.layer_fixed_s,  # held at the GPU preset's, not fitted
            "defaults": {p: getattr(DEVICE_DEFAULTS["cuda"], p) for p in PARAMS},
            "rows": [
                {
                    "name": r.name,
                    "unit": r.unit,
                    "measured": r.measured,
                    "predicted_before": r.before,
                    "predicted_after": r.after,
                    "ratio_before": r.ratio_before,
                    "ratio_after": r.ratio_after,
                }
                for r in self.rows
            ],
        }


def calibration_path(name_or_path: str) -> str:
    """The file of a shipped calibration's name, or the path itself; ValueError naming the
    shipped names when it is neither."""
    if name_or_path in SHIPPED:
        return os.path.join(DATA_DIR, SHIPPED[name_or_path])
    if os.path.isfile(name_or_path):
        return name_or_path
    if os.path.isdir(name_or_path):  # (a directory is no calibration file: "no such file" misled)
        raise ValueError(
            f"calibration {name_or_path!r} is a directory: give a calibration file (JSON), not its directory"
        )
    raise ValueError(
        f"calibration {name_or_path!r}: no such file, and not a shipped calibration (shipped: {', '.join(SHIPPED)})"
    )


def load_run(name_or_path: str) -> MeasuredRun:
    """Read a measurement file (see the module docstring); ValueError naming the bad field."""
    path = calibration_path(name_or_path)
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    except UnicodeDecodeError as e:  # (its message named no file)
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    for key in ("gpu", "model", "measurements"):
        if key not in data:
            raise ValueError(f"{path}: missing {key!r}")
    # (a number or a list where a name belongs, a dict of measurements: AttributeError and
    # TypeError tracebacks from get_gpu, m.get and format_fit before these checks)
    for key in ("name", "gpu", "model", "weight_dtype", "kv_dtype", "source"):
        if key in data and not isinstance(data[key], str):
            raise ValueError(f"{path}: {key} must be a string, got {json.dumps(data[key])}")
    if not isinstance(data["measurements"], list):
        raise ValueError(f"{path}: measurements must be a list of objects, got {type(data['measurements']).__name__}")
    measurements = []
    for i, m in enumerate(data["measurements"]):
        where = f"{path}: measurement {i}"
        if not isinstance(m, dict):
            raise ValueError(f"{where}: expected a JSON object, got {json.dumps(m)}")
        if not isinstance(m.get("name", ""), str):
            raise ValueError(f"{where}: name must be a string, got {json.dumps(m['name'])}")
        kind = m.get("kind")
        if not isinstance(kind, str) or kind not in KINDS:  # (a list or an object: unhashable)
            raise ValueError(f"{where}: unknown kind {kind!r}; known: {', '.join(KINDS)}")
        missing = [k for k in ("value", *KINDS[kind]) if k not in m]
        if missing:
            raise ValueError(f"{where} ({kind}): missing {', '.join(missing)}")
        if m.get("unit", UNITS[kind]) != UNITS[kind]:
            raise ValueError(f"{where} ({kind}): unit must be {UNITS[kind]}, got {m['unit']!r}")
        value = m["value"]
        # (true was a value of 1; Infinity a "math domain error" from the fit's log-ratios)
        if type(value) not in (int, float) or not 0 < value < math.inf:
            raise ValueError(f"{where} ({kind}): value must be a finite positive number, got {json.dumps(value)}")
        shape = {k: m[k] for k in KINDS[kind]}
        for k, v in shape.items():
            if k == "host_mode":
                if v not in HOST_MODES:
                    raise ValueError(f"{where}: host_mode must be one of {', '.join(HOST_MODES)}, got {v!r}")
            elif not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{where}: {k} must be a positive integer, got {v!r}")
        measurements.append(Measurement(m.get("name", f"{kind} {i}"), kind, float(value), shape))
    if not measurements:
        raise ValueError(f"{path}: no measurements")
    return MeasuredRun(
        name=data.get("name", os.path.splitext(os.path.basename(path))[0]),
        gpu=get_gpu(data["gpu"]),
        model=load_preset(data["model"]),
        weight_dtype=data.get("weight_dtype", "auto"),
        kv_dtype=data.get("kv_dtype", "auto"),
        measurements=tuple(measurements),
        source=data.get("source", ""),
    )


def derive_layer_fixed_s(run: MeasuredRun) -> float:
    """A layer's fixed GPU time from `run`'s batch-1 CUDA-graph decode and its device copy
    (module docstring): what the decode takes beyond its bytes at the measured copy
    bandwidth, over the model's layers; ValueError when the run lacks either figure."""
    decodes = [
        m for m in run.measurements if m.kind == "decode" and m.shape["batch"] == 1 and m.shape["host_mode"] == "graph"
    ]
    copies = [m for m in run.measurements if m.kind == "copy"]
    if not decodes or not copies:
        raise ValueError(f"{run.name}: needs a batch-1 CUDA-graph decode and a device copy to derive layer_fixed_s")
    decode, copy = decodes[0], copies[0]
    cost = CostModel(run.model, run.gpu, weight_dtype=run.weight_dtype, kv_dtype=run.kv_dtype)
    step = cost.step_cost([(1, decode.shape["context_len"])])
    stream_s = (step.weight_bytes + step.kv_bytes) / (copy.value * 1e12)
    return (decode.value * 1e-3 - stream_s) / run.model.num_layers


def predict(m: Measurement, run: MeasuredRun, params: dict[str, float]) -> float:
    """The cost model's figure for `m` (in its unit) at `params` (PARAMS)."""
    gpu, ce, be = run.gpu, params["compute_efficiency"], params["bandwidth_efficiency"]
    if m.kind == "gemm":
        mm, k, n = m.shape["m"], m.shape["k"], m.shape["n"]
        flops = 2 * mm * k * n
        num_bytes = 2 * (mm * k + k * n + mm * n)  # bf16: both operands read, the result written
        seconds = max(flops / (gpu.peak_flops("bf16") * ce), num_bytes / (gpu.hbm_bandwidth_bytes_per_s * be))
        return flops / seconds / 1e12
    if m.kind == "copy":
        return gpu.hbm_bandwidth_bytes_per_s * be / 1e12
    cost = CostModel(
        run.model,
        gpu,
        weight_dtype=run.weight_dtype,
        kv_dtype=run.kv_dtype,
        host_mode=m.shape["host_mode"],
        **params,
    )
    if m.kind == "decode":
        chunks = [(1, m.shape["context_len"])] * m.shape["batch"]
    else:
        chunks = [(m.shape["tokens"], m.shape["tokens"])]
    return cost.step_time(chunks) * 1e3


# theta is solved in units of order 1: (ce, be, step overhead in ms, layer launch in 100 us)
_SCALE = np.array([1.0, 1.0, 1e-3, 1e-4])
_LOWER = np.array([1e-3, 1e-3, 0.0, 0.0])
_UPPER = np.array([1.0, 1.0, np.inf, np.inf])


def _params(x: np.ndarray) -> dict[str, float]:
    return {p: float(v) for p, v in zip(PARAMS, x * _SCALE, strict=True)}


def _residuals(x: np.ndarray, run: MeasuredRun) -> np.ndarray:
    params = _params(x)
    return np.array([math.log(predict(m, run, params) / m.value) for m in run.measurements])


def fit_gpu(run: MeasuredRun, max_iterations: int = 200) -> GPUFit:
    """Levenberg-Marquardt on the log-ratio residuals (module docstring), from the cuda defaults."""
    defaults = DEVICE_DEFAULTS["cuda"]
    x = np.array([getattr(defaults, p) for p in PARAMS]) / _SCALE
    r = _residuals(x, run)
    cost, damping = float(r @ r), 1e-3
    for _ in range(max_iterations):
        jac = np.empty((len(r), len(x)))
        for j in range(len(x)):
            h = 1e-6 * max(1.0, abs(x[j]))
            up, down = x.copy(), x.copy()
            up[j] = min(x[j] + h, _UPPER[j])
            down[j] = max(x[j] - h, _LOWER[j])
            jac[:, j] = (_residuals(up, run) - _residuals(down, run)) / (up[j] - down[j])
        jtj, jtr = jac.T @ jac, jac.T @ r
        improved = False
        while damping < 1e12:
            step = np.linalg.solve(jtj + damping * np.diag(np.diag(jtj) + 1e-12), -jtr)
            candidate = np.clip(x + step, _LOWER, _UPPER)
            r_new = _residuals(candidate, run)
            cost_new = float(r_new @ r_new)
            if cost_new < cost:
                small = np.allclose(candidate, x, rtol=1e-12, atol=1e-14)
                converged = small or cost - cost_new <= 1e-15 * max(cost, 1e-30)
                x, r, cost, damping, improved = candidate, r_new, cost_new, max(damping / 10, 1e-12), True
                break
            damping *= 10
        if not improved or converged:
            break
    fitted = _params(x)
    before = {p: getattr(defaults, p) for p in PARAMS}
    rows = tuple(
        FitRow(m.name, UNITS[m.kind], m.value, predict(m, run, before), predict(m, run, fitted))
        for m in run.measurements
    )
    return GPUFit(run, *(fitted[p] for p in PARAMS), rows=rows)


def load_fit(name_or_path: str) -> GPUFit:
    """`fit_gpu` of a shipped calibration's name or a measurement file."""
    return fit_gpu(load_run(name_or_path))


def format_fit(fit: GPUFit) -> str:
    """The fit as text: the parameters before and after, then each figure's ratios."""
    run, defaults = fit.run, DEVICE_DEFAULTS["cuda"]
    lines = [
        f"calibration {run.name}: {run.model.name} on {run.gpu.name}, weights {run.weight_dtype}, KV {run.kv_dtype}",
        f"  compute efficiency    {defaults.compute_efficiency:.3f} -> {fit.compute_efficiency:.3f}",
        f"  bandwidth efficiency  {defaults.bandwidth_efficiency:.3f} -> {fit.bandwidth_efficiency:.3f}",
        f"  host, per step        {defaults.step_overhead_s * 1e3:.3f} -> {fit.step_overhead_s * 1e3:.3f} ms",
        f"  host, per layer eager {defaults.layer_launch_s * 1e6:.1f} -> {fit.layer_launch_s * 1e6:.1f} us",
        f"  GPU, per layer fixed  {run.gpu.layer_fixed_s * 1e6:.1f} us, held (the GPU preset's)",
        "",
        f"  {'figure':<30} {'measured':>10} {'before':>10} {'ratio':>6} {'after':>10} {'ratio':>6}",
    ]
    for r in fit.rows:
        lines.append(
            f"  {r.name:<30} {r.measured:>10.2f} {r.before:>10.2f} {r.ratio_before:>6.3f} "
            f"{r.after:>10.2f} {r.ratio_after:>6.3f}  {r.unit}"
        )
    return "\n".join(lines)
