"""KV bytes per token, per block and per request, by attention kind, on one GPU.

Seed 003's capacity model: m_token = 2 * L * H_kv * d_h * s for K and V. The per-kind
variants:
- MHA / GQA / MQA: 2 * layers * kv_heads * head_dim * bytes (K and V);
- sliding-window layers: the same per token, but a request keeps at most `window` tokens;
- MLA (DeepSeek-V3 / V3.2): one latent of kv_lora_rank + rope dims per token, no V copy;
  in FP8, dense MLA (V2 / V3) stores that vector in E4M3 with one fp32 scale per layer
  (576 B; vLLM's and SGLang's fp8 MLA cache), while V3.2's sparse FlashMLA kernels read
  their own format, 512 FP8 + 4 fp32 scales + 64 BF16 rope = 656 B; V3.2 adds one
  Lightning-Indexer key per token (FP8: 128 + 4 scale bytes = 132 B);
- DeepSeek-V4: the classical pool (compressed CSA / HCA entries and indexer keys, only
  complete `lcm(m, m')`-token blocks) plus one fixed-size state block per request (SWA
  window + compressor tails), both taken from `kvpool.spec.dsv4`;
- kvpool's chunked formats (the block-scaled fp8_e4m3 / fp8_e5m2, KIVI): codes and scales
  in the blocks, plus the full-precision tails their storage keeps beside the pool for a
  running request's unfinished chunks (`tail_bytes_per_request`, counted in the per-request
  state): storage/kv.py's tail slot is one whole block of K and of V, every layer, the
  rank's KV heads, in the compute dtype; a request holds at most its schema's `tail_slots` of them.

Tensor parallelism divides the cache only when it is sharded by head: GQA / MHA caches
split their KV heads over the TP ranks (a rank keeps at least one head, so a TP size above
the head count replicates heads). MLA latents, MQA's single head and V4's shared vector are
replicated: every rank stores the full bytes.

Every per-block figure counts quantization scales and the padding that aligns each layer's
block to `alignment` bytes on its own line, so nothing hides in a rounded total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpool.spec import dsv4 as dsv4_spec
from kvpool.spec.kv_formats import QUANTIZED, kv_schema
from kvpool.spec.layout import AttentionKind, CacheSpec, LayerSpec, dtype_bytes
from kvpool.spec.models import ModelSpec

# "fp8" is vLLM's (one per-tensor scale per layer for GQA; FlashMLA's and V4's layouts for
# MLA and V4); the names after it are kvpool's own GQA / MHA formats (spec/kv_formats.py),
# whose bytes their schema gives (KIVI's may name G and R: "kivi2-g16-r64").
KV_DTYPES: tuple[str, ...] = ("auto", "bf16", "fp16", "fp32", "fp8", *QUANTIZED)
INDEXER_FORMATS: tuple[str, ...] = ("fp8", "mxfp4", "bf16")
DEFAULT_ALIGNMENT = 256  # bytes; cudaMalloc's alignment, and what paged kernels assume per page

_STORAGE_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "fp8"}


@dataclass(frozen=True)
class PageGroup:
    """Layers that share one block geometry. All sizes are per GPU.

    An entry is one cached vector: a token's K+V (GQA), a latent (MLA), an indexer key, or
    a V4 compressed entry that stands for `tokens_per_entry` tokens.
    """

    name: str
    num_layers: int
    block_size: int  # tokens one block covers
    tokens_per_entry: int  # 1, or the V4 compression ratio (4 CSA, 128 HCA)
    data_bytes_per_entry: float  # per layer
    scale_bytes_per_entry: float  # per layer: quantization scales stored with the entry
    window: int | None = None  # sliding window in tokens; None keeps the whole history
    complete_blocks_only: bool = False  # V4: the unfinished tail lives in the state block
    fixed_scale_bytes: int = 0  # per layer, independent of tokens (per-tensor FP8 k/v scales)
    alignment: int = DEFAULT_ALIGNMENT
    replicated: bool = False  # the same bytes on every TP rank

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % self.tokens_per_entry:
            raise ValueError(
                f"{self.name}: block_size {self.block_size} must be a positive multiple of "
                f"tokens_per_entry {self.tokens_per_entry}"
            )
        if self.window is not None and self.window <= 0:
            raise ValueError(f"{self.name}: window must be positive, got {self.window}")

    @property
    def entry_bytes(self) -> float:
        return self.data_bytes_per_entry + self.scale_bytes_per_entry

    @property
    def bytes_per_token(self) -> float:
        """Unpadded bytes one token of history costs in this group (all its layers)."""
        return self.num_layers * self.entry_bytes / self.tokens_per_entry

    @property
    def raw_block_bytes_per_layer(self) -> float:
        return (self.block_size // self.tokens_per_entry) * self.entry_bytes

    @property
    def block_bytes_per_layer(self) -> int:
        """One layer's block, rounded up to `alignment`."""
        return _round_up(math.ceil(self.raw_block_bytes_per_layer), self.alignment)

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.block_bytes_per_layer

    @property
    def data_bytes_per_block(self) -> float:
        return self.num_layers * (self.block_size // self.tokens_per_entry) * self.data_bytes_per_entry

    @property
    def scale_bytes_per_block(self) -> float:
        return self.num_layers * (self.block_size // self.tokens_per_entry) * self.scale_bytes_per_entry

    @property
    def padding_bytes_per_block(self) -> float:
        return self.bytes_per_block - self.data_bytes_per_block - self.scale_bytes_per_block

    def cached_tokens(self, context_len: int) -> int:
        """Tokens of history whose entries this group stores for a `context_len` request."""
        if self.complete_blocks_only:
            return (context_len // self.block_size) * self.block_size
        if self.window is not None:
            return min(context_len, self.window)
        return context_len

    def num_blocks(self, context_len: int) -> int:
        """Blocks a request of `context_len` tokens holds.

        Full attention: ceil(L / q). Sliding window: the blocks that hold positions
        [max(0, L - window), L - 1]; an unaligned window straddles one block more than
        window / q. V4 classical: complete blocks only.
        """
        if context_len < 0:
            raise ValueError(f"context_len must be >= 0, got {context_len}")
        if context_len == 0:
            return 0
        q = self.block_size
        if self.complete_blocks_only:
            return context_len // q
        first = max(0, context_len - self.window) if self.window is not None else 0
        return (context_len - 1) // q - first // q + 1

    def logical_bytes(self, context_len: int) -> float:
        """Bytes of the entries themselves for one request (no paging, no padding)."""
        return self.cached_tokens(context_len) // self.tokens_per_entry * self.num_layers * self.entry_bytes


@dataclass(frozen=True)
class KVLayout:
    """A model's KV cache on one GPU of a TP group: its page groups and per-request state."""

    model: str
    kv_dtype: str
    block_size: int
    tp: int
    groups: tuple[PageGroup, ...]
    # V4 state block (SWA window + compressor tails); the chunked formats' full-precision
    # tails (tail_bytes_per_request); 0 otherwise
    state_bytes_per_request: float
    sharded_by_head: bool
    kv_heads_per_gpu: int | None  # GQA only
    alignment: int = DEFAULT_ALIGNMENT
    indexer_format: str | None = None  # V3.2 / V4 indexer keys
    tail_bytes_per_request: float = 0.0  # the chunked formats' tails: all of the state, when not 0

    @property
    def bytes_per_token(self) -> float:
        """Unpadded KV bytes per token of history on one GPU, window layers included."""
        return sum(g.bytes_per_token for g in self.groups)

    @property
    def state_block_bytes(self) -> int:
        """The state block as allocated: rounded up to `alignment`."""
        return _round_up(math.ceil(self.state_bytes_per_request), self.alignment) if self.state_bytes_per_request else 0

    def kv_bytes_at_context(self, context_len: int) -> float:
        """Logical KV bytes of one request on one GPU: entries + state, no paging."""
        return sum(g.logical_bytes(context_len) for g in self.groups) + self.state_bytes_per_request

    def request_bytes(self, context_len: int) -> int:
        """Pool bytes one request of `context_len` tokens holds on one GPU: whole blocks + state."""
        return sum(g.num_blocks(context_len) * g.bytes_per_block for g in self.groups) + self.state_block_bytes

    @property
    def bytes_per_block_all_groups(self) -> int:
        """One block of every group: the pool's allocation unit in the ledger."""
        return sum(g.bytes_per_block for g in self.groups)

    @property
    def fixed_scale_bytes(self) -> int:
        return sum(g.num_layers * g.fixed_scale_bytes for g in self.groups)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _own_format(dtype: str) -> bool:
    """kvpool's own quantized GQA formats (not "fp8", whose layout depends on the model)."""
    return dtype.split("-")[0] in QUANTIZED


def resolve_kv_dtype(model: ModelSpec, kv_dtype: str) -> str:
    """ "auto" -> the model's usual serving format: BF16 for GQA and DeepSeek-V3; FP8 for
    V3.2 (its sparse FlashMLA kernels read the 656 B FP8 format) and V4 (584 B entries)."""
    if kv_dtype not in KV_DTYPES:
        if kv_dtype.split("-")[0] not in QUANTIZED:
            raise ValueError(f"unknown kv dtype {kv_dtype!r}; known: {list(KV_DTYPES)}")
        kv_schema(kv_dtype)  # a KIVI name with its G and R: ValueError if malformed
    if kv_dtype != "auto":
        return kv_dtype
    if model.attention == "dsv4" or (model.attention == "mla" and model.indexer is not None):
        return "fp8"
    return "bf16"


def default_block_size(model: ModelSpec) -> int:
    """16 tokens for GQA (vLLM's default), 64 for MLA (FlashMLA's page), lcm(m, m') for V4."""
    if model.attention == "dsv4":
        assert model.dsv4 is not None
        return model.dsv4.lcm_ratio
    return 64 if model.attention == "mla" else 16


def kv_heads_per_gpu(num_kv_heads: int, tp: int) -> int:
    """KV heads one TP rank stores: heads / tp, or 1 (replicated) when tp exceeds the heads."""
    if tp <= 0:
        raise ValueError(f"tp must be positive, got {tp}")
    if num_kv_heads % tp == 0:
        return num_kv_heads // tp
    if tp % num_kv_heads == 0:
        return 1  # each head lives on tp / num_kv_heads ranks
    raise ValueError(
        f"tensor-parallel size {tp} neither divides nor is a multiple of num_key_value_heads={num_kv_heads}"
    )


def kv_layout(
    model: ModelSpec,
    kv_dtype: str = "auto",
    block_size: int | None = None,
    tp: int = 1,
    indexer_format: str | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
    compute_bytes: int = 2,
) -> KVLayout:
    """The per-GPU KV layout of `model` at tensor-parallel size `tp`. compute_bytes: the
    element of the chunked formats' full-precision tails (the compute dtype: BF16's 2)."""
    if tp <= 0:
        raise ValueError(f"tp must be positive, got {tp}")
    if alignment <= 0:
        raise ValueError(f"alignment must be positive, got {alignment}")
    dtype = resolve_kv_dtype(model, kv_dtype)
    q = block_size if block_size is not None else default_block_size(model)
    if block_size is None and _own_format(dtype) and kv_schema(dtype).residual:
        q = math.lcm(q, kv_schema(dtype).residual)  # KIVI: a block holds whole residual chunks
    if q <= 0:
        raise ValueError(f"block_size must be positive, got {q}")
    if indexer_format is not None and indexer_format not in INDEXER_FORMATS:
        raise ValueError(f"unknown indexer format {indexer_format!r}; known: {list(INDEXER_FORMATS)}")
    if compute_bytes <= 0:
        raise ValueError(f"compute_bytes must be positive, got {compute_bytes}")
    if model.attention == "gqa":
        return _gqa_layout(model, dtype, q, tp, alignment, compute_bytes)
    if _own_format(dtype):
        raise ValueError(f"kv dtype {dtype!r} is for GQA / MHA layers; {model.name} is {model.attention}")
    if model.attention == "mla":
        return _mla_layout(model, dtype, q, tp, indexer_format or "fp8", alignment)
    if indexer_format is not None and dtype != "fp8" and indexer_format != dtype:
        # V4's keys have a format of their own only in the fp8 serving layout; a plain-dtype
        # cache stores them in its dtype, and the format was dropped without a word (bf16 with
        # mxfp4 keys planned bf16 keys). The format that is the cache's own agrees: taken.
        raise ValueError(
            f"indexer format {indexer_format!r}: a {dtype} DeepSeek-V4 cache keeps its indexer keys in {dtype}; "
            "the key formats are the fp8 serving layout's"
        )
    return _dsv4_layout(model, dtype, q, tp, indexer_format or "fp8", alignment)


def _gqa_layout(model: ModelSpec, dtype: str, q: int, tp: int, alignment: int, compute_bytes: int) -> KVLayout:
    heads = kv_heads_per_gpu(model.num_kv_heads, tp)
    scale_bytes = 0.0
    tails = 0
    if _own_format(dtype):  # the schema's codes, and its scales amortized over the block
        schema = kv_schema(dtype)
        schema.check(q, model.head_dim)
        entry_bytes = heads * schema.data_bytes_per_block_head(q, model.head_dim) / q
        scale_bytes = heads * schema.scale_bytes_per_block_head(q, model.head_dim) / q
        if schema.flush(q) > 1:  # chunked: a tail slot is a block's K and V, every layer
            tails = schema.tail_slots * 2 * model.num_layers * heads * model.head_dim * q * compute_bytes
    else:
        # One token's K and V in one layer: the spec's formula (spec/layout.py), per GPU's heads.
        entry_bytes = LayerSpec(AttentionKind.FULL, heads, model.head_dim, _STORAGE_DTYPE[dtype]).bytes_per_token
    # FP8 E4M3 with one fp32 scale per tensor for K and one for V in each layer (vLLM's "fp8").
    fixed_scales = 8 if dtype == "fp8" else 0
    by_window: dict[int | None, int] = {}
    for w in model.layer_windows:
        by_window[w] = by_window.get(w, 0) + 1
    groups = tuple(
        PageGroup(
            name="full" if w is None else f"sliding-{w}",
            num_layers=n,
            block_size=q,
            tokens_per_entry=1,
            data_bytes_per_entry=entry_bytes,
            scale_bytes_per_entry=scale_bytes,
            window=w,
            fixed_scale_bytes=fixed_scales,
            alignment=alignment,
            replicated=heads * tp > model.num_kv_heads,
        )
        for w, n in sorted(by_window.items(), key=lambda item: (item[0] is not None, item[0] or 0))
    )
    return KVLayout(
        model.name,
        dtype,
        q,
        tp,
        groups,
        float(tails),
        heads * tp == model.num_kv_heads,
        heads,
        alignment,
        tail_bytes_per_request=float(tails),
    )


def _indexer_key_bytes(head_dim: int, fmt: str) -> tuple[float, float]:
    """(data, scale) bytes of one indexer key: FP8 + fp32 per 128, MXFP4 + 1 B per 32, or BF16."""
    if fmt == "fp8":
        return float(head_dim), 4.0 * math.ceil(head_dim / 128)
    if fmt == "mxfp4":
        return head_dim / 2, float(math.ceil(head_dim / 32))
    return 2.0 * head_dim, 0.0


def _mla_layout(model: ModelSpec, dtype: str, q: int, tp: int, idx_fmt: str, alignment: int) -> KVLayout:
    mla = model.mla
    assert mla is not None
    fixed_scales = 0
    if dtype == "fp8" and model.indexer is not None:
        # V3.2's sparse FlashMLA FP8 layout: the kv_lora_rank part in FP8 with one fp32 scale
        # per 128 values, the rope part kept in BF16: 512 + 16 + 128 = 656 B.
        data = mla.kv_lora_rank + 2 * mla.qk_rope_head_dim
        scales = 4 * math.ceil(mla.kv_lora_rank / 128)
    elif dtype == "fp8":
        # Dense MLA (V2 / V3): the whole latent + rope vector in E4M3, one byte a value, and
        # one fp32 per-tensor scale a layer (the latent is one tensor): 576 B for V3. The 656 B
        # layout is the sparse kernels' alone; V3 planned it, 14 % over what engines store.
        data = mla.kv_lora_rank + mla.qk_rope_head_dim
        scales = 0
        fixed_scales = 4
    else:
        data = (mla.kv_lora_rank + mla.qk_rope_head_dim) * dtype_bytes(_STORAGE_DTYPE[dtype])
        scales = 0
    groups = [
        PageGroup(
            "mla-latent",
            model.num_layers,
            q,
            1,
            data,
            scales,
            fixed_scale_bytes=fixed_scales,
            alignment=alignment,
            replicated=True,
        )
    ]
    if model.indexer is not None:
        idx_data, idx_scales = _indexer_key_bytes(model.indexer.head_dim, idx_fmt)
        groups.append(
            PageGroup("indexer-key", model.num_layers, q, 1, idx_data, idx_scales, alignment=alignment, replicated=True)
        )
    return KVLayout(
        model.name,
        dtype,
        q,
        tp,
        tuple(groups),
        0.0,
        False,
        None,
        alignment,
        idx_fmt if model.indexer is not None else None,
    )


def _dsv4_layout(model: ModelSpec, dtype: str, q: int, tp: int, idx_fmt: str, alignment: int) -> KVLayout:
    v4 = model.dsv4
    assert v4 is not None
    if q % v4.lcm_ratio:
        raise ValueError(f"DeepSeek-V4 block_size must be a multiple of lcm(m, m') = {v4.lcm_ratio}, got {q}")
    v4_dtype = dsv4_spec.SERVING if dtype == "fp8" else _STORAGE_DTYPE[dtype]
    entry = v4.main_entry_bytes(v4_dtype)
    if v4_dtype == dsv4_spec.SERVING:
        # 448 FP8 + 64 BF16 rope dims of data; the rest of the 584 B are ue8m0 scales.
        entry_data = float(v4.head_dim - v4.rope_head_dim + 2 * v4.rope_head_dim)
        idx_dtype: str | None = {"fp8": "fp8", "mxfp4": "mxfp4", "bf16": "bfloat16"}[idx_fmt]
        key_data, _ = _indexer_key_bytes(v4.index_head_dim, idx_fmt)
        key = v4.indexer_key_bytes(idx_dtype)
    else:
        # A plain storage dtype (kvpool's own torch pools): entries and keys in that dtype.
        idx_dtype = None
        entry_data = entry
        key_data = key = v4.indexer_key_bytes(v4_dtype)
    groups: list[PageGroup] = []
    num_csa = v4.num_layers_of(dsv4_spec.LayerKind.CSA)
    num_hca = v4.num_layers_of(dsv4_spec.LayerKind.HCA)
    if num_csa:
        groups.append(
            PageGroup(
                "csa-entry",
                num_csa,
                q,
                v4.csa_ratio,
                entry_data,
                entry - entry_data,
                complete_blocks_only=True,
                alignment=alignment,
                replicated=True,
            )
        )
        groups.append(
            PageGroup(
                "csa-indexer-key",
                num_csa,
                q,
                v4.csa_ratio,
                key_data,
                key - key_data,
                complete_blocks_only=True,
                alignment=alignment,
                replicated=True,
            )
        )
    if num_hca:
        assert v4.hca_ratio is not None
        groups.append(
            PageGroup(
                "hca-entry",
                num_hca,
                q,
                v4.hca_ratio,
                entry_data,
                entry - entry_data,
                complete_blocks_only=True,
                alignment=alignment,
                replicated=True,
            )
        )
    layout = KVLayout(
        model.name,
        dtype,
        q,
        tp,
        tuple(groups),
        v4.state_bytes_per_request(v4_dtype),
        False,
        None,
        alignment,
        idx_fmt if v4_dtype == dsv4_spec.SERVING else None,
    )
    # The groups must add up to the dsv4 module's own classical accounting (one source of truth).
    spec_at_q = dsv4_spec.DSV4Spec.from_config(v4.to_dict(), name=v4.name, block_span=q)
    expected = spec_at_q.classical_bytes_per_block(v4_dtype, idx_dtype)
    got = sum(g.data_bytes_per_block + g.scale_bytes_per_block for g in groups)
    assert abs(got - expected) < 1e-6 * max(1.0, expected), (got, expected)
    return layout


def cache_spec(model: ModelSpec, kv_dtype: str = "auto", block_size: int | None = None) -> CacheSpec:
    """The lead's frozen `CacheSpec` of a GQA or plain-dtype MLA model (one GPU, no TP).

    It carries no scales or indexer keys, so the FP8 MLA format and V4 have none; the
    capacity model above is the superset, and tests check the two agree where both apply.
    """
    dtype = resolve_kv_dtype(model, kv_dtype)
    q = block_size if block_size is not None else default_block_size(model)
    storage = _STORAGE_DTYPE[dtype]
    if model.attention == "gqa":
        layers = tuple(
            LayerSpec(
                AttentionKind.FULL if w is None else AttentionKind.SLIDING_WINDOW,
                model.num_kv_heads,
                model.head_dim,
                storage,
                w,
            )
            for w in model.layer_windows
        )
        return CacheSpec(model.name, layers, q)
    if model.attention == "mla" and dtype != "fp8" and model.indexer is None:
        return CacheSpec.uniform(model.name, model.num_layers, 1, model.head_dim, storage, AttentionKind.MLA, q)
    raise ValueError(f"{model.name}: a {dtype} {model.attention_label} cache has no plain CacheSpec equivalent")
