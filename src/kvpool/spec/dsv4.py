"""The DeepSeek-V4 attention and cache spec, loaded from a V4 config.json.

Every V4 fact kvpool uses comes from here: one attention kind per layer (SWA-only, CSA,
HCA), the compression ratios m (CSA) and m' (HCA), the SWA window, the classical block
span (a multiple of lcm(m, m')), and the byte accounting of both pools. See
shared/design/DEEPSEEK_V4.md sections 1, 3 and 5.

Layer kinds follow the official reference code: ratio 0 is sliding-window only; ratio 4 is
CSA (overlapping compressor, coff = 2, plus the Lightning Indexer); any other non-zero
ratio is HCA (non-overlapping compressor, no indexer). `compress_ratios` carries one entry
per layer plus trailing entries for the MTP block(s) (`num_nextn_predict_layers`, 1 when
absent); those are kept as `mtp_kinds`.

Byte accounting, two families of formats:
- "serving": the vLLM / SGLang layouts. A main entry (SWA, CSA, HCA alike) stores the
  head_dim - rope dims in FP8, the rope dims in BF16 and one ue8m0 scale byte per 64 FP8
  values padded to 8 bytes: 448 + 128 + 8 = 584 B for V4. An indexer key is "fp8"
  (index_head_dim bytes + one fp32 scale per 128 values = 132 B) or "mxfp4"
  (index_head_dim / 2 bytes + one scale byte per 32 values = 68 B).
- a storage dtype ("float32", "bfloat16", ...): head_dim (index_head_dim) elements of that
  dtype, which is what kvpool's own torch pools hold.
The compressor state is fp32 in every format (the compressor math is fp32).

MTP: the trailing MTP layer is SWA-only, so it adds nothing to the classical pool; its SWA
window is counted in the state only with `include_mtp=True`. The default (False) counts
the `num_hidden_layers` main layers, which is what DEEPSEEK_V4.md section 5 quotes
(SWA state ~3.2 MB for Flash = 128 x 584 B x 43 layers).
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from importlib import resources
from typing import Any

from kvpool.spec.layout import dtype_bytes

# The ratio the reference code ties to the overlapping compressor and the indexer.
CSA_RATIO = 4

# Keys a V4 config.json must carry (DEEPSEEK_V4.md section 1).
REQUIRED_KEYS: tuple[str, ...] = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "sliding_window",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "rope_theta",
    "compress_rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "rms_norm_eps",
    "compress_ratios",
)

PRESET_NAMES: tuple[str, ...] = ("deepseek-v4-flash", "deepseek-v4-pro")

SERVING = "serving"


class LayerKind(enum.Enum):
    SWA = "swa"  # sliding window only (ratio 0)
    CSA = "csa"  # compressed sparse attention: ratio 4, overlap, Lightning Indexer top-k
    HCA = "hca"  # heavily compressed attention: ratio m', dense over all visible entries


@dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency scaling of the compressed layers' RoPE (frequencies only)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class DSV4Spec:
    """One DeepSeek-V4 model's attention / cache geometry. Build with `from_config`."""

    name: str
    num_layers: int  # num_hidden_layers (main layers; MTP excluded)
    hidden_size: int
    num_heads: int
    head_dim: int
    rope_head_dim: int  # RoPE on the LAST rope_head_dim dims
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int  # sliding_window = n_win
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnScaling | None
    max_position_embeddings: int
    rms_norm_eps: float
    compress_ratios: tuple[int, ...]  # num_layers main entries + trailing MTP entries
    vocab_size: int | None = None
    block_span: int | None = None  # tokens per classical block; None = lcm(m, m')

    def __post_init__(self) -> None:
        positive = (
            "num_layers",
            "hidden_size",
            "num_heads",
            "head_dim",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "window",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "rope_head_dim",
            "max_position_embeddings",
        )
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if not 0 < self.rope_head_dim <= self.head_dim or self.rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim must be even and in (0, head_dim={self.head_dim}], got {self.rope_head_dim}"
            )
        if self.rope_head_dim > self.index_head_dim:
            raise ValueError(f"qk_rope_head_dim={self.rope_head_dim} exceeds index_head_dim={self.index_head_dim}")
        if self.num_heads % self.o_groups:
            raise ValueError(f"num_attention_heads={self.num_heads} is not divisible by o_groups={self.o_groups}")
        if len(self.compress_ratios) < self.num_layers:
            raise ValueError(
                f"compress_ratios has {len(self.compress_ratios)} entries, "
                f"need num_hidden_layers={self.num_layers} (+ MTP)"
            )
        for i, ratio in enumerate(self.compress_ratios):
            if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio < 0:  # (true read as ratio 1)
                raise ValueError(f"compress_ratios[{i}] must be a non-negative integer, got {ratio!r}")
        hca_ratios = {r for r in self.compress_ratios if r not in (0, CSA_RATIO)}
        if len(hca_ratios) > 1:
            raise ValueError(f"compress_ratios mixes several HCA ratios {sorted(hca_ratios)}; V4 has one m'")
        if self.block_span is not None:
            if self.block_span <= 0 or self.block_span % self.lcm_ratio:
                raise ValueError(
                    f"block_span={self.block_span} must be a positive multiple of lcm(m, m')={self.lcm_ratio}"
                )

    # ----- construction -------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: dict[str, Any], name: str | None = None, block_span: int | None = None) -> DSV4Spec:
        """A spec from a V4 config.json dict; a missing key -> ValueError naming it."""
        if not isinstance(cfg, dict):
            raise TypeError(f"config must be a dict, got {type(cfg).__name__}")
        for key in REQUIRED_KEYS:
            if key not in cfg:
                raise ValueError(f"DeepSeek-V4 config is missing required key {key!r}")
        # Types first, by the config's own key: a string or null was compared, added or
        # float()ed below (TypeError), and the dataclass's check names its field, not the key.
        for key in _POSITIVE_INT_KEYS:
            _config_int(cfg[key], key, 1)
        for key in ("rope_theta", "compress_rope_theta", "rms_norm_eps"):
            value = cfg[key]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ValueError(f"DeepSeek-V4 config: {key} must be a finite positive number, got {json.dumps(value)}")
        num_kv_heads = cfg.get("num_key_value_heads", 1)
        if num_kv_heads != 1:
            raise ValueError(f"DeepSeek-V4 has one shared KV head, config says num_key_value_heads={num_kv_heads}")
        num_layers = cfg["num_hidden_layers"]
        ratios = cfg["compress_ratios"]
        if not isinstance(ratios, (list, tuple)):
            raise ValueError(f"compress_ratios must be a list, got {type(ratios).__name__}")
        num_mtp = _config_int(cfg.get("num_nextn_predict_layers", 1), "num_nextn_predict_layers", 0)
        if len(ratios) not in (num_layers, num_layers + num_mtp):
            raise ValueError(
                f"compress_ratios has {len(ratios)} entries; expected num_hidden_layers={num_layers} "
                f"plus num_nextn_predict_layers={num_mtp} MTP entries"
            )
        return cls(
            name=name or str(cfg.get("name") or cfg.get("model_type") or "deepseek-v4"),
            num_layers=num_layers,
            hidden_size=cfg["hidden_size"],
            num_heads=cfg["num_attention_heads"],
            head_dim=cfg["head_dim"],
            rope_head_dim=cfg["qk_rope_head_dim"],
            q_lora_rank=cfg["q_lora_rank"],
            o_groups=cfg["o_groups"],
            o_lora_rank=cfg["o_lora_rank"],
            window=cfg["sliding_window"],
            index_n_heads=cfg["index_n_heads"],
            index_head_dim=cfg["index_head_dim"],
            index_topk=cfg["index_topk"],
            rope_theta=float(cfg["rope_theta"]),
            compress_rope_theta=float(cfg["compress_rope_theta"]),
            yarn=_parse_rope_scaling(cfg["rope_scaling"]),
            max_position_embeddings=cfg["max_position_embeddings"],
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            compress_ratios=tuple(ratios),
            vocab_size=cfg.get("vocab_size"),
            block_span=block_span,
        )

    # ----- layer kinds --------------------------------------------------------------

    @staticmethod
    def kind_of_ratio(ratio: int) -> LayerKind:
        if ratio == 0:
            return LayerKind.SWA
        return LayerKind.CSA if ratio == CSA_RATIO else LayerKind.HCA

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """One kind per main layer (the MTP entries excluded)."""
        return tuple(self.kind_of_ratio(r) for r in self.compress_ratios[: self.num_layers])

    @property
    def mtp_kinds(self) -> tuple[LayerKind, ...]:
        """Kinds of the trailing MTP block(s); SWA-only in the released models."""
        return tuple(self.kind_of_ratio(r) for r in self.compress_ratios[self.num_layers :])

    @property
    def layer_ratios(self) -> tuple[int, ...]:
        return self.compress_ratios[: self.num_layers]

    def num_layers_of(self, kind: LayerKind, include_mtp: bool = False) -> int:
        kinds = self.layer_kinds + (self.mtp_kinds if include_mtp else ())
        return sum(1 for k in kinds if k is kind)

    @property
    def csa_ratio(self) -> int:
        """m."""
        return CSA_RATIO

    @property
    def hca_ratio(self) -> int | None:
        """m', or None when no layer is HCA."""
        hca = [r for r in self.compress_ratios if r not in (0, CSA_RATIO)]
        return hca[0] if hca else None

    @property
    def lcm_ratio(self) -> int:
        nonzero = [r for r in self.compress_ratios if r]
        return math.lcm(*nonzero) if nonzero else 1

    @property
    def span(self) -> int:
        """Tokens per classical block: lcm(m, m') unless a larger multiple was asked for."""
        return self.block_span if self.block_span is not None else self.lcm_ratio

    @staticmethod
    def coff(ratio: int) -> int:
        """2 for the overlapping (CSA) compressor, 1 otherwise."""
        return 2 if ratio == CSA_RATIO else 1

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.o_groups

    def entries_per_block(self, layer_id: int) -> int:
        """Compressed main entries one classical block holds for `layer_id` (0 for SWA)."""
        ratio = self.layer_ratios[layer_id]
        return self.span // ratio if ratio else 0

    # ----- byte accounting: entries --------------------------------------------------

    def main_entry_bytes(self, dtype: str = SERVING) -> float:
        """One SWA / CSA / HCA entry: 584 B serving for V4, else head_dim x dtype."""
        if dtype == SERVING:
            nope = self.head_dim - self.rope_head_dim
            scale_bytes = _round_up(math.ceil(nope / 64), 8)  # ue8m0 per 64 FP8 values, 8-aligned
            return nope + 2 * self.rope_head_dim + scale_bytes
        return self.head_dim * dtype_bytes(dtype)

    def indexer_key_bytes(self, indexer_format: str = "fp8") -> float:
        """One indexer key: "fp8" 132 B / "mxfp4" 68 B for V4, or index_head_dim x a storage dtype."""
        d = self.index_head_dim
        if indexer_format == "fp8":
            return d + 4 * math.ceil(d / 128)  # one fp32 scale per 128 values
        if indexer_format == "mxfp4":
            return d / 2 + math.ceil(d / 32)  # one ue8m0 scale byte per 32 values
        return d * dtype_bytes(indexer_format)

    # ----- byte accounting: classical pool ---------------------------------------------

    def classical_bytes_per_block(self, dtype: str = SERVING, indexer_format: str | None = None) -> float:
        """Bytes of one classical block (span tokens) over all main layers.

        CSA layers: span/m main entries + span/m indexer keys; HCA: span/m' entries; SWA-only
        and MTP layers: nothing. `indexer_format` defaults to "fp8" for serving, else `dtype`.
        """
        idx_fmt = indexer_format if indexer_format is not None else ("fp8" if dtype == SERVING else dtype)
        main = self.main_entry_bytes(dtype)
        key = self.indexer_key_bytes(idx_fmt)
        total = 0.0
        for ratio in self.layer_ratios:
            if ratio == 0:
                continue
            num_entries = self.span // ratio
            total += num_entries * main
            if ratio == CSA_RATIO:
                total += num_entries * key
        return total

    def classical_bytes_per_token(self, dtype: str = SERVING, indexer_format: str | None = None) -> float:
        """Classical bytes per token of history (Flash serving: ~3850 B FP8 idx / ~3514 B MXFP4)."""
        return self.classical_bytes_per_block(dtype, indexer_format) / self.span

    # ----- byte accounting: state pool -------------------------------------------------

    def _state_layers(self, include_mtp: bool) -> tuple[int, ...]:
        return self.compress_ratios if include_mtp else self.layer_ratios

    def swa_state_bytes(self, dtype: str = SERVING, include_mtp: bool = False) -> float:
        """The SWA window ring: window x main entry, every layer."""
        return self.window * self.main_entry_bytes(dtype) * len(self._state_layers(include_mtp))

    def compressor_state_rows(self, ratio: int) -> int:
        """Rows of a compressor's kv (and score) buffer: 2m for overlap, else m'."""
        return self.coff(ratio) * ratio

    def compressor_state_bytes(self, include_mtp: bool = False, dtype: str = "float32") -> float:
        """fp32 compressor tails: kv + score buffers (CSA main 2m x 2d, CSA indexer
        2m x 2*index_head_dim, HCA m' x d), every compressed layer."""
        elem = dtype_bytes(dtype)
        total = 0.0
        for ratio in self._state_layers(include_mtp):
            if ratio == 0:
                continue
            rows = self.compressor_state_rows(ratio)
            total += 2 * rows * self.coff(ratio) * self.head_dim * elem  # kv + score
            if ratio == CSA_RATIO:
                total += 2 * rows * self.coff(ratio) * self.index_head_dim * elem
        return total

    def boundary_compressor_bytes(self, include_mtp: bool = False, dtype: str = "float32") -> float:
        """The compressor tails at a span boundary (a multiple of every ratio): each
        compressor has just pooled its block, so only an overlapping one's (coff - 1) x m
        carried rows are live (CSA: the previous block's 4 of its 8 rows, main and indexer);
        HCA's tail is empty."""
        elem = dtype_bytes(dtype)
        total = 0.0
        for ratio in self._state_layers(include_mtp):
            if ratio == 0:
                continue
            carried = (self.coff(ratio) - 1) * ratio
            total += 2 * carried * self.coff(ratio) * self.head_dim * elem  # kv + score
            if ratio == CSA_RATIO:
                total += 2 * carried * self.coff(ratio) * self.index_head_dim * elem
        return total

    def pending_state_bytes(self, num_tokens: int, dtype: str = "float32", compressor_dtype: str = "float32") -> float:
        """After `num_tokens` tokens, the state beside the window (storage/dsv4.py
        `live_state`): each compressor's pending rows (an overlapping one's previous block,
        m rows, plus the num_tokens % m rows of its block so far; kv and score), and the
        unfinished span's complete entries (main, and CSA indexer keys) in `dtype`. At a
        span boundary this is `boundary_compressor_bytes`: no unfinished span."""
        elem, comp = dtype_bytes(dtype), dtype_bytes(compressor_dtype)
        total = 0.0
        for ratio in self.layer_ratios:
            if ratio == 0:
                continue
            rows = (ratio if ratio == CSA_RATIO else 0) + num_tokens % ratio
            tail = num_tokens // ratio - (num_tokens // self.span) * (self.span // ratio)
            width = self.head_dim + (self.index_head_dim if ratio == CSA_RATIO else 0)
            total += 2 * rows * self.coff(ratio) * width * comp + tail * width * elem
        return total

    def boundary_state_bytes(
        self, dtype: str = SERVING, include_mtp: bool = False, compressor_dtype: str = "float32"
    ) -> float:
        """The state at a span boundary, all a checkpoint there must hold: the SWA ring and
        the carried compressor rows (`boundary_compressor_bytes`); no unfinished span."""
        return self.swa_state_bytes(dtype, include_mtp) + self.boundary_compressor_bytes(include_mtp, compressor_dtype)

    def state_bytes_per_request(
        self, dtype: str = SERVING, include_mtp: bool = False, compressor_dtype: str = "float32"
    ) -> float:
        """One state block: SWA ring (in `dtype`) + compressor tails (fp32), as DEEPSEEK_V4.md §5."""
        return self.swa_state_bytes(dtype, include_mtp) + self.compressor_state_bytes(include_mtp, compressor_dtype)

    def tail_entry_bytes(self, dtype: str = SERVING, indexer_format: str | None = None) -> float:
        """Room for the complete entries of the unfinished span (span/ratio main entries per
        compressed layer, + span/4 indexer keys on CSA layers). kvpool keeps them in the state
        block, so that the Classical pool only ever holds whole, immutable spans; §5's state
        figures do not include them (at most span/ratio - 1 are live at a time)."""
        return self.classical_bytes_per_block(dtype, indexer_format)

    def storage_state_bytes_per_request(self, dtype: str = "float32") -> float:
        """kvpool's actual state block in a storage dtype: ring + fp32 compressor tails + tail entries."""
        return self.swa_state_bytes(dtype) + self.compressor_state_bytes() + self.tail_entry_bytes(dtype)

    def to_dict(self) -> dict[str, Any]:
        """A config.json-style dict that `from_config` reads back to an equal spec."""
        cfg: dict[str, Any] = {
            "name": self.name,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.window,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_scaling": None
            if self.yarn is None
            else {
                "type": "yarn",
                "factor": self.yarn.factor,
                "original_max_position_embeddings": self.yarn.original_max_position_embeddings,
                "beta_fast": self.yarn.beta_fast,
                "beta_slow": self.yarn.beta_slow,
            },
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "compress_ratios": list(self.compress_ratios),
            "num_nextn_predict_layers": len(self.compress_ratios) - self.num_layers,
        }
        if self.vocab_size is not None:
            cfg["vocab_size"] = self.vocab_size
        return cfg


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


# config keys that are counts or sizes (the dataclass's fields under other names for some):
# the required keys but the floats, the rope scaling object and the ratios' list
_POSITIVE_INT_KEYS: tuple[str, ...] = tuple(
    key
    for key in REQUIRED_KEYS
    if key not in ("rope_theta", "compress_rope_theta", "rope_scaling", "rms_norm_eps", "compress_ratios")
)


def _config_int(value: Any, key: str, minimum: int) -> int:
    """A config.json count: a JSON integer >= `minimum` (not a bool, a float or a string)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"DeepSeek-V4 config: {key} must be {kind}, got {json.dumps(value)}")
    return value


def _parse_rope_scaling(value: Any) -> YarnScaling | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"rope_scaling must be a dict or null, got {type(value).__name__}")
    kind = value.get("type", value.get("rope_type"))
    if kind != "yarn":
        raise ValueError(f"rope_scaling type must be 'yarn' for DeepSeek-V4, got {kind!r}")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in value:
            raise ValueError(f"rope_scaling is missing required key {key!r}")
    return YarnScaling(
        factor=float(value["factor"]),
        original_max_position_embeddings=int(value["original_max_position_embeddings"]),
        beta_fast=float(value.get("beta_fast", 32)),
        beta_slow=float(value.get("beta_slow", 1)),
    )


def load_preset_config(name: str) -> dict[str, Any]:
    """The shipped config.json dict of a V4 preset."""
    if name not in PRESET_NAMES:
        raise ValueError(f"unknown DeepSeek-V4 preset {name!r}; known: {', '.join(PRESET_NAMES)}")
    text = resources.files("kvpool").joinpath("presets", f"{name}.json").read_text(encoding="utf-8")
    return json.loads(text)


def load_preset(name: str, block_span: int | None = None) -> DSV4Spec:
    """DSV4Spec of "deepseek-v4-flash" or "deepseek-v4-pro" (real config.json facts)."""
    return DSV4Spec.from_config(load_preset_config(name), name=name, block_span=block_span)
