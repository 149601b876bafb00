"""Llama forward in plain torch, over a flat batch of tokens from many sequences.

`forward(token_ids, positions, metadata)`, the signature of every model here: the model
does not know about caches; each layer hands its q / k / v to the step's attention,
`metadata.attention.attend` (attention/backends/step.py): a paged backend's step, which
writes K/V into the block pool and reads it back through the block tables, or the
contiguous reference (attention/reference.py `reference_logits`). Weights come from
`models.gguf` with Q/K rows already un-permuted, so RoPE here is the rotate-half form of
HF Llama.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvpool.attention.backends.step import Attend, StepMetadata
from kvpool.models.gguf import LlamaConfig
from kvpool.models.rope import rope_tables

if TYPE_CHECKING:
    from kvpool.kernels import CpuKernels


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x [N, hidden] -> x / rms(x) * weight, one fused op (HF computes the same in fp32)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


LAYER_PARTS = ("q", "k", "v", "o", "gate", "up", "down", "attn_norm", "ffn_norm")
BIAS_PARTS = ("q_bias", "k_bias", "v_bias")  # a model with qkv_bias (Qwen2) has these too
QK_NORM_PARTS = ("q_norm", "k_norm")  # a model with qk_norm (Qwen3) has these too, [head_dim] each, kept as they are


def layer_parts(config: LlamaConfig) -> tuple[str, ...]:
    """The unfused tensors of one layer (GGUF / HF names' short forms)."""
    return LAYER_PARTS + (BIAS_PARTS if config.qkv_bias else ()) + (QK_NORM_PARTS if config.qk_norm else ())


class LlamaModel:
    """Fused layer weights stored transposed, [in, out]: wqkv [hidden, (H + 2 KVH) * D]
    (and its bias bqkv [(H + 2 KVH) * D] with config.qkv_bias: Qwen2; with config.qk_norm
    the per-head norm weights q_norm / k_norm [D], Qwen3's, applied before RoPE),
    wo [H * D, hidden], w_gate_up [hidden, 2 * I], w_down [I, hidden]; the embedding
    [vocab, hidden] row-major, which also serves as the LM head when the two are tied
    (SmolLM2: no second copy; an untied `lm_head` is kept [vocab, hidden] too).

    A layer is 4 matmuls `x @ w`. The [in, out] layout matters on CPU: for the few rows of a
    decode batch (M = 2..64), MKL multiplies x [M, in] @ w [in, out] several times faster
    than F.linear's x @ w[out, in].T, while large prefill batches run at the same speed.
    At batch 1 both are bound by reading the fp32 weights from memory. The LM head reads
    the row-major [vocab, hidden] matrix with the C kernel `row_dots` (each row once, the
    batch's dot products from L1), faster than either layout through MKL at these sizes.

    kernels: the C kernels (kvpool.kernels); on fp32 CPU the forward then runs the work
    between matmuls as fused calls (`_forward_fused`) instead of ~15 torch ops a layer."""

    def __init__(
        self,
        config: LlamaConfig,
        embed: torch.Tensor,
        norm: torch.Tensor,
        layers: list[dict[str, torch.Tensor]],
        lm_head: torch.Tensor | None = None,
        device: str | torch.device = "cpu",
        kernels: CpuKernels | None = None,
    ):
        """Weights in their final layout (see the class docstring); `from_tensors` builds
        them from a GGUF's tensors, one layer at a time. lm_head: None when tied to embed."""
        self.config = config
        self.device = torch.device(device)
        self.dtype = embed.dtype
        fused = kernels is not None and self.dtype == torch.float32 and self.device.type == "cpu"
        self.kernels = kernels if fused else None
        self.embed = embed.to(self.device).contiguous()  # [vocab, hidden]
        self.norm = norm.to(self.device).contiguous()
        self.lm_head = None if lm_head is None else lm_head.to(self.device).contiguous()  # [vocab, hidden]
        self.layers = [{k: v.to(self.device).contiguous() for k, v in layer.items()} for layer in layers]
        if len(self.layers) != config.num_layers:
            raise ValueError(f"{len(self.layers)} layers of weights for a {config.num_layers}-layer model")
        self._check_shapes()
        # the norm weights' addresses for the fused forward: they never move
        self._norm_ptrs = [layer["attn_norm"].data_ptr() for layer in self.layers] + [self.norm.data_ptr()]
        self._ffn_norm_ptrs = [layer["ffn_norm"].data_ptr() for layer in self.layers]
        if config.qk_norm:
            self._qk_norm_ptrs = [(layer["q_norm"].data_ptr(), layer["k_norm"].data_ptr()) for layer in self.layers]
        self.step_buffer_bytes = 0  # what the last forward allocated for its step (the memory ledger)
        # tensor parallelism (models/tensor_parallel.py): the partial sums of the attention
        # output and MLP down projections are summed over the ranks in place; None: one rank
        self.reduce: Callable[[torch.Tensor], None] | None = None
        self.shard: tuple[int, int] | None = None  # (rank, world size) of a sharded model
        self.tp_group = None  # its torch.distributed group (None: the default group)
        # RoPE tables (rotate-half, models/rope.py: plain or scaled): cos / sin_signed
        # [max_position, head_dim], computed in fp64 and rounded once to fp32 (kept in fp64
        # for an fp64 model, the exactness oracle: fp32 tables put it ~1e-7 off at position
        # 200); sin_signed is [-sin | +sin], the rotate-half sign folded in: see _rope
        c = config
        table_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        cos, sin_signed = rope_tables(c.head_dim, c.rope_theta, c.rope_freq_divisors, c.max_position)
        self.cos = cos.to(table_dtype).to(self.device)
        self.sin_signed = sin_signed.to(table_dtype).to(self.device)

    def _check_shapes(self) -> None:
        """ValueError naming the first weight whose shape is not the config's: the forward
        sizes its buffers and the C kernels' loops from the config, so a norm weight of 8
        values for a hidden size of 64 was read 56 floats past its end, and a short wqkv
        had torch.mm resize the qkv buffer under the kernels' pointers (the logits came
        out NaN, blamed on a weight that is not finite)."""
        c = self.config
        hidden, qkv = c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        want = {"embed": (c.vocab_size, hidden), "norm": (hidden,)}
        have = {"embed": self.embed, "norm": self.norm}
        if self.lm_head is not None:
            want["lm_head"], have["lm_head"] = (c.vocab_size, hidden), self.lm_head
        parts = {
            "attn_norm": (hidden,),
            "ffn_norm": (hidden,),
            "wqkv": (hidden, qkv),
            "wo": (c.num_heads * c.head_dim, hidden),
            "w_gate_up": (hidden, 2 * c.intermediate_size),
            "w_down": (c.intermediate_size, hidden),
        }
        if c.qkv_bias:
            parts["bqkv"] = (qkv,)
        if c.qk_norm:
            parts["q_norm"] = parts["k_norm"] = (c.head_dim,)
        for i, layer in enumerate(self.layers):
            if set(layer) != set(parts):
                raise ValueError(f"layer {i} holds {sorted(layer)}, not the fused parts {sorted(parts)}")
            for part, shape in parts.items():
                want[f"layers.{i}.{part}"], have[f"layers.{i}.{part}"] = shape, layer[part]
        for name, shape in want.items():
            t = have[name]
            if tuple(t.shape) != shape or t.dtype != self.dtype:
                raise ValueError(
                    f"weight {name} is {list(t.shape)} {t.dtype}, but the config needs {list(shape)} {self.dtype}"
                )

    @staticmethod
    def fuse_layer(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One layer's GGUF tensors (HF names, [out, in]) in the fused [in, out] layout."""
        bias = {"bqkv": torch.cat([parts["q_bias"], parts["k_bias"], parts["v_bias"]])} if "q_bias" in parts else {}
        bias |= {p: parts[p].contiguous() for p in QK_NORM_PARTS if p in parts}
        return bias | {
            "attn_norm": parts["attn_norm"].contiguous(),
            "ffn_norm": parts["ffn_norm"].contiguous(),
            "wqkv": torch.cat([parts["q"], parts["k"], parts["v"]], dim=0).t().contiguous(),
            "wo": parts["o"].t().contiguous(),
            "w_gate_up": torch.cat([parts["gate"], parts["up"]], dim=0).t().contiguous(),
            "w_down": parts["down"].t().contiguous(),
        }

    @classmethod
    def from_tensors(
        cls,
        config: LlamaConfig,
        tensors: Iterable[tuple[str, torch.Tensor]],
        device: str | torch.device = "cpu",
        kernels: CpuKernels | None = None,
    ) -> LlamaModel:
        """The model from (HF-style name, tensor) pairs as a GGUF stores them ("embed",
        "norm", "lm_head", "layers.{i}.{q,k,v,...}"), fusing each layer as soon as its parts
        are in: at most one layer's unfused tensors are held at a time (plus the file's
        order's stragglers). ValueError for a tensor missing from the stream."""
        wanted = layer_parts(config)
        staged: dict[int, dict[str, torch.Tensor]] = {}
        layers: dict[int, dict[str, torch.Tensor]] = {}
        top: dict[str, torch.Tensor] = {}
        for name, tensor in tensors:
            if name.startswith("layers."):
                _, index, part = name.split(".")
                i = int(index)
                staged.setdefault(i, {})[part] = tensor
                if len(staged[i]) == len(wanted):
                    layers[i] = cls.fuse_layer(staged.pop(i))
            else:
                top[name] = tensor
        missing = [f"layers.{i}.{p}" for i, parts in staged.items() for p in wanted if p not in parts]
        missing += [f"layers.{i}" for i in range(config.num_layers) if i not in layers and i not in staged]
        missing += [n for n in ("embed", "norm") if n not in top]
        if missing:
            raise ValueError(f"lacks tensors {missing[:6]}")
        lm_head = None if config.tie_embeddings else top.get("lm_head")
        if not config.tie_embeddings and lm_head is None:
            raise ValueError("lacks tensor output.weight (the LM head) and does not tie it to the embedding")
        return cls(
            config, top["embed"], top["norm"], [layers[i] for i in range(config.num_layers)], lm_head, device, kernels
        )

    FUSED_PARTS = ("attn_norm", "ffn_norm", "wqkv", "wo", "w_gate_up", "w_down")

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every weight in the stored layout, by name (for the weight cache)."""
        state = {"embed": self.embed, "norm": self.norm}
        if self.lm_head is not None:
            state["lm_head"] = self.lm_head
        for i, layer in enumerate(self.layers):
            state.update({f"layers.{i}.{k}": v for k, v in layer.items()})
        return state

    @classmethod
    def from_state(
        cls,
        config: LlamaConfig,
        state: dict[str, torch.Tensor],
        device: str | torch.device = "cpu",
        kernels: CpuKernels | None = None,
    ) -> LlamaModel:
        """The model from `state_tensors()`' names and layout (no copy: tensors are used as
        they are, e.g. memory-mapped from the weight cache)."""
        fused = cls.FUSED_PARTS + (("bqkv",) if config.qkv_bias else ()) + (QK_NORM_PARTS if config.qk_norm else ())
        layers = [{k: state[f"layers.{i}.{k}"] for k in fused} for i in range(config.num_layers)]
        lm_head = None if config.tie_embeddings else state["lm_head"]
        return cls(config, state["embed"], state["norm"], layers, lm_head, device, kernels)

    def astype(self, dtype: torch.dtype) -> LlamaModel:
        """The same weights in another dtype (fp64: the oracle's twin); torch layers only,
        the C kernels are fp32."""
        return LlamaModel(
            self.config,
            self.embed.to(dtype),
            self.norm.to(dtype),
            [{k: v.to(dtype) for k, v in layer.items()} for layer in self.layers],
            None if self.lm_head is None else self.lm_head.to(dtype),
            self.device,
            self.kernels if dtype == torch.float32 else None,
        )

    def forward_buffer_bytes(self, num_tokens: int) -> int:
        """The step buffers `forward` allocates for `num_tokens` tokens: the residual stream
        x, the normed input and the delta [N, hidden] each, qkv [N, (H + 2 KVH) D], gate_up
        [N, 2 I] and act [N, I] (the fused path makes exactly these once; the plain path
        makes tensors of the same shapes a layer at a time)."""
        cfg = self.config
        width = 3 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + 3 * cfg.intermediate_size
        return num_tokens * width * self.dtype.itemsize

    def weight_bytes(self) -> int:
        """Bytes of every weight tensor the model holds (the tied embedding once)."""
        tensors = [self.embed, self.norm, *(t for layer in self.layers for t in layer.values())]
        if self.lm_head is not None:
            tensors.append(self.lm_head)
        return sum(t.nbytes for t in tensors)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE, x [N, heads, D]; cos, sin_signed [N, 1, D]:
        x * cos + [-x2 | x1] * sin  ==  x * cos + [x2 | x1] * [-sin | sin].
        Swapping the halves is one flip of a [.., 2, D / 2] view: three kernels, not five."""
        n, heads, d = x.shape
        swapped = x.view(n, heads, 2, d // 2).flip(2).view(n, heads, d)
        return torch.addcmul(x * cos, swapped, sin_signed)

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, metadata: StepMetadata, fused: bool = True
    ) -> torch.Tensor:
        """token_ids, positions: [N] int64 (flat tokens of the step); each layer attends
        through `metadata.attention.attend(layer, q [N, H, D], k / v [N, KVH, D])` (RoPE
        applied) -> [N, H, D]. Returns the logits of `metadata.logit_rows` (None: every
        row), [rows, vocab] as `logits` computes them. fused=False forces the plain torch
        path even when the kernels are loaded (the oracle's)."""
        metadata.check(token_ids, positions)
        cfg = self.config
        # the bound from the host when the caller knows it: reading the tensor synchronises
        top = metadata.max_position if metadata.max_position is not None else int(positions.max())
        if top >= cfg.max_position:
            raise ValueError(f"position {top} exceeds the model's context {cfg.max_position}")
        attend = metadata.attention.attend
        if fused and self.kernels is not None:
            hidden = self._forward_fused(token_ids, positions, attend)
        else:
            hidden = self._forward_plain(token_ids, positions, attend)
        return self.logits(metadata.logit_hidden(hidden))

    def _forward_plain(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The layers in torch ops, one layer's tensors at a time -> hidden [N, hidden]."""
        cfg = self.config
        n = token_ids.shape[0]
        self.step_buffer_bytes = self.forward_buffer_bytes(n)  # tensors of these shapes, made a layer at a time
        h, kvh, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        qk_norm = cfg.qk_norm
        cos = self.cos[positions].unsqueeze(1).to(self.dtype)
        sin = self.sin_signed[positions].unsqueeze(1).to(self.dtype)
        x = self.embed[token_ids]
        for i, layer in enumerate(self.layers):
            hs = _rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
            qkv = hs @ layer["wqkv"]  # [N, (H + 2 KVH) * D]
            if "bqkv" in layer:
                qkv += layer["bqkv"]  # (in place: the product is this step's own tensor)
            qk = qkv[:, : (h + kvh) * d].view(n, h + kvh, d)
            if qk_norm:  # Qwen3: each head's q and k normed over D, before RoPE
                qk = torch.cat(
                    [_rms_norm(qk[:, :h], layer["q_norm"], eps), _rms_norm(qk[:, h:], layer["k_norm"], eps)], 1
                )
            # RoPE on q and k together: [N, H + KVH, D]
            qk = self._rope(qk, cos, sin)
            q, k = qk[:, :h], qk[:, h:]
            v = qkv[:, (h + kvh) * d :].view(n, kvh, d)
            attn = attend(i, q, k, v.contiguous())
            delta = attn.reshape(n, h * d) @ layer["wo"]
            if self.reduce is not None:
                self.reduce(delta)
            x = x + delta
            hs = _rms_norm(x, layer["ffn_norm"], cfg.rms_norm_eps)
            gate_up = hs @ layer["w_gate_up"]
            gate, up = gate_up.chunk(2, dim=-1)
            delta = (F.silu(gate) * up) @ layer["w_down"]
            if self.reduce is not None:
                self.reduce(delta)
            x = x + delta
        return _rms_norm(x, self.norm, cfg.rms_norm_eps)

    def _forward_fused(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The same layers with the C kernels between the matmuls, into buffers made once per
        step: a layer is 4 matmuls (out=) and 4 calls, x += o fused into the next norm.
            hs = norm(x); qkv = hs @ wqkv; (Qwen3: norm each q / k head); rope(q, k) in place; attn = attend(q, k, v)
            x += attn @ wo; hs = norm(x); act = silu(gate) * up; x += act @ w_down
        Returns hidden [N, hidden]. The kernels run unchecked (`kernels.lib`) on buffers
        made here, all contiguous fp32; positions were range-checked by `forward`. q / k / v
        are the same views of the qkv buffer for every layer, so an attend can validate them
        once per step."""
        cfg, lib = self.config, self.kernels.lib  # type: ignore[union-attr]
        n = token_ids.shape[0]
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        hidden, inter, eps = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps
        positions = positions.to(torch.long).contiguous()
        if int(positions.min()) < 0:
            raise ValueError(f"negative position {int(positions.min())}")
        x = self.embed[token_ids]  # [N, hidden], a fresh tensor: the residual stream
        hs, delta = torch.empty_like(x), torch.empty_like(x)
        qkv = x.new_empty(n, (h + 2 * kvh) * d)
        gate_up = x.new_empty(n, 2 * inter)
        act = x.new_empty(n, inter)
        q = qkv[:, : h * d].view(n, h, d)
        k = qkv[:, h * d : (h + kvh) * d].view(n, kvh, d)
        v = qkv[:, (h + kvh) * d :].view(n, kvh, d)
        buffers = (x, hs, delta, qkv, gate_up, act)
        self.step_buffer_bytes = sum(t.nbytes for t in buffers)
        xp, hsp, dp, qkvp, gup, actp = (t.data_ptr() for t in buffers)
        posp, cosp, sinp = positions.data_ptr(), self.cos.data_ptr(), self.sin_signed.data_ptr()
        norms = self._norm_ptrs  # attn_norm of each layer, then the final norm
        qk_norms = self._qk_norm_ptrs if cfg.qk_norm else None  # (Qwen3's q / k norm weights of each layer)
        lib.kv_add_rms_norm(xp, None, norms[0], hsp, n, hidden, eps)
        for i, layer in enumerate(self.layers):
            if "bqkv" in layer:
                torch.addmm(layer["bqkv"], hs, layer["wqkv"], out=qkv)
            else:
                torch.mm(hs, layer["wqkv"], out=qkv)
            if qk_norms is not None:
                lib.kv_head_rms_norm(qkvp, n, qkv.shape[1], h, kvh, d, *qk_norms[i], eps)
            if lib.kv_rope(qkvp, n, qkv.shape[1], h + kvh, d, posp, cosp, sinp, cfg.max_position):
                # (a metadata.max_position below the true largest position skipped forward's check,
                # and the kernel's refusal left q and k unrotated without a word)
                raise ValueError(f"a position lies past the model's context {cfg.max_position}")
            attn = attend(i, q, k, v)
            torch.mm(attn.reshape(n, h * d), layer["wo"], out=delta)
            if self.reduce is not None:
                self.reduce(delta)
            lib.kv_add_rms_norm(xp, dp, self._ffn_norm_ptrs[i], hsp, n, hidden, eps)
            torch.mm(hs, layer["w_gate_up"], out=gate_up)
            lib.kv_silu_mul(gup, actp, n, inter)
            torch.mm(act, layer["w_down"], out=delta)
            if self.reduce is not None:
                self.reduce(delta)
            lib.kv_add_rms_norm(xp, dp, norms[i + 1], hsp, n, hidden, eps)  # x += delta; next layer's norm
        return hs

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, hidden] -> logits [M, vocab] in fp32 (fp64 for an fp64 model, whose
        logits are the exactness oracle and must not be rounded to fp32)."""
        w = self.embed if self.lm_head is None else self.lm_head  # [vocab, hidden]
        if self.kernels is not None:
            out = hidden.new_empty(hidden.shape[0], w.shape[0])
            return self.kernels.row_dots(hidden.contiguous(), w, out)
        logits = torch.mm(w, hidden.t()).t()  # [vocab, hidden] @ [hidden, M]: faster than hidden @ w.T
        return logits if logits.dtype == torch.float64 else logits.float()
