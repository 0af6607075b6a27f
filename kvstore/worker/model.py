"""The model side of the reference worker: a Llama decoder's weights and its forward pass over
a ``PagedKVCache``.

``LlamaWeights.from_hf`` takes the tensors of a transformers ``LlamaForCausalLM`` (no copies);
``forward`` runs one scheduler step's tokens, prefill and decode together, writing their K/V into
the paged cache and returning the logits the sampler needs. Numerics follow transformers' Llama
(RMSNorm statistics in float32, RoPE angles in float32), so in float32 the logits agree with
transformers' to about 1e-5 and greedy tokens are identical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kvstore.paged import PagedKVCache, SeqId

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

# RoPE variants whose frequencies depend on the length of the sequence seen so far: transformers
# recomputes them per forward pass, which a paged cache of keys stored after the rotation cannot
# follow (keys computed at one length would not match keys computed at another).
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One decoder layer's tensors (views of the transformers parameters, not copies)."""

    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class LlamaWeights:
    """The weights and hyperparameters of a Llama-architecture decoder, read from a transformers
    model; immutable and shared read-only by whoever runs the forward pass.

    RoPE comes from the config (``rope_parameters``: ``rope_theta`` and any static scaling such
    as ``llama3``, ``linear`` or ``yarn``), computed the way transformers computes it, so keys
    are rotated bit for bit as transformers rotates them.
    """

    embed: torch.Tensor
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor
    lm_head: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    inv_freq: torch.Tensor
    rope_scale: float
    act: Callable[[torch.Tensor], torch.Tensor]
    config: Any = field(repr=False)

    @classmethod
    def from_hf(cls, model: Any) -> LlamaWeights:
        """Take the weights of a transformers ``LlamaForCausalLM`` (any dtype or device)."""
        config = model.config
        if getattr(config, "model_type", None) != "llama":
            raise ValueError(f"expected a Llama model, got model_type {config.model_type!r}")
        act = _ACTIVATIONS.get(config.hidden_act)
        if act is None:
            raise ValueError(f"unsupported activation {config.hidden_act!r}")
        base = model.model

        def w(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach()

        layers = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(
                LayerWeights(
                    input_norm=layer.input_layernorm.weight.detach(),
                    q=attn.q_proj.weight.detach(),
                    k=attn.k_proj.weight.detach(),
                    v=attn.v_proj.weight.detach(),
                    o=attn.o_proj.weight.detach(),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    gate=mlp.gate_proj.weight.detach(),
                    up=mlp.up_proj.weight.detach(),
                    down=mlp.down_proj.weight.detach(),
                    q_bias=w(attn.q_proj.bias),
                    k_bias=w(attn.k_proj.bias),
                    v_bias=w(attn.v_proj.bias),
                    o_bias=w(attn.o_proj.bias),
                    gate_bias=w(mlp.gate_proj.bias),
                    up_bias=w(mlp.up_proj.bias),
                    down_bias=w(mlp.down_proj.bias),
                )
            )
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        inv_freq, rope_scale = _rope_frequencies(config, head_dim)
        embed = base.embed_tokens.weight.detach()
        return cls(
            embed=embed,
            layers=tuple(layers),
            norm=base.norm.weight.detach(),
            lm_head=model.lm_head.weight.detach(),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            rms_eps=float(config.rms_norm_eps),
            inv_freq=inv_freq.to(embed.device),
            rope_scale=rope_scale,
            act=act,
            config=config,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device


def _rope_frequencies(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] in float32, cos/sin scale) for the config's RoPE."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:  # configs of older transformers keep them at the top level
        params = {"rope_type": "default", "rope_theta": getattr(config, "rope_theta", 10000.0)}
        params.update(getattr(config, "rope_scaling", None) or {})
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        raise ValueError(f"RoPE type {rope_type!r} depends on the sequence length: unsupported")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings are not Llama's: unsupported")
    if rope_type == "default":
        # transformers' default: the same expression, so the same float32 values.
        base = float(params["rope_theta"])
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers' LlamaRMSNorm: statistics in float32, the weight applied in the input dtype.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[tokens, heads, D]`` with per-token ``cos``/``sin`` ``[tokens, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def forward(
    w: LlamaWeights,
    cache: PagedKVCache,
    prefills: Sequence[tuple[SeqId, int, Sequence[int]]],
    decodes: Sequence[tuple[SeqId, int]],
    *,
    every_prefill_token: bool = False,
) -> torch.Tensor:
    """Logits ``[len(prefills) + len(decodes), vocab]``: of each prefill's last prompt token
    and of each decode token, in that order. With ``every_prefill_token``, of every computed
    prefill token instead of only the last (for perplexity), then the decode tokens'.

    ``prefills``: (sequence, first token to compute, prompt); tokens before ``start`` have
    their K/V in the cache already. ``decodes``: (sequence, its last token), whose slot
    ``append_tokens`` already made (the sequence's last position). Writes the new tokens' K/V
    into ``cache`` in every layer; the caller commits them. Call it under ``torch.no_grad()``."""
    dev, dtype = w.device, w.dtype
    hq, hkv, d = w.num_heads, w.num_kv_heads, w.head_dim
    tokens: list[int] = []
    positions: list[int] = []
    segments: list[tuple[SeqId, int, int, int]] = []  # (seq, start, offset in batch, length)
    for seq, start, prompt in prefills:
        segments.append((seq, start, len(tokens), len(prompt) - start))
        tokens += list(prompt[start:])
        positions += range(start, len(prompt))
    n_pre = len(tokens)
    dec_seqs = [seq for seq, _ in decodes]
    for seq, token in decodes:
        tokens.append(token)
        positions.append(cache.num_tokens(seq) - 1)
    n = len(tokens)
    ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
    pos = torch.tensor(positions, dtype=torch.int64, device=dev)
    # As transformers' LlamaRotaryEmbedding: float32 angles, cast to the model dtype.
    freqs = pos[:, None].float() * w.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * w.rope_scale).to(dtype)
    sin = (emb.sin() * w.rope_scale).to(dtype)
    # A prefill whose prefix is cached attends to all of it: the causal mask is offset by
    # ``start`` (SDPA's is_causal would align it to the top left, wrongly).
    masks = [
        None
        if start == 0
        else torch.arange(start + m, device=dev)[None, :]
        <= torch.arange(start, start + m, device=dev)[:, None]
        for _, start, _, m in segments
    ]
    if decodes:
        tail = cache.tail_slots(dec_seqs)
        tables = cache.block_table_tensor(dec_seqs)
        lens = cache.seq_lens_tensor(dec_seqs)
    scale = d**-0.5
    group = hq // hkv
    x = F.embedding(ids, w.embed)
    for li, lw in enumerate(w.layers):
        h = rms_norm(x, lw.input_norm, w.rms_eps)
        q = rotate(F.linear(h, lw.q, lw.q_bias).view(n, hq, d), cos, sin)
        k = rotate(F.linear(h, lw.k, lw.k_bias).view(n, hkv, d), cos, sin)
        v = F.linear(h, lw.v, lw.v_bias).view(n, hkv, d)
        attn = torch.empty_like(q)
        for (seq, start, off, m), mask in zip(segments, masks, strict=True):
            cache.write_kv(seq, li, start, k[off : off + m], v[off : off + m])
            # Attend over what the cache holds (an FP8 cache's values dequantized), so a prompt
            # computed here and one whose prefix came from the store see the same K/V.
            keys, values = cache.sequence_kv(seq, li, dtype)
            if group > 1:
                # SDPA's enable_gqa needs torch 2.5; the project supports 2.4.
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(
                q[off : off + m].transpose(0, 1)[None],
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
            )
            attn[off : off + m] = out[0].transpose(0, 1)
        if decodes:
            # Every decode token's slot is in its sequence's private, uncommitted tail
            # block (append_tokens copied it if it was shared), so all of them are written
            # at once instead of a write_kv per sequence.
            cache.write_tail(tail, li, k[n_pre:], v[n_pre:])
            attn[n_pre:] = cache.decode_attention(q[n_pre:].contiguous(), li, tables, lens, scale)
        x = x + F.linear(attn.view(n, hq * d), lw.o, lw.o_bias)
        h = rms_norm(x, lw.post_norm, w.rms_eps)
        gated = w.act(F.linear(h, lw.gate, lw.gate_bias)) * F.linear(h, lw.up, lw.up_bias)
        x = x + F.linear(gated, lw.down, lw.down_bias)
    if every_prefill_token:
        last = list(range(n))
    else:
        last = [off + m - 1 for _, _, off, m in segments] + list(range(n_pre, n))
    out_rows = rms_norm(x[last], w.norm, w.rms_eps)
    return F.linear(out_rows, w.lm_head)
