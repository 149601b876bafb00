"""Scaled RoPE (models/rope.py): linear and Llama 3 scaling from a config.json, and Llama 3.1's
rope_freqs.weight and a linear rope.scaling.factor from a GGUF, against transformers'
LlamaForCausalLM on the same random weights.

The reference. transformers computes RoPE's inverse frequencies (its own formula for each
rope_type, modeling_rope_utils) and the angles in fp32 whatever the model's dtype, and its
RMSNorm in fp32. The fp64 reference runs transformers' own frequency functions with their
`torch.float` read as fp64 (`_Fp64Torch`), its rotary embedding's angles in fp64, and its
norms without the casts; everything else is transformers' forward as it is. Our model
computes the same function by its own code (models/rope.py), so in fp64 the logits agree to
rounding (~1e-15 here; TOL64 = 1e-10). fp32: within C_FP32 times transformers' own fp32
error against that fp64 reference, measured on the same tokens.

The bands. original_max_position_embeddings 64 with low / high_freq_factor 1 / 4 puts the
head dim 16's 8 wavelengths (2 pi 10000^(2i/16): 6.3, 19.9, 62.8, 199, ...) in all three
Llama 3 bands: kept (< 16), blended (16 .. 64: two of them) and divided by the factor (> 64),
and the sequences here run to position ~200, far past the original context.

A GGUF stores the factors in F32 (llama.cpp's converter rounds them), so the GGUF's model is
held to transformers' model with the frequencies llama.cpp computes from that file,
theta^(-2i/D) / rope_freqs[i]; the file's factors are checked against transformers' Llama 3
frequencies to F32 rounding separately."""

from __future__ import annotations

import json
import math
import re
import warnings

import gguf
import numpy as np
import pytest
import torch

from kvpool.attention.reference import reference_logits
from kvpool.cache import CacheDescriptor
from kvpool.engine.build import build_engine, descriptor_for, load_model
from kvpool.engine.sampling import SamplingParams
from kvpool.models.gguf import load_gguf
from kvpool.models.hf_config import hf_tensor_name, llama_config, random_llama, random_tensors
from kvpool.models.llama import LlamaModel
from kvpool.models.rope import inv_freq, llama3_divisors
from random_llama import LLAMA3_SCALING, TINY_HF_LLAMA

transformers = pytest.importorskip("transformers")
from transformers import modeling_rope_utils  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TOL64 = 1e-10
# our fp32 error over transformers' own (both round the same residual stream): measured at
# most 0.93 (contiguous, both paths) and 0.82 (the engine); 3 as tests/test_model.py's C_FP32
C_FP32 = 3.0
LLAMA3 = LLAMA3_SCALING
RAW = {**TINY_HF_LLAMA, "rope_scaling": LLAMA3}
HEAD_DIM = 16
SEED = 5
IDS = torch.randint(0, 300, (210,), generator=torch.Generator().manual_seed(1)).tolist()


class _Fp64Torch:
    """torch, with `torch.float` meaning fp64: transformers' frequency functions create their
    tensors `dtype=torch.float`, so under this they compute their own formula in fp64."""

    float = torch.float64

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _rotary_fp64(self, x, position_ids):
    """LlamaRotaryEmbedding.forward with the angles in fp64 (transformers': fp32)."""
    angles = position_ids[..., None].double() * self.inv_freq.double()
    emb = torch.cat((angles, angles), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _norm_in_input_dtype(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def hf_model(raw: dict, dtype: torch.dtype, inv_freq_override: torch.Tensor | None = None):
    """transformers' Llama of `raw` holding random_tensors(SEED) (our random_llama's weights),
    in `dtype`; fp64 as the module docstring says. inv_freq_override: its frequencies [D/2]
    replaced (a GGUF's, as llama.cpp computes them)."""
    cfg = llama_config_of(raw)
    with pytest.MonkeyPatch.context() as patch:
        if dtype == torch.float64:
            patch.setattr(modeling_rope_utils, "torch", _Fp64Torch())
        model = modeling_llama.LlamaForCausalLM(transformers.LlamaConfig(**raw)).to(dtype).eval()
    if dtype == torch.float64:
        assert model.model.rotary_emb.inv_freq.dtype == torch.float64  # made in fp64, not cast from fp32
    if inv_freq_override is not None:
        model.model.rotary_emb.inv_freq = inv_freq_override.to(dtype)
    state = {hf_tensor_name(n): t for n, t in random_tensors(cfg, SEED, dtype)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not missing
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[T, vocab] fp64; an fp64 model runs the module docstring's fp64 reference."""
    fp64 = next(model.parameters()).dtype == torch.float64
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        if fp64:
            patch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", _rotary_fp64)
            patch.setattr(modeling_llama.LlamaRMSNorm, "forward", _norm_in_input_dtype)
        return model(torch.tensor([ids])).logits[0].double()


_CONFIGS: dict[str, object] = {}


def llama_config_of(raw: dict):
    key = json.dumps(raw, sort_keys=True)
    if key not in _CONFIGS:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            path = f"{d}/config.json"
            with open(path, "w") as f:
                f.write(key)
            _CONFIGS[key] = llama_config(path).config
    return _CONFIGS[key]


SCALINGS = {
    "llama3": LLAMA3,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "linear-v4-type": {"type": "linear", "factor": 2.5},  # transformers 4's key
}


def test_llama3_divisors_fall_in_all_three_bands():
    divisors = llama3_divisors(HEAD_DIM, 10000.0, 8.0, 1.0, 4.0, 64)
    assert divisors[0] == 1.0 and all(d == 8.0 for d in divisors[3:])
    assert all(1.0 < d < 8.0 for d in divisors[1:3])
    # transformers' own Llama 3 frequencies (fp64, module docstring): the same, to rounding
    hf = transformers.LlamaConfig(**{k: v for k, v in RAW.items() if k != "model_type"})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_rope_utils, "torch", _Fp64Torch())
        theirs, _ = modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](hf)
    ours = inv_freq(HEAD_DIM, 10000.0, divisors)
    assert theirs.dtype == torch.float64 and torch.allclose(ours, theirs, rtol=1e-15, atol=0)


def test_llama3_with_high_freq_factor_equal_to_low_is_transformers_step():
    """high == low (Llama 4's): no blended band, a step at L / low = 32 (between the
    wavelengths 19.9 and 62.8); transformers computes it (with a warning), as does llama.cpp's
    converter; refused before (review 13 #5)."""
    divisors = llama3_divisors(HEAD_DIM, 10000.0, 8.0, 2.0, 2.0, 64)
    assert divisors == (1.0, 1.0) + (8.0,) * 6
    scaling = {**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 2.0}
    hf = transformers.LlamaConfig(
        **{k: v for k, v in RAW.items() if k not in ("model_type", "rope_scaling")}, rope_scaling=scaling
    )
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patch.setattr(modeling_rope_utils, "torch", _Fp64Torch())
        theirs, _ = modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](hf)
    ours = inv_freq(HEAD_DIM, 10000.0, divisors)
    assert theirs.dtype == torch.float64 and torch.allclose(ours, theirs, rtol=1e-15, atol=0), (ours, theirs)
    # a wavelength exactly at the step (the blend's 0 / 0: transformers' NaN, a ZeroDivisionError here): kept
    edge = 2 * math.pi / inv_freq(HEAD_DIM, 10000.0, None)[2].item() * 2.0
    assert llama3_divisors(HEAD_DIM, 10000.0, 8.0, 2.0, 2.0, edge) == (1.0,) * 3 + (8.0,) * 5


@pytest.mark.parametrize("scaling", SCALINGS.values(), ids=SCALINGS.keys())
def test_config_json_fp64_logits_equal_transformers_past_the_original_context(scaling):
    raw = {**RAW, "rope_scaling": scaling}
    cfg = llama_config_of(raw)
    assert cfg.rope_freq_divisors is not None
    want = hf_logits(hf_model(raw, torch.float64), IDS)
    got = reference_logits(random_llama(cfg, seed=SEED, dtype=torch.float64), IDS, fused=False).double()
    assert want.abs().max() > 1.0
    assert (got - want).abs().max() <= TOL64 * want.abs().max()
    # and the scaling is no detail: plain RoPE on the same weights is far off past position ~20
    plain = reference_logits(
        random_llama(llama_config_of({**RAW, "rope_scaling": None}), seed=SEED, dtype=torch.float64), IDS, fused=False
    ).double()
    assert (plain - want).abs().max() > 1e-3 * want.abs().max()


@pytest.mark.parametrize("fused", [True, False], ids=["c-kernels", "plain-torch"])
def test_config_json_fp32_logits_within_transformers_own_fp32_error(fused, request):
    cfg = llama_config_of(RAW)
    truth = hf_logits(hf_model(RAW, torch.float64), IDS)
    hf_err = (hf_logits(hf_model(RAW, torch.float32), IDS) - truth).abs().max().item()
    assert 0 < hf_err < 1e-3 * truth.abs().max()
    model = random_llama(cfg, seed=SEED, dtype=torch.float32)
    if fused:
        model = LlamaModel.from_state(cfg, model.state_tensors(), kernels=request.getfixturevalue("kernels"))
    err = (reference_logits(model, IDS, fused=fused).double() - truth).abs().max().item()
    assert err <= C_FP32 * hf_err, f"{err} off fp64, transformers' fp32 {hf_err}"


# -- the GGUF ------------------------------------------------------------------------------


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (models/gguf.py's module docstring)."""
    rows, dim = w.shape
    return w.reshape(heads, 2, rows // heads // 2, dim).swapaxes(1, 2).reshape(rows, dim)


_GGUF_NAMES = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
    "attn_norm": "attn_norm",
    "ffn_norm": "ffn_norm",
}


def write_gguf(path, raw: dict, rope_freqs: np.ndarray | None, kv: dict | None = None) -> str:
    """A Llama GGUF of `raw`'s architecture holding random_tensors(SEED) in F32 (Q / K rows in
    llama.cpp's order), its RoPE: tensor rope_freqs.weight when given, metadata `kv`."""
    cfg = llama_config_of({**raw, "rope_scaling": None})
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    kv = {"llama.rope.dimension_count": cfg.head_dim, **(kv or {})}
    for key, value in kv.items():
        {str: w.add_string, float: w.add_float32, int: w.add_uint32}[type(value)](key, value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    for name, t in random_tensors(cfg, SEED, torch.float32):
        a = t.numpy()
        if name in ("embed", "norm", "lm_head"):
            w.add_tensor({"embed": "token_embd", "norm": "output_norm", "lm_head": "output"}[name] + ".weight", a)
            continue
        _, i, part = name.split(".")
        if part in ("q", "k"):
            a = _permute(a, cfg.num_heads if part == "q" else cfg.num_kv_heads)
        w.add_tensor(f"blk.{i}.{_GGUF_NAMES[part]}.weight", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def converter_factors() -> np.ndarray:
    """rope_freqs as llama.cpp's converter writes them: transformers' Llama 3 frequency
    divisors (its fp64 formula, plain / scaled), rounded to F32 [D/2]."""
    hf = transformers.LlamaConfig(**{k: v for k, v in RAW.items() if k != "model_type"})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_rope_utils, "torch", _Fp64Torch())
        scaled, _ = modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](hf)
    return (inv_freq(HEAD_DIM, 10000.0, None) / scaled).numpy().astype(np.float32)


def llama_cpp_inv_freq(factors: np.ndarray, linear: float = 1.0) -> torch.Tensor:
    """llama.cpp's frequencies from a GGUF: theta^(-2i/D) / rope_freqs[i] / factor, fp64."""
    plain = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    return plain / torch.from_numpy(factors.astype(np.float64)) / linear


@pytest.fixture(scope="module")
def llama31_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("rope") / "llama31.gguf"
    factors = converter_factors()
    return write_gguf(path, RAW, factors), factors


def test_the_converters_factors_are_transformers_llama3_frequencies_to_f32_rounding():
    factors = converter_factors().astype(np.float64)
    exact = np.array(llama3_divisors(HEAD_DIM, 10000.0, 8.0, 1.0, 4.0, 64))
    assert np.abs(factors / exact - 1).max() <= 2**-24
    assert factors[0] == 1.0 and (factors[3:] == 8.0).all() and ((factors[1:3] > 1) & (factors[1:3] < 8)).all()


def _gguf_model64(path: str) -> LlamaModel:
    meta = load_gguf(path)
    return LlamaModel.from_tensors(meta.meta.config, meta.tensors(torch.float32)).astype(torch.float64)


def test_gguf_rope_freqs_are_read_and_run_as_llama_cpp_runs_them(llama31_gguf):
    path, factors = llama31_gguf
    cfg = load_gguf(path).meta.config
    assert cfg.rope_freq_divisors == tuple(float(x) for x in factors)
    want = hf_logits(hf_model(RAW, torch.float64, llama_cpp_inv_freq(factors)), IDS)
    got = reference_logits(_gguf_model64(path), IDS, fused=False).double()
    assert (got - want).abs().max() <= TOL64 * want.abs().max()


def test_gguf_linear_scaling_factor_on_its_own_and_on_top_of_rope_freqs(tmp_path):
    linear = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    path = write_gguf(tmp_path / "linear.gguf", RAW, None, linear)
    assert load_gguf(path).meta.config.rope_freq_divisors == (4.0,) * (HEAD_DIM // 2)
    raw = {**RAW, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    want = hf_logits(hf_model(raw, torch.float64), IDS)
    got = reference_logits(_gguf_model64(path), IDS, fused=False).double()
    assert (got - want).abs().max() <= TOL64 * want.abs().max()
    # llama.cpp: no type means linear; the older key rope.scale_linear; 0 means no factor
    for kv, divisor in [
        ({"llama.rope.scaling.factor": 2.0}, 2.0),
        ({"llama.rope.scale_linear": 3.0}, 3.0),
        ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 0.0}, None),
        # type none: llama.cpp reads the factor and runs unscaled
        ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, None),
    ]:
        divisors = load_gguf(write_gguf(tmp_path / "k.gguf", RAW, None, kv)).meta.config.rope_freq_divisors
        assert divisors == (None if divisor is None else (divisor,) * (HEAD_DIM // 2)), kv
    # both: the factors divided once more
    factors = converter_factors()
    both = load_gguf(write_gguf(tmp_path / "both.gguf", RAW, factors, linear)).meta.config
    assert both.rope_freq_divisors == tuple(float(x) * 4.0 for x in factors)
    # type none with rope_freqs: the factors alone
    none = {"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}
    alone = load_gguf(write_gguf(tmp_path / "none.gguf", RAW, factors, none)).meta.config
    assert alone.rope_freq_divisors == tuple(float(x) for x in factors)


@pytest.mark.parametrize(
    ("rope_freqs", "kv", "message"),
    [
        (
            np.ones(4, dtype=np.float32),
            {},
            r"tensor 'rope_freqs.weight' is F32 \[4\]; Llama 3 RoPE factors are F32 \[8\]",
        ),
        (np.ones(8, dtype=np.float16), {}, r"tensor 'rope_freqs.weight' is F16 \[8\]; Llama 3 RoPE factors are F32"),
        (np.ones((2, 4), dtype=np.float32), {}, r"tensor 'rope_freqs.weight' is F32 \[4, 2\]; Llama 3 RoPE"),
        (
            np.array([1, 2, 0, 8, 8, 8, 8, 8], np.float32),
            {},
            r"tensor 'rope_freqs.weight' holds 0.0 at \[2\]: a RoPE frequency factor must be",
        ),
        (np.array([1, 2, np.nan, 8, 8, 8, 8, 8], np.float32), {}, r"tensor 'rope_freqs.weight' holds nan at \[2\]"),
        (None, {"llama.rope.scaling.type": "yarn"}, r"unsupported RoPE scaling llama.rope.scaling.type 'yarn'"),
        (
            None,
            {"llama.rope.scaling.factor": -2.0},
            r"GGUF metadata llama.rope.scaling.factor must be finite and positive, got -2.0",
        ),
        (
            None,
            {"llama.rope.scaling.factor": "8"},
            r"GGUF metadata llama.rope.scaling.factor must be a number, got '8'",
        ),
        # partial RoPE (a rotated part of each head): every dim was rotated without a word
        (None, {"llama.rope.dimension_count": 8}, r"GGUF metadata llama.rope.dimension_count 8 is not the head dim 16"),
    ],
    ids=["short", "f16", "2d", "zero", "nan", "yarn", "negative-factor", "string-factor", "partial"],
)
def test_a_rope_the_model_cannot_compute_is_refused_naming_it(tmp_path, rope_freqs, kv, message):
    path = write_gguf(tmp_path / "bad.gguf", RAW, rope_freqs, kv)
    with pytest.raises(ValueError, match=f"^GGUF file {re.escape(path)}: {message}"):
        load_gguf(path)


# -- the engine on the GGUF: paged, C kernels, prefix cache, weight cache ---------------------


def _engine_rows(engine, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], torch.Tensor, int]]:
    """(sequence, the logit rows the engine sampled from [new_tokens, vocab], cached prompt
    tokens) of each prompt, run one after the other (the second reuses the first's blocks)."""
    out = []
    for prompt in prompts:
        (result,) = engine.generate([prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        tokens = result.completions[0].token_ids
        rows = torch.stack(engine.requests[result.request_id].seqs[0].logits).double()
        out.append((prompt + tokens, rows, result.num_cached_tokens))
        engine.runner.check_integrity()
    return out


def _prompts() -> list[list[int]]:
    first = IDS[:150]
    return [first, first + IDS[150:190]]  # the second continues the first: a prefix-cache hit


def test_the_paged_engine_in_fp64_equals_transformers_with_a_prefix_hit(llama31_gguf):
    path, factors = llama31_gguf
    model = _gguf_model64(path)
    engine = build_engine(
        model,
        descriptor=CacheDescriptor("llama31", weights_version="x"),
        num_blocks=64,
        block_size=16,
        max_num_batched_tokens=64,
        record_logits=True,
    )
    hf = hf_model(RAW, torch.float64, llama_cpp_inv_freq(factors))
    runs = _engine_rows(engine, _prompts(), new_tokens=12)
    assert runs[1][2] >= 144  # the first prompt's full blocks served from the cache
    for (sequence, rows, _), prompt in zip(runs, _prompts(), strict=True):
        want = hf_logits(hf, sequence[:-1])[len(prompt) - 1 :]
        assert len(sequence) - 1 > 200 or len(prompt) == 150
        assert (rows - want).abs().max() <= TOL64 * want.abs().max()


def test_the_engine_in_fp32_with_the_c_kernels_and_the_weight_cache(llama31_gguf, tmp_path, monkeypatch, kernels):
    path, factors = llama31_gguf
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KVPOOL_WEIGHT_CACHE", raising=False)
    first = load_model(path, device="cpu")
    again = load_model(path, device="cpu")
    assert first.load_source.startswith("gguf") and again.load_source == "weight cache"
    assert again.model.config == first.model.config and again.model.config.rope_freq_divisors is not None
    assert again.model.kernels is not None and torch.equal(again.model.cos, first.model.cos)
    descriptor = descriptor_for(again, 16)
    assert descriptor.rope_id.startswith("rope-half:theta10000.0:div")
    engine = build_engine(again, num_blocks=64, block_size=16, max_num_batched_tokens=64, record_logits=True)
    hf64 = hf_model(RAW, torch.float64, llama_cpp_inv_freq(factors))
    hf32 = hf_model(RAW, torch.float32, llama_cpp_inv_freq(factors))
    runs = _engine_rows(engine, _prompts(), new_tokens=12)
    assert runs[1][2] >= 144
    for (sequence, rows, _), prompt in zip(runs, _prompts(), strict=True):
        exact = hf_logits(hf64, sequence[:-1])
        hf_err = (hf_logits(hf32, sequence[:-1]) - exact).abs().max().item()
        err = (rows - exact[len(prompt) - 1 :]).abs().max().item()
        assert 0 < hf_err < 1e-3 * exact.abs().max()
        assert err <= C_FP32 * hf_err, f"{err} off fp64, transformers' fp32 {hf_err}"
