"""What a model's KV and recurrent state take per token, from its config.json (before
loading) or from its probed cache layout (after): ``CacheShape``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from serve_app.kvquant.format import KVQuant

if TYPE_CHECKING:
    from serve_app.cache.layout import Layout

KV_STEP_TOKENS = 256  # mlx-lm's KVCache (and BatchKVCache) allocate in steps of 256 tokens


# Model types whose caches mix attention (KV) and Gated DeltaNet (fixed state) layers,
# marked as mlx-lm marks them: layer i is linear unless (i + 1) % full_attention_interval
# == 0 (mlx_lm/models/qwen3_next.py, qwen3_5.py).
GDN_HYBRID_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe"})


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of an activation dtype named as in config.json."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown activation dtype {dtype!r}; known: "
                         f"{', '.join(DTYPE_BYTES)}") from None


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


@dataclass(frozen=True)
class CacheShape:
    """What one sequence's cache costs: bytes that grow with each token (keys and values
    of the attention layers) and bytes fixed per sequence (recurrent state of the linear-
    attention layers: conv state in the activation dtype, SSM state in float32)."""

    kv_bytes_per_token: int
    state_bytes_per_sequence: int = 0
    attention_layers: int = 0
    recurrent_layers: int = 0
    dtype: str = ""
    kv_format: str = "float"  # or the quantized format (``q8g64``)
    # What a token's K/V would take as float (the same as kv_bytes_per_token for float).
    float_kv_bytes_per_token: int = 0

    @property
    def kv_ratio(self) -> float:
        """Bytes of a token's K/V in this format over float's (1.0 for float)."""
        base = self.float_kv_bytes_per_token or self.kv_bytes_per_token
        return self.kv_bytes_per_token / base if base else 1.0

    def bytes_for(self, sequences: int, tokens: int, step: int = KV_STEP_TOKENS) -> int:
        """KV and state of ``sequences`` sequences of ``tokens`` tokens each, with the KV
        buffers rounded up to mlx-lm's allocation step (``step=1``: the tokens only)."""
        return sequences * (self.kv_bytes_per_token * round_up(tokens, step)
                            + self.state_bytes_per_sequence)


def _text_config(config: dict) -> dict:
    """Qwen3.5 (and other multimodal checkpoints) nest the language model's keys."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def _need(config: dict, key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json: {key}: a positive integer is needed to plan the KV "
                         f"cache (got {value!r})")
    return value


def config_dtype(config: dict) -> str | None:
    """The activation dtype config.json names (``torch_dtype``, or ``dtype`` in newer
    transformers), if any."""
    text = _text_config(config)
    for key in ("torch_dtype", "dtype"):
        value = text.get(key) or config.get(key)
        if isinstance(value, str) and value in DTYPE_BYTES:
            return value
    return None


def cache_shape_from_config(config: dict, dtype: str | None = None,
                            kv_quant: KVQuant | None = None) -> CacheShape:
    """A model's cache bytes from its config.json alone (no weights loaded).

    ``dtype`` is the activation dtype (what the weights compute in: the embedding's, or
    its quantization scales'); default the config's, else bfloat16 as on mlx-community
    checkpoints. Attention layers keep ``num_key_value_heads x head_dim`` keys and as
    many values per token. On GDN hybrids (``GDN_HYBRID_TYPES``) each linear layer
    instead keeps per sequence a conv state ``(kernel - 1) x (2 key_dim + value_dim)`` in
    the activation dtype and an SSM state ``Hv x Dv x Dk`` in float32
    (``mlx_lm/models/gated_delta.py``). Other architectures are planned as if every layer
    were full attention: an upper bound for sliding-window models. ``kv_quant``: the
    profile's ``kv_cache`` format, whose words, scales and biases replace float K/V.
    """
    text = _text_config(config)
    dtype = dtype or config_dtype(config) or "bfloat16"
    act = dtype_bytes(dtype)
    layers = _need(text, "num_hidden_layers")
    heads = _need(text, "num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or _need(text, "hidden_size") // heads
    model_type = str(config.get("model_type", ""))
    if model_type in GDN_HYBRID_TYPES:
        interval = text.get("full_attention_interval") or 4
        recurrent = sum(1 for i in range(layers) if (i + 1) % interval != 0)
        k_heads, v_heads = (_need(text, "linear_num_key_heads"),
                            _need(text, "linear_num_value_heads"))
        k_dim, v_dim = _need(text, "linear_key_head_dim"), _need(text, "linear_value_head_dim")
        kernel = text.get("linear_conv_kernel_dim") or 4
        conv = (kernel - 1) * (2 * k_heads * k_dim + v_heads * v_dim) * act
        ssm = v_heads * v_dim * k_dim * 4  # float32 whatever the activations
        state = recurrent * (conv + ssm)
    else:
        recurrent, state = 0, 0
    attention = layers - recurrent
    values = attention * 2 * kv_heads * head_dim
    per_token = values * act if kv_quant is None else \
        int(values * kv_quant.bytes_per_value(dtype))
    return CacheShape(kv_bytes_per_token=per_token,
                      state_bytes_per_sequence=state, attention_layers=attention,
                      recurrent_layers=recurrent, dtype=dtype,
                      kv_format=kv_quant.name if kv_quant else "float",
                      float_kv_bytes_per_token=values * act)


def cache_shape_from_layout(layout: Layout) -> CacheShape:
    """The same from a loaded model's probed layout (``serve_app/cache/layout.py``):
    exact for any architecture the prefix cache supports. A replica can plan with this
    once its model is loaded."""
    from serve_app.cache.layout import KV, RECURRENT

    dtypes = {a.dtype for layer, kind in zip(layout.arrays, layout.kinds, strict=True)
              if kind == KV for a in layer}
    float_per_token = layout.block_nbytes(1)
    if layout.kv_quant is not None:  # the same values as float, in the scales' dtype
        float_per_token = sum(
            layout.kv_quant.head_dim(a.shape[-1], layout.kv_scale_dtype) * (a.shape[1] or 0)
            * dtype_bytes(layout.kv_scale_dtype)
            for layer, kind in zip(layout.arrays, layout.kinds, strict=True) if kind == KV
            for a in layer if isinstance(a.shape[-1], int))
        dtypes = {layout.kv_scale_dtype}
    return CacheShape(kv_bytes_per_token=layout.block_nbytes(1),
                      state_bytes_per_sequence=layout.state_nbytes(),
                      attention_layers=layout.kinds.count(KV),
                      recurrent_layers=layout.kinds.count(RECURRENT),
                      dtype=",".join(sorted(dtypes)),
                      kv_format=layout.kv_quant.name if layout.kv_quant else "float",
                      float_kv_bytes_per_token=float_per_token)
