"""A GPT-style decoder in Flax linen, with no dtype text: jaxamp sets the precision.

Pre-norm blocks (LayerNorm, causal self-attention, residual; LayerNorm, GELU
MLP, residual), learned position embeddings, and the output projection tied
to the token embedding (``Embed.attend``), as in GPT-2 and nanoGPT. The
attention is `jax.nn.dot_product_attention` (``cudnn`` or ``xla``) or the same
math written as two einsums (``einsum``); which one runs is a field, chosen
per backend and dtype by `choose_attention`.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

# The sizes and attention choices live with the settings (no Flax there, for the command's flags).
from experiments.lm.config import ATTENTION_CHOICES, SIZES, GPTSize

_HALF_DTYPES = (jnp.float16, jnp.bfloat16)


def choose_attention(requested: str, platform: str, compute_dtype, head_dim: int) -> str:
    """The attention implementation a model uses.

    ``auto`` picks, in order:

    * ``cudnn`` (`jax.nn.dot_product_attention`'s fused flash attention) on a
      GPU when its constraints hold: float16 or bfloat16 compute (jaxamp
      traces the model in the compute dtype, so the attention receives half
      operands whatever the params' dtype) and a head size that is a
      multiple of 8 and at most 128;
    * ``xla`` (`jax.nn.dot_product_attention`'s einsum, masked float32
      softmax, einsum) for float32 compute;
    * ``einsum`` for half compute elsewhere: the same math, but the score
      product runs in the operands' dtype. JAX's ``xla`` path asks for float32
      scores from half operands, which XLA:CPU refuses to compile for float16
      (``F16_F16_F32``, JAX 0.10 and 0.12), and whose backward multiplies the
      float32 score gradient by a half operand in float32 (4% of a tiny
      model's matmul FLOPs, more at long context).

    Args:
        requested: one of `ATTENTION_CHOICES`.
        platform: the backend compiled for (``cpu``, ``gpu``, ``tpu``).
        compute_dtype: the policy's compute dtype.
        head_dim: size of one head.

    Raises:
        ValueError: an unknown choice, or ``cudnn`` where it cannot run.
    """
    if requested not in ATTENTION_CHOICES:
        raise ValueError(
            f"--attention {requested!r} is invalid: expected one of {', '.join(ATTENTION_CHOICES)}."
        )
    half = jnp.dtype(compute_dtype) in [jnp.dtype(d) for d in _HALF_DTYPES]
    cudnn_fits = platform == "gpu" and half and head_dim % 8 == 0 and head_dim <= 128
    if requested == "cudnn" and not cudnn_fits:
        raise ValueError(
            "--attention cudnn needs a GPU, float16 or bfloat16 compute and a head size that is a "
            f"multiple of 8 up to 128; here: platform {platform}, compute {jnp.dtype(compute_dtype).name}, "
            f"head size {head_dim}. Use --attention auto."
        )
    if requested != "auto":
        return requested
    if cudnn_fits:
        return "cudnn"
    return "einsum" if half else "xla"


def einsum_attention(query: jax.Array, key: jax.Array, value: jax.Array) -> jax.Array:
    """Causal attention as two einsums in the operands' dtype, softmax in float32.

    Shapes as `jax.nn.dot_product_attention`'s: [B, T, heads, head_dim].
    """
    scale = 1.0 / math.sqrt(query.shape[-1])
    scores = jnp.einsum("btnh,bsnh->bnts", query * jnp.asarray(scale, query.dtype), key)
    length = query.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    # Masked in float32, where the large negative is representable for every
    # input dtype; the probabilities go back to the operands' dtype.
    scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
    return jnp.einsum("bnts,bsnh->btnh", probs, value)


def _dense_init(scale: float = 1.0) -> nn.initializers.Initializer:
    return nn.initializers.normal(stddev=0.02 * scale)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through `jax.nn.dot_product_attention`."""

    num_heads: int
    attention: str
    residual_scale: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d_model = x.shape[-1]
        head_dim = d_model // self.num_heads
        qkv = nn.DenseGeneral((3, self.num_heads, head_dim), kernel_init=_dense_init(), name="qkv")(x)
        query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.attention == "einsum":
            y = einsum_attention(query, key, value)
        else:
            y = jax.nn.dot_product_attention(query, key, value, is_causal=True, implementation=self.attention)
        return nn.DenseGeneral(
            d_model, axis=(-2, -1), kernel_init=_dense_init(self.residual_scale), name="out"
        )(y)


class MLP(nn.Module):
    """Two dense layers with a GELU between, four times wider inside."""

    residual_scale: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d_model = x.shape[-1]
        x = nn.gelu(nn.Dense(4 * d_model, kernel_init=_dense_init(), name="up")(x))
        return nn.Dense(d_model, kernel_init=_dense_init(self.residual_scale), name="down")(x)


class Block(nn.Module):
    """One pre-norm transformer block."""

    num_heads: int
    attention: str
    residual_scale: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + CausalSelfAttention(self.num_heads, self.attention, self.residual_scale, name="attn")(
            nn.LayerNorm(name="ln_attn")(x)
        )
        return x + MLP(self.residual_scale, name="mlp")(nn.LayerNorm(name="ln_mlp")(x))


class GPT(nn.Module):
    """A GPT-style decoder: tokens [B, T] (int) -> logits [B, T, vocab_size].

    Attributes:
        vocab_size: number of token ids (256 for bytes).
        size: depth, width, heads and the longest context.
        attention: ``cudnn``, ``xla`` or ``einsum`` (see `choose_attention`).
        scan_layers: run the blocks as one block scanned over the layers
            (``flax.linen.scan``, as MaxText's ``scan_layers``): their params
            stacked along a leading axis of ``num_layers`` under
            ``params["blocks"]``, and one block's program compiled for all.
            False: one module per layer, ``block0`` to ``block{n-1}``.
    """

    vocab_size: int
    size: GPTSize
    attention: str = "xla"
    scan_layers: bool = False

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        length = tokens.shape[1]
        if length > self.size.context:
            raise ValueError(
                f"A sequence of {length} tokens exceeds the model's context of {self.size.context}."
            )
        embed = nn.Embed(self.vocab_size, self.size.d_model, embedding_init=_dense_init(), name="embed")
        positions = self.param("positions", _dense_init(0.5), (self.size.context, self.size.d_model))
        x = embed(tokens) + positions[:length]
        # GPT-2's scaling of the residual projections: the residual stream's
        # variance stays flat with depth.
        residual_scale = 1.0 / math.sqrt(2 * self.size.num_layers)
        if self.scan_layers:
            scanned = nn.scan(
                lambda block, x, _: (block(x), None),
                variable_axes={True: 0},  # every collection (params, FP8 scaling state) per layer
                split_rngs={"params": True},
                length=self.size.num_layers,
            )
            x, _ = scanned(Block(self.size.num_heads, self.attention, residual_scale, name="blocks"), x, None)
        else:
            for layer in range(self.size.num_layers):
                x = Block(self.size.num_heads, self.attention, residual_scale, name=f"block{layer}")(x)
        x = nn.LayerNorm(name="ln_final")(x)
        return embed.attend(x)


def create_model(size: str, vocab_size: int, attention: str = "xla", scan_layers: bool = False) -> GPT:
    """The model of a named size (a key of `SIZES`), its blocks scanned over when `scan_layers`."""
    if size not in SIZES:
        raise ValueError(f"--model {size!r} is invalid: expected one of {', '.join(SIZES)}.")
    return GPT(vocab_size=vocab_size, size=SIZES[size], attention=attention, scan_layers=scan_layers)


def num_params(size: GPTSize, vocab_size: int) -> int:
    """Parameters of a `GPT` of this size, counted by formula (biases included).

    Per block: two LayerNorms (4d), qkv (3d^2 + 3d), out (d^2 + d), MLP
    (8d^2 + 5d); plus token and position embeddings and the final LayerNorm.
    """
    d = size.d_model
    per_block = 12 * d * d + 13 * d
    return size.num_layers * per_block + vocab_size * d + size.context * d + 2 * d


def model_flops_per_token(size: GPTSize, vocab_size: int, length: int) -> int:
    """Training FLOPs per token by the usual estimate (PaLM appendix B, nanoGPT).

    ``6 * N + 12 * L * d * T``: forward and backward of every weight
    (N without the position table, which is a lookup) plus the attention's
    score and value products over a context of T (no causal discount).
    """
    weights = num_params(size, vocab_size) - size.context * size.d_model
    return 6 * weights + 12 * size.num_layers * size.d_model * length
