"""KV-cache storage formats as schemas: what a stored K or V element is, where its scales
live, which tokens share a scale, when the scales are computed, and the bytes all of it
takes. Pure data (no torch): the planner counts bytes from here, storage/quant.py does the
arithmetic, and the cache descriptor carries `KVSchema.schema_id` (a block written under
one schema never serves a reader of another).

  name             element         K scales                V scales               flush
  fp32/bf16/fp16   that float      none                    none                   1
  fp8_e4m3         E4M3, 1 B       one per (block, head)   one per (block, head)  block
  fp8_e5m2         E5M2, 1 B       one per (block, head)   one per (block, head)  block
  fp8_e4m3_token   E4M3, 1 B       one per (token, head)   one per (token, head)  1
  fp8_e5m2_token   E5M2, 1 B       one per (token, head)   one per (token, head)  1
  int8             int8, 1 B       one per (token, head)   one per (token, head)  1
  kivi4 / kivi2    4 / 2-bit code  per channel, over G     per token, over G      R
                   (asymmetric)    tokens (scale + zero)   channels (scale+zero)

Scales are fp32 (the 8-bit formats; symmetric, s = amax / qmax) or fp16 (KIVI's scale and
zero point, as the paper stores them). Every dequantized value is computed in the model's
compute dtype (fp32 here): that is the accumulator of attention.

"flush" is when a token's bytes are final. Per-token formats quantize a token when it is
written: its bytes depend on that token alone. The others keep the tokens of their
unfinished chunk (a block, or KIVI's residual of R tokens) in full precision beside the
pool (the storage's tail) and quantize the chunk when its last token is written; until
then every reader reads those tokens in full precision, and after it the quantized bytes.
A chunk's bytes therefore depend on its own tokens only, whatever the chunking of the
prefill or the order of the writes, so a prefix hit and the contiguous reference see the
same bytes. KIVI's G (tokens per key group, channels per value group) and R (the full-
precision residual) default to the paper's 32 and 128; R must divide the block size (a
chunk never spans blocks) and G must divide R and the head dim.

KIVI follows the paper's serving regime (Liu et al. 2024, section 3.3 and its code): K is
quantized an R-chunk at a time (the unfinished chunk is exact), V a token at a time, but
the last R values of a sequence stay exact (`value_window`: a sliding window, whatever the
sequence's length mod R); and a step attends to the K and V it computes itself in full
precision before storing their codes (`attends_new_exactly`: the paper's prefill attends
in full precision; its decode step reads its own token before quantizing it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KIVI_GROUP = 32  # KIVI's G
KIVI_RESIDUAL = 128  # KIVI's R


@dataclass(frozen=True)
class KVSchema:
    name: str
    element: str  # "float32" "bfloat16" "float16" "float8_e4m3fn" "float8_e5m2" "int8" "uint4" "uint2"
    bits: int  # per element
    k_scale: str  # "none" | "token" | "block" | "channel" (per channel over `group` tokens)
    v_scale: str  # "none" | "token" | "block" | "token-group" (per token over `group` channels)
    qmax: float = 0.0  # symmetric formats: the largest magnitude a code holds
    zero_point: bool = False  # asymmetric (KIVI): x = q * s + z
    scale_dtype: str = "float32"
    group: int = 0  # KIVI's G
    residual: int = 0  # KIVI's R; block formats: the block size (0 here: "block")

    @property
    def scaled(self) -> bool:
        return self.k_scale != "none"

    @property
    def packed(self) -> bool:
        """Several codes per byte (KIVI): K packed along slots, V along channels."""
        return self.bits < 8

    @property
    def value_window(self) -> int:
        """V's full-precision residual: the last R values of a sequence (KIVI), else 0."""
        return self.residual if self.k_scale == "channel" else 0

    @property
    def tail_slots(self) -> int:
        """Tail slots one running request holds at once in kvpool's chunked storage
        (storage/kv.py: a block's K and V in full precision, every layer, until the block is
        flushed; the tails of blocks a step fills are freed at the next step's start). Block
        formats: the partial block a step completes and the new one it leaves, 2. KIVI: V's
        window of the last R <= block-size values spans two blocks, each kept until it is full
        and out of the window, and a prefill chunk crossing two block boundaries holds the
        window's two it began with and the two it ends with, 4. What `kvpool plan` prices a
        request (capacity/kv.py) and what the storage grows its tails to at most a sequence."""
        return 4 if self.value_window else 2

    @property
    def attends_new_exactly(self) -> bool:
        """A step's attention reads the step's own K and V in full precision (KIVI)."""
        return self.k_scale == "channel"

    def flush(self, block_size: int) -> int:
        """Tokens quantized together: 1 (at write), the block, or KIVI's R."""
        if self.k_scale == "block":
            return block_size
        return self.residual if self.residual else 1

    @property
    def schema_id(self) -> str:
        """Everything a reader of the bytes must agree on, for the cache descriptor."""
        parts = [self.name, self.element, f"k:{self.k_scale}", f"v:{self.v_scale}"]
        if self.scaled:
            parts += [f"scale:{self.scale_dtype}", "asym" if self.zero_point else "sym"]
        if self.group:
            parts += [f"g{self.group}", f"r{self.residual}"]
        return "/".join(parts)

    def check(self, block_size: int, head_dim: int) -> None:
        """ValueError naming the problem when this schema cannot lay out such blocks."""
        if self.k_scale == "channel":
            g, r = self.group, self.residual
            if g <= 0 or r <= 0:
                raise ValueError(f"{self.name}: group size and residual must be positive, got {g}, {r}")
            if r % g:
                raise ValueError(f"{self.name}: the group size {g} does not divide the residual {r}")
            if block_size % r:
                raise ValueError(
                    f"{self.name}: the residual R={r} (tokens quantized together) does not divide the block size "
                    f"{block_size}; use a block size that R divides, or a smaller R and G"
                )
            if head_dim % g:
                raise ValueError(f"{self.name}: the group size {g} does not divide the head dim {head_dim}")
            if (g * self.bits) % 8:
                raise ValueError(f"{self.name}: a group of {g} {self.bits}-bit codes is not whole bytes")

    # ---- bytes ---------------------------------------------------------------------------

    @property
    def scale_bytes(self) -> int:
        return 2 if self.scale_dtype == "float16" else 4

    def _scales_per_block_head(self, which: str, block_size: int, head_dim: int) -> int:
        """Scale values of one K or V block of one KV head (a zero point doubles them)."""
        kind = self.k_scale if which == "k" else self.v_scale
        n = {
            "none": 0,
            "token": block_size,
            "block": 1,
            "channel": head_dim * (block_size // max(self.group, 1)),
            "token-group": block_size * (head_dim // max(self.group, 1)),
        }[kind]
        return n * (2 if self.zero_point else 1)

    def scale_bytes_per_block_head(self, block_size: int, head_dim: int) -> int:
        """K and V scales (and zero points) of one block of one KV head, one layer."""
        per = sum(self._scales_per_block_head(w, block_size, head_dim) for w in ("k", "v"))
        return per * self.scale_bytes

    def data_bytes_per_block_head(self, block_size: int, head_dim: int) -> int:
        """K and V elements of one block of one KV head, one layer."""
        return 2 * block_size * head_dim * self.bits // 8

    def bytes_per_token_head(self, block_size: int, head_dim: int) -> float:
        """K and V of one token of one KV head, one layer, scales amortized over the block."""
        total = self.data_bytes_per_block_head(block_size, head_dim)
        return (total + self.scale_bytes_per_block_head(block_size, head_dim)) / block_size


def _kivi(bits: int, group: int, residual: int) -> KVSchema:
    name = f"kivi{bits}" if (group, residual) == (KIVI_GROUP, KIVI_RESIDUAL) else f"kivi{bits}-g{group}-r{residual}"
    return KVSchema(
        name,
        f"uint{bits}",
        bits,
        "channel",
        "token-group",
        zero_point=True,
        scale_dtype="float16",
        group=group,
        residual=residual,
    )


KV_SCHEMAS: dict[str, KVSchema] = {
    s.name: s
    for s in (
        KVSchema("fp32", "float32", 32, "none", "none"),
        KVSchema("bf16", "bfloat16", 16, "none", "none"),
        KVSchema("fp16", "float16", 16, "none", "none"),
        KVSchema("fp8_e4m3", "float8_e4m3fn", 8, "block", "block", 448.0),
        KVSchema("fp8_e5m2", "float8_e5m2", 8, "block", "block", 57344.0),
        KVSchema("fp8_e4m3_token", "float8_e4m3fn", 8, "token", "token", 448.0),
        KVSchema("fp8_e5m2_token", "float8_e5m2", 8, "token", "token", 57344.0),
        KVSchema("int8", "int8", 8, "token", "token", 127.0),
        _kivi(4, KIVI_GROUP, KIVI_RESIDUAL),
        _kivi(2, KIVI_GROUP, KIVI_RESIDUAL),
    )
}
QUANTIZED: tuple[str, ...] = tuple(n for n, s in KV_SCHEMAS.items() if s.scaled)


def kv_schema(name: str, *, group: int | None = None, residual: int | None = None) -> KVSchema:
    """The schema called `name`; KIVI's G and R may follow the name ("kivi2-g16-r64", either
    part alone) or come as arguments. ValueError naming the problem otherwise."""
    base, *params = name.split("-")
    try:
        schema = KV_SCHEMAS[base]
    except KeyError:
        raise ValueError(f"unknown KV format {name!r}; one of {', '.join(KV_SCHEMAS)} (KIVI: kivi2-g32-r128)") from None
    for p in params:
        value = p[1:]
        if p[:1] not in ("g", "r") or not value.isdigit():
            raise ValueError(f"KV format {name!r}: {p!r} is not g<group size> or r<residual>")
        if p[0] == "g":
            group = int(value)
        else:
            residual = int(value)
    if group is None and residual is None:
        return schema
    if schema.k_scale != "channel":
        raise ValueError(f"KV format {name!r}: a group size and residual apply to the KIVI formats only")
    return _kivi(
        schema.bits, schema.group if group is None else group, schema.residual if residual is None else residual
    )


def block_bytes(schema: KVSchema, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """One block over every layer: K and V elements, scales and zero points."""
    per_head = schema.data_bytes_per_block_head(block_size, head_dim)
    per_head += schema.scale_bytes_per_block_head(block_size, head_dim)
    return num_layers * num_kv_heads * per_head


def capacity_gain(schema: KVSchema, reference: KVSchema, block_size: int, head_dim: int) -> float:
    """How many more tokens the same bytes hold under `schema` than under `reference`."""
    mine = schema.bytes_per_token_head(block_size, head_dim)
    return reference.bytes_per_token_head(block_size, head_dim) / mine if mine else math.inf
