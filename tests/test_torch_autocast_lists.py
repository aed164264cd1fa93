"""PyTorch's own autocast test lists, ported to JAX: the dtype each op computes in, against torch's.

``torch/testing/_internal/autocast_test_lists.py`` is how PyTorch tests
``torch.autocast``: lists of ops with inputs, grouped by the dtype autocast
must run them in (``torch_fp16``: matmuls and convolutions in half;
``torch_fp32``: the exp/log family, reductions and losses in float32;
``torch_need_autocast_promote`` and the builtin-promote lists: float32 where
float32 and half inputs meet). ``CASES`` below ports every case of its CUDA
lists (`AutocastTestLists`, the half dtype float16, run under
``"mixed_float16"``) and of its CPU lists (`AutocastCPUTestLists`, bfloat16,
under ``"mixed_bfloat16"``): each op as its closest JAX expression, on inputs
of torch's dtypes and shapes.

Each case is read from the rewritten program
(``jax.make_jaxpr(jaxamp.autocast(fn, policy))``), nested jaxprs included:
the dtypes of the floating operands of its core primitives (``dot_general``,
``conv_general_dilated``, ``exp``, ``reduce_sum``, ...) are what it computes
in, and the narrowest dtype their results are cast to (bar the casts that
give the program's outputs) is what it keeps the result in. The output dtype
cannot show either: autocast gives outputs back in the caller's dtypes. A
case agrees with torch when it computes in torch's dtype alone and keeps its
result in it (torch's result dtype is its compute dtype); it is *safer* when
it computes and keeps float32 where torch uses half; any other answer
differs on purpose, and the table "Where jaxamp differs from torch.autocast"
of docs/guides/autocast-and-torch.md names it, with the dtypes and the reason.
That table is the expectation: a change of behaviour fails here until the
page says what jaxamp now does (the failure prints the row to write).

Tracing only, no compiling: a handful of cases also run eagerly on tiny
arrays, to check that where float32's output is finite, autocast's is too.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal

import jaxamp

RULES_PAGE = pathlib.Path(__file__).parent.parent / "docs" / "guides" / "autocast-and-torch.md"
TABLE_HEADING = "## Where jaxamp differs from `torch.autocast`"

F16, BF16, F32 = "float16", "bfloat16", "float32"
POLICY = {"CUDA": "mixed_float16", "CPU": "mixed_bfloat16"}

# Inputs, written like torch's: DTYPE[SHAPE], random normal unless a word says otherwise.
#   rand: uniform in [0, 1)   ones / zeros   below N: random integers in [0, N)
#   clip A..B: normal, clamped   plus A: normal + A   = v,v,...: these values
_DTYPES = {"f16": jnp.float16, "bf16": jnp.bfloat16, "f32": jnp.float32, "i32": jnp.int32}
_INPUT = re.compile(r"(?P<dtype>\w+)\[(?P<shape>[\d,]*)\]\s*(?P<how>.*)")


def make_input(spec: str, seed: int) -> jax.Array:
    """The array one input spec describes (`_INPUT`), drawn from `seed`."""
    match = _INPUT.fullmatch(spec.strip())
    if match is None or match["dtype"] not in _DTYPES:
        raise ValueError(f"Input spec {spec!r} is not DTYPE[SHAPE] with DTYPE one of {sorted(_DTYPES)}.")
    shape = tuple(int(size) for size in match["shape"].split(",") if size)
    how = match["how"].split()
    rng = np.random.default_rng(seed)
    if how == ["rand"]:
        values = rng.random(shape)
    elif how in (["ones"], ["zeros"]):
        values = np.full(shape, 1 if how == ["ones"] else 0)
    elif how[:1] == ["below"]:
        values = rng.integers(0, int(how[1]), shape)
    elif how[:1] == ["="]:
        values = np.array([float(value) for value in how[1].split(",")]).reshape(shape)
    else:
        values = rng.standard_normal(shape)
        words = dict(zip(how[::2], how[1::2]))
        values = values + float(words.get("plus", 0))
        if "clip" in words:
            low, high = (float(bound) for bound in words["clip"].split(".."))
            values = np.clip(values, low, high)
    return jnp.asarray(values, _DTYPES[match["dtype"]])


# The JAX expressions of torch's ops that are more than one jnp call.


def conv(x, w, bias=None):
    """torch's conv1d/2d/3d: NC... input, OI... weight, stride 1, no padding."""
    spatial = x.ndim - 2
    y = lax.conv_general_dilated(x, w, (1,) * spatial, "VALID")
    return y if bias is None else y + bias.reshape((-1,) + (1,) * spatial)


def conv_transpose(x, w):
    """torch's conv_transpose1d/2d/3d (the gradient of a convolution), stride 1, no padding."""
    spatial = "DHW"[3 - (x.ndim - 2) :]
    specs = ("NC" + spatial, "OI" + spatial, "NC" + spatial)
    strides = (1,) * len(spatial)
    return lax.conv_transpose(x, w, strides, "VALID", dimension_numbers=specs, transpose_kernel=True)


def conv_tbc(x, w, bias):
    """torch's conv_tbc: time, batch, channel input; width, in, out weight."""
    y = lax.conv_general_dilated(x, w, (1,), "VALID", dimension_numbers=("WNC", "WIO", "WNC"))
    return y + bias


def lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh):
    i, f, g, o = jnp.split(x @ w_ih.T + b_ih + h @ w_hh.T + b_hh, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return jax.nn.sigmoid(o) * jnp.tanh(c), c


def gru_cell(x, h, w_ih, w_hh, b_ih, b_hh):
    r_x, z_x, n_x = jnp.split(x @ w_ih.T + b_ih, 3, axis=-1)
    r_h, z_h, n_h = jnp.split(h @ w_hh.T + b_hh, 3, axis=-1)
    r, z = jax.nn.sigmoid(r_x + r_h), jax.nn.sigmoid(z_x + z_h)
    n = jnp.tanh(n_x + r * n_h)
    return (1 - z) * n + z * h


def rnn_cell(activation):
    return lambda x, h, w_ih, w_hh, b_ih, b_hh: activation(x @ w_ih.T + b_ih + h @ w_hh.T + b_hh)


def prelu(x, weight):
    return jnp.where(x >= 0, x, weight * x)


def layer_norm(x, eps=1e-5):
    centred = x - jnp.mean(x, axis=-1, keepdims=True)
    return centred * lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)


def rms_norm(x, eps=1e-6):
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def group_norm(x, groups):
    return layer_norm(x.reshape(x.shape[0], groups, -1)).reshape(x.shape)


def cosine_similarity(a, b, axis=1, eps=1e-8):
    norms = jnp.linalg.norm(a, axis=axis) * jnp.linalg.norm(b, axis=axis)
    return jnp.sum(a * b, axis=axis) / jnp.maximum(norms, eps)


def poisson_nll_loss(x, target):
    return jnp.mean(jnp.exp(x) - target * x)


def cosine_embedding_loss(a, b, y, margin=0.0):
    cosine = cosine_similarity(a, b)
    return jnp.mean(jnp.where(y == 1, 1 - cosine, jnp.maximum(0.0, cosine - margin)))


def hinge_embedding_loss(x, y, margin=1.0):
    return jnp.mean(jnp.where(y == 1, x, jnp.maximum(0.0, margin - x)))


def kl_div(x, target):
    return jnp.mean(jax.scipy.special.xlogy(target, target) - target * x)


def margin_ranking_loss(a, b, y, margin=0.0):
    return jnp.mean(jnp.maximum(0.0, -y * (a - b) + margin))


def triplet_margin_loss(anchor, positive, negative, margin=1.0, eps=1e-6):
    def distance(a, b):
        return jnp.linalg.norm(a - b + eps, axis=-1)

    return jnp.mean(jnp.maximum(distance(anchor, positive) - distance(anchor, negative) + margin, 0.0))


def binary_cross_entropy_with_logits(x, target):
    return jnp.mean(jnp.maximum(x, 0) - x * target + jnp.log1p(jnp.exp(-jnp.abs(x))))


def binary_cross_entropy(p, target):
    log_p, log_not_p = jnp.maximum(jnp.log(p), -100.0), jnp.maximum(jnp.log1p(-p), -100.0)
    return -jnp.mean(target * log_p + (1 - target) * log_not_p)


def pairwise_distances(a, b):
    return jnp.sqrt(jnp.sum((a[:, None] - b[None]) ** 2, axis=-1))


def pdist(x):
    rows, columns = np.triu_indices(x.shape[0], 1)
    return pairwise_distances(x, x)[rows, columns]


def renorm(x, maxnorm=1.0):
    """torch.renorm(x, p=2, dim=0, maxnorm): each row of norm above maxnorm scaled down to it."""
    norms = jnp.linalg.norm(x, axis=1, keepdims=True)
    return x * jnp.where(norms > maxnorm, maxnorm / (norms + 1e-7), 1.0)


def bilinear(x1, x2, weight, bias):
    return jnp.einsum("bi,oij,bj->bo", x1, weight, x2) + bias


def grid_sample(image, grid):
    """torch's grid_sampler: bilinear, zeros outside, align_corners=False."""
    height, width = image.shape[-2:]
    x = ((grid[..., 0] + 1) * width - 1) / 2
    y = ((grid[..., 1] + 1) * height - 1) / 2

    def sample(plane, y, x):
        return jax.scipy.ndimage.map_coordinates(plane, (y, x), order=1, mode="constant", cval=0.0)

    return jax.vmap(jax.vmap(sample, (0, None, None)))(image, y, x)


def index_put(x, index, values):
    return x.at[index].set(values.astype(x.dtype))  # JAX casts the values to x's dtype, and says so


def scatter_add(x, index, src):
    """torch.scatter_add(x, 0, index, src): x[index[i, j, k], j, k] += src[i, j, k]."""
    _, j, k = jnp.indices(index.shape)
    return x.at[index, j, k].add(src.astype(x.dtype))


def nll_loss(log_probs, target):
    return -jnp.mean(jnp.take_along_axis(log_probs, target[:, None], axis=1))


def l1_loss(a, b):
    return jnp.mean(jnp.abs(a - b))


def smooth_l1_loss(a, b, beta=1.0):
    error = jnp.abs(a - b)
    return jnp.mean(jnp.where(error < beta, 0.5 * error**2 / beta, error - 0.5 * beta))


def mse_loss(a, b):
    return jnp.mean((a - b) ** 2)


def multilabel_margin_loss(x, target):
    """Targets are class indices up to the first -1; each against every class not a target."""
    classes = x.shape[-1]
    listed = jnp.cumprod(target >= 0, axis=-1).astype(bool)
    is_target = jnp.any(jax.nn.one_hot(jnp.where(listed, target, -1), classes), axis=-2)
    picked = jnp.take_along_axis(x, jnp.maximum(target, 0), axis=-1)
    hinge = jnp.maximum(0.0, 1 - picked[..., :, None] + x[..., None, :])
    counted = listed[..., :, None] & ~is_target[..., None, :]
    return jnp.mean(jnp.sum(jnp.where(counted, hinge, 0.0), axis=(-2, -1)) / classes)


def soft_margin_loss(x, y):
    return jnp.mean(jnp.log1p(jnp.exp(-y * x)))


def multi_margin_loss(x, target, margin=1.0):
    picked = jnp.take_along_axis(x, target[:, None], axis=1)
    others = jnp.arange(x.shape[1]) != target[:, None]
    hinge = jnp.where(others, jnp.maximum(0.0, margin - picked + x), 0.0)
    return jnp.mean(jnp.sum(hinge, axis=1) / x.shape[1])


def multi_head_attention(q, k, v, qkv_weight, qkv_bias, proj_weight, proj_bias, heads=4):
    """torch's _native_multi_head_attention: packed input projection, attention, output projection."""
    batch, length, width = q.shape

    def project(x, w, b):
        return (x @ w.T + b).reshape(batch, length, heads, width // heads)

    (wq, wk, wv), (bq, bk, bv) = jnp.split(qkv_weight, 3), jnp.split(qkv_bias, 3)
    attended = jax.nn.dot_product_attention(project(q, wq, bq), project(k, wk, bk), project(v, wv, bv))
    return attended.reshape(batch, length, width) @ proj_weight.T + proj_bias


def avg_pool3d(x):
    """kernel 3, stride 1, on an unbatched (C, D, H, W) input."""
    return lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 3), (1, 1, 1, 1), "VALID") / 27


# Core primitives: what a case computes in is read from these.
MATMUL, CONV = ("dot_general",), ("conv_general_dilated",)
LOG = ("log", "log2")  # jax 0.11.2 has its own log2
NORM = ("reduce_sum", "sqrt")
MEAN = ("reduce_sum",)


@dataclasses.dataclass(frozen=True)
class Case:
    """One case of torch's lists and its JAX port."""

    device: str  # "CUDA" (float16) or "CPU" (bfloat16): which of torch's classes lists it
    torch_list: str  # the list's name in that class
    op: str  # torch's op name, with its arguments where the list has it more than once
    inputs: tuple[str, ...]  # `make_input` specs, torch's dtypes and shapes
    jax_fn: Callable
    core: tuple[str, ...]  # the primitives whose operands say what the op computes in
    torch_dtype: str  # what torch.autocast computes the op in

    @property
    def key(self) -> tuple[str, str, str]:
        return self.device, self.torch_list, self.op

    @property
    def policy(self) -> str:
        return POLICY[self.device]

    def arrays(self) -> list[jax.Array]:
        return [make_input(spec, zlib.crc32(f"{self.key}{i}".encode())) for i, spec in enumerate(self.inputs)]

    def floating_input_dtypes(self) -> str:
        dtypes = [str(array.dtype) for array in self.arrays() if jnp.issubdtype(array.dtype, jnp.floating)]
        return ", ".join(dtypes)


def cuda(torch_list, op, inputs, jax_fn, core, torch_dtype):
    return Case("CUDA", torch_list, op, tuple(inputs.split("; ")), jax_fn, core, torch_dtype)


def cpu(torch_list, op, inputs, jax_fn, core, torch_dtype):
    return Case("CPU", torch_list, op, tuple(inputs.split("; ")), jax_fn, core, torch_dtype)


PW = "f32[8]; f16[8]"  # torch's pointwise0_fp32 + pointwise1_fp16
PW_BF = "f32[8]; bf16[8]"  # the CPU lists' pointwise0_fp32 + pointwise1_bf16
CONV1, CONV2, CONV3 = "f32[8,8,8]; f32[8,8,8]", "f32[8,8,8,8]; f32[8,8,8,8]", "f32[8,8,8,8,8]; f32[8,8,8,8,8]"
MM2, MM3 = "f32[8,8]; f32[8,8]", "f32[8,8]; f32[8,8]; f32[8,8]"
BMM2, BMM3 = "f32[8,8,8]; f32[8,8,8]", "f32[8,8,8]; f32[8,8,8]; f32[8,8,8]"
ADDBMM = "f32[8,8]; f32[8,8,8]; f32[8,8,8]"
LSTM = "f32[8,8]; f32[8,8]; f32[8,8]; f32[32,8]; f32[32,8]; f32[32]; f32[32]"
GRU = "f32[8,8]; f32[8,8]; f32[24,8]; f32[24,8]; f32[24]; f32[24]"
RNN = "f32[8,8]; f32[8,8]; f32[8,8]; f32[8,8]; f32[8]; f32[8]"
H8, H88, H88x2, H88x3 = "f16[8]", "f16[8,8]", "f16[8,8]; f16[8,8]", "f16[8,8]; f16[8,8]; f16[8,8]"
B88, B88x2, B88x3 = "bf16[8,8]", "bf16[8,8]; bf16[8,8]", "bf16[8,8]; bf16[8,8]; bf16[8,8]"
MHA = "f32[8,8,8]; f32[8,8,8]; f32[8,8,8]; f32[24,8]; f32[24]; f32[8,8]; f32[8]"

# fmt: off
CASES = (
    # torch_expect_builtin_promote: ops whose own promotion autocast relies on
    cuda("torch_expect_builtin_promote", "eq", PW, jnp.equal, ("eq",), F32),
    cuda("torch_expect_builtin_promote", "ge", PW, jnp.greater_equal, ("ge",), F32),
    cuda("torch_expect_builtin_promote", "gt", PW, jnp.greater, ("gt",), F32),
    cuda("torch_expect_builtin_promote", "le", PW, jnp.less_equal, ("le",), F32),
    cuda("torch_expect_builtin_promote", "lt", PW, jnp.less, ("lt",), F32),
    cuda("torch_expect_builtin_promote", "ne", PW, jnp.not_equal, ("ne",), F32),
    cuda("torch_expect_builtin_promote", "add", PW, jnp.add, ("add",), F32),
    cuda("torch_expect_builtin_promote", "div", PW, jnp.divide, ("div",), F32),
    cuda("torch_expect_builtin_promote", "mul", PW, jnp.multiply, ("mul",), F32),
    cuda("torch_expect_builtin_promote", "cat", "f16[8]; f32[8]", lambda a, b: jnp.concatenate([a, b]), ("concatenate",), F32),
    cuda("torch_expect_builtin_promote", "equal", PW, jnp.array_equal, ("eq",), F32),
    cuda("torch_expect_builtin_promote", "stack", "f16[8]; f32[8]", lambda a, b: jnp.stack([a, b]), ("stack", "concatenate"), F32),
    cuda("methods_expect_builtin_promote", "__eq__", PW, lambda a, b: a == b, ("eq",), F32),
    cuda("methods_expect_builtin_promote", "__ge__", PW, lambda a, b: a >= b, ("ge",), F32),
    cuda("methods_expect_builtin_promote", "__gt__", PW, lambda a, b: a > b, ("gt",), F32),
    cuda("methods_expect_builtin_promote", "__le__", PW, lambda a, b: a <= b, ("le",), F32),
    cuda("methods_expect_builtin_promote", "__lt__", PW, lambda a, b: a < b, ("lt",), F32),
    cuda("methods_expect_builtin_promote", "__ne__", PW, lambda a, b: a != b, ("ne",), F32),
    cuda("methods_expect_builtin_promote", "__add__", PW, lambda a, b: a + b, ("add",), F32),
    cuda("methods_expect_builtin_promote", "__div__", PW, lambda a, b: a / b, ("div",), F32),
    cuda("methods_expect_builtin_promote", "__mul__", PW, lambda a, b: a * b, ("mul",), F32),
    # torch_fp16: matmuls and convolutions in half
    cuda("torch_fp16", "_convolution (deprecated)", CONV2 + "; f32[8]", conv, CONV, F16),
    cuda("torch_fp16", "_convolution", CONV2 + "; f32[8]", conv, CONV, F16),
    cuda("torch_fp16", "conv1d", CONV1, conv, CONV, F16),
    cuda("torch_fp16", "conv2d", CONV2, conv, CONV, F16),
    cuda("torch_fp16", "conv3d", CONV3, conv, CONV, F16),
    cuda("torch_fp16", "conv_tbc", CONV1 + "; f32[8]", conv_tbc, CONV, F16),
    cuda("torch_fp16", "conv_transpose1d", CONV1, conv_transpose, CONV, F16),
    cuda("torch_fp16", "conv_transpose2d", CONV2, conv_transpose, CONV, F16),
    cuda("torch_fp16", "conv_transpose3d", CONV3, conv_transpose, CONV, F16),
    cuda("torch_fp16", "convolution", CONV2 + "; f32[8]", conv, CONV, F16),
    cuda("torch_fp16", "cudnn_convolution", CONV2, conv, CONV, F16),
    cuda("torch_fp16", "cudnn_convolution_transpose", CONV2, conv_transpose, CONV, F16),
    cuda("torch_fp16", "prelu", "f32[8]; f32[1]", prelu, ("mul", "select_n"), F16),
    cuda("torch_fp16", "addmm", MM3, lambda c, a, b: c + a @ b, MATMUL, F16),
    cuda("torch_fp16", "addmv", "f32[8]; f32[8,8]; f32[8]", lambda c, a, v: c + a @ v, MATMUL, F16),
    cuda("torch_fp16", "addr", "f32[8,8]; f32[8]; f32[8]", lambda c, u, v: c + jnp.outer(u, v), ("mul",), F16),
    cuda("torch_fp16", "matmul", MM2, jnp.matmul, MATMUL, F16),
    # torch passes einsum two 8x8 matrices, which its own subscripts do not fit; 4-d inputs here
    cuda("torch_fp16", "einsum", "f32[8,8,8,8]; f32[8,8,8,8]", lambda a, b: jnp.einsum("bkhd,bqhd->bqkh", a, b), MATMUL, F16),
    cuda("torch_fp16", "mm", MM2, jnp.matmul, MATMUL, F16),
    cuda("torch_fp16", "mv", "f32[8,8]; f32[8]", jnp.matmul, MATMUL, F16),
    cuda("torch_fp16", "chain_matmul", MM3, lambda a, b, c: jnp.linalg.multi_dot([a, b, c]), MATMUL, F16),
    cuda("torch_fp16", "addbmm", ADDBMM, lambda c, a, b: c + jnp.einsum("bij,bjk->ik", a, b), MATMUL, F16),
    cuda("torch_fp16", "baddbmm", BMM3, lambda c, a, b: c + a @ b, MATMUL, F16),
    cuda("torch_fp16", "bmm", BMM2, jnp.matmul, MATMUL, F16),
    cuda("torch_fp16", "lstm_cell", LSTM, lstm_cell, MATMUL, F16),
    cuda("torch_fp16", "gru_cell", GRU, gru_cell, MATMUL, F16),
    cuda("torch_fp16", "rnn_tanh_cell", RNN, rnn_cell(jnp.tanh), MATMUL, F16),
    cuda("torch_fp16", "rnn_relu_cell", RNN, rnn_cell(jax.nn.relu), MATMUL, F16),
    # torch_fp32: the exp/log family, powers, softmax, norms, losses, reductions in float32
    cuda("torch_fp32", "acos", "f16[8] clip -0.9..0.9", jnp.arccos, ("acos",), F32),
    cuda("torch_fp32", "asin", "f16[8] clip -0.9..0.9", jnp.arcsin, ("asin",), F32),
    cuda("torch_fp32", "cosh", H8, jnp.cosh, ("cosh",), F32),
    cuda("torch_fp32", "erfinv", "f16[8] clip -0.9..0.9", jax.scipy.special.erfinv, ("erf_inv",), F32),
    cuda("torch_fp32", "exp", H8, jnp.exp, ("exp",), F32),
    cuda("torch_fp32", "expm1", H8, jnp.expm1, ("expm1",), F32),
    cuda("torch_fp32", "log", "f16[8] clip 0.1..100", jnp.log, LOG, F32),
    cuda("torch_fp32", "log10", "f16[8] clip 0.1..100", jnp.log10, LOG, F32),
    cuda("torch_fp32", "log2", "f16[8] clip 0.1..100", jnp.log2, LOG, F32),
    cuda("torch_fp32", "log1p", "f16[8] clip -0.9..100", jnp.log1p, ("log1p",), F32),
    cuda("torch_fp32", "reciprocal", H8, jnp.reciprocal, ("integer_pow",), F32),
    cuda("torch_fp32", "rsqrt", "f16[8] clip 0..100", lax.rsqrt, ("rsqrt",), F32),
    cuda("torch_fp32", "sinh", H8, jnp.sinh, ("sinh",), F32),
    cuda("torch_fp32", "tan", "f16[8] clip -1.55..1.55", jnp.tan, ("tan",), F32),
    cuda("torch_fp32", "pow(x, y)", "f16[8] plus 1 clip 0..100; f16[8]", jnp.power, ("pow",), F32),
    cuda("torch_fp32", "pow(x, 1.7)", "f16[8] plus 1 clip 0..100", lambda x: jnp.power(x, 1.7), ("pow",), F32),
    cuda("torch_fp32", "softmax", H8, lambda x: jax.nn.softmax(x, axis=0), ("exp", "reduce_sum"), F32),
    cuda("torch_fp32", "log_softmax", H8, lambda x: jax.nn.log_softmax(x, axis=0), ("exp", *LOG, "reduce_sum"), F32),
    cuda("torch_fp32", "layer_norm", H8, layer_norm, ("reduce_sum", "rsqrt"), F32),
    cuda("torch_fp32", "rms_norm", H8, rms_norm, ("reduce_sum", "rsqrt"), F32),
    cuda("torch_fp32", "group_norm", H88, lambda x: group_norm(x, 1), ("reduce_sum", "rsqrt"), F32),
    cuda("torch_fp32", "norm", H8, jnp.linalg.norm, NORM, F32),
    cuda("torch_fp32", "norm(dim=0)", H8, lambda x: jnp.linalg.norm(x, axis=0), NORM, F32),
    cuda("torch_fp32", "norm(p=1)", H8, lambda x: jnp.linalg.norm(x, ord=1), MEAN, F32),
    cuda("torch_fp32", "norm(p=1, dim=0)", H8, lambda x: jnp.linalg.norm(x, ord=1, axis=0), MEAN, F32),
    cuda("torch_fp32", "cosine_similarity", H88x2, cosine_similarity, NORM, F32),
    cuda("torch_fp32", "poisson_nll_loss", H88x2, poisson_nll_loss, ("exp", "reduce_sum"), F32),
    cuda("torch_fp32", "cosine_embedding_loss", "f16[1,3] = 1,2,3; f16[1,3] = 1,3,4; i32[1] ones", cosine_embedding_loss, NORM, F32),
    cuda("torch_fp32", "hinge_embedding_loss", "f16[8,8]; i32[8] ones", hinge_embedding_loss, MEAN, F32),
    cuda("torch_fp32", "kl_div", "f16[8,8]; f16[8,8] rand", kl_div, (*LOG, "reduce_sum"), F32),
    cuda("torch_fp32", "margin_ranking_loss", "f16[8,8]; f16[8,8]; f16[8] ones", margin_ranking_loss, MEAN, F32),
    cuda("torch_fp32", "triplet_margin_loss", H88x3, triplet_margin_loss, NORM, F32),
    cuda("torch_fp32", "binary_cross_entropy_with_logits", "f16[8,8]; f16[8,8] rand", binary_cross_entropy_with_logits, ("exp", "log1p", "reduce_sum"), F32),
    cuda("torch_fp32", "cumprod", H8, lambda x: jnp.cumprod(x, axis=0), ("cumprod",), F32),
    cuda("torch_fp32", "cumsum", H8, lambda x: jnp.cumsum(x, axis=0), ("cumsum",), F32),
    cuda("torch_fp32", "dist", "f16[8]; f16[8]", lambda a, b: jnp.linalg.norm(a - b), NORM, F32),
    cuda("torch_fp32", "pdist", H88, pdist, NORM, F32),
    cuda("torch_fp32", "cdist", H88x2, pairwise_distances, NORM, F32),
    cuda("torch_fp32", "prod", H8, jnp.prod, ("reduce_prod",), F32),
    cuda("torch_fp32", "prod(dim=0)", H8, lambda x: jnp.prod(x, axis=0), ("reduce_prod",), F32),
    cuda("torch_fp32", "renorm", H88, renorm, NORM, F32),
    cuda("torch_fp32", "sum", H8, jnp.sum, MEAN, F32),
    cuda("torch_fp32", "sum(dim=1)", H88, lambda x: jnp.sum(x, axis=1), MEAN, F32),
    cuda("torch_fp32", "logsumexp", H88, lambda x: jax.nn.logsumexp(x, axis=1), ("exp", *LOG, "reduce_sum"), F32),
    # torch_need_autocast_promote: float32 and half inputs meet, torch computes in float32
    cuda("torch_need_autocast_promote", "addcdiv", "f32[8]; f16[8]; f16[8] clip 0.1..100", lambda x, a, b: x + a / b, ("div", "add"), F32),
    cuda("torch_need_autocast_promote", "addcmul", "f32[8]; f16[8]; f16[8]", lambda x, a, b: x + a * b, ("mul", "add"), F32),
    cuda("torch_need_autocast_promote", "atan2", "f32[8]; f16[8] clip 0.1..100", jnp.arctan2, ("atan2",), F32),
    cuda("torch_need_autocast_promote", "bilinear", "f16[1,2]; f32[1,2]; f16[1,2,2]; f32[1]", bilinear, MATMUL, F32),
    cuda("torch_need_autocast_promote", "cross", "f32[3]; f16[3]", jnp.cross, ("mul", "sub"), F32),
    cuda("torch_need_autocast_promote", "dot", "f16[8]; f32[8]", jnp.dot, MATMUL, F32),
    cuda("torch_need_autocast_promote", "vdot", "f16[8]; f32[8]", jnp.vdot, MATMUL, F32),
    cuda("torch_need_autocast_promote", "grid_sampler", "f16[2,3,33,22]; f32[2,22,11,2]", grid_sample, ("mul",), F32),
    cuda("torch_need_autocast_promote", "index_put (float16 into float32)", "f32[8]; i32[1] ones; f16[1]", index_put, ("scatter",), F32),
    cuda("torch_need_autocast_promote", "index_put (float32 into float16)", "f16[8]; i32[1] ones; f32[1]", index_put, ("scatter",), F32),
    cuda("torch_need_autocast_promote", "tensordot", "f32[2,2,2]; f16[2,2,2]", jnp.tensordot, MATMUL, F32),
    cuda("torch_need_autocast_promote", "scatter_add (float16 into float32)", "f32[2,2,2] zeros; i32[2,2,2] below 2; f16[2,2,2]", scatter_add, ("scatter-add",), F32),
    cuda("torch_need_autocast_promote", "scatter_add (float32 into float16)", "f16[2,2,2] zeros; i32[2,2,2] below 2; f32[2,2,2]", scatter_add, ("scatter-add",), F32),
    # nn_fp16, nn_fp32, linalg_fp16, methods_fp16, methods_fp32
    cuda("nn_fp16", "linear", MM3, lambda x, w, b: x @ w.T + b, MATMUL, F16),
    cuda("nn_fp32", "softplus", H8, jax.nn.softplus, ("exp", "log1p"), F32),
    cuda("nn_fp32", "nll_loss", "f32[8,8] rand; i32[8] zeros", nll_loss, MEAN, F32),
    cuda("nn_fp32", "nll_loss2d", "f16[8,8,8,8] rand; i32[8,8,8] zeros", lambda x, t: -jnp.mean(jnp.take_along_axis(x, t[:, None], 1)), MEAN, F32),
    cuda("nn_fp32", "l1_loss", H88x2, l1_loss, MEAN, F32),
    cuda("nn_fp32", "smooth_l1_loss", H88x2, smooth_l1_loss, MEAN, F32),
    cuda("nn_fp32", "mse_loss", H88x2, mse_loss, MEAN, F32),
    cuda("nn_fp32", "multilabel_margin_loss", "f16[8,8]; i32[8,8] ones", multilabel_margin_loss, MEAN, F32),
    cuda("nn_fp32", "soft_margin_loss", "f16[8,8]; i32[8,8] ones", soft_margin_loss, ("exp", "log1p", "reduce_sum"), F32),
    cuda("nn_fp32", "multi_margin_loss", "f16[8,8]; i32[8] ones", multi_margin_loss, MEAN, F32),
    cuda("linalg_fp16", "linalg_vecdot", MM2, jnp.linalg.vecdot, MATMUL, F16),
    cuda("linalg_fp16", "linalg_multi_dot", MM3, lambda a, b, c: jnp.linalg.multi_dot([a, b, c]), MATMUL, F16),
    cuda("methods_fp16", "__matmul__", MM2, lambda a, b: a @ b, MATMUL, F16),
    cuda("methods_fp32", "__pow__", "f16[8] rand", lambda x: x**1.5, ("pow",), F32),
    # banned: torch.autocast raises on it (unsafe in half); listed for what jaxamp does instead
    cuda("banned", "binary_cross_entropy", "f32[8,8] rand; f32[8,8] rand", binary_cross_entropy, (*LOG, "log1p", "reduce_sum"), F32),

    # AutocastCPUTestLists, in bfloat16
    cpu("torch_expect_builtin_promote", "eq", PW_BF, jnp.equal, ("eq",), F32),
    cpu("torch_expect_builtin_promote", "ge", PW_BF, jnp.greater_equal, ("ge",), F32),
    cpu("torch_expect_builtin_promote", "gt", PW_BF, jnp.greater, ("gt",), F32),
    cpu("torch_expect_builtin_promote", "le", PW_BF, jnp.less_equal, ("le",), F32),
    cpu("torch_expect_builtin_promote", "lt", PW_BF, jnp.less, ("lt",), F32),
    cpu("torch_expect_builtin_promote", "ne", PW_BF, jnp.not_equal, ("ne",), F32),
    cpu("torch_expect_builtin_promote", "add", PW_BF, jnp.add, ("add",), F32),
    cpu("torch_expect_builtin_promote", "div", PW_BF, jnp.divide, ("div",), F32),
    cpu("torch_expect_builtin_promote", "mul", PW_BF, jnp.multiply, ("mul",), F32),
    cpu("methods_expect_builtin_promote", "__eq__", PW_BF, lambda a, b: a == b, ("eq",), F32),
    cpu("methods_expect_builtin_promote", "__ge__", PW_BF, lambda a, b: a >= b, ("ge",), F32),
    cpu("methods_expect_builtin_promote", "__gt__", PW_BF, lambda a, b: a > b, ("gt",), F32),
    cpu("methods_expect_builtin_promote", "__le__", PW_BF, lambda a, b: a <= b, ("le",), F32),
    cpu("methods_expect_builtin_promote", "__lt__", PW_BF, lambda a, b: a < b, ("lt",), F32),
    cpu("methods_expect_builtin_promote", "__ne__", PW_BF, lambda a, b: a != b, ("ne",), F32),
    cpu("methods_expect_builtin_promote", "__add__", PW_BF, lambda a, b: a + b, ("add",), F32),
    cpu("methods_expect_builtin_promote", "__div__", PW_BF, lambda a, b: a / b, ("div",), F32),
    cpu("methods_expect_builtin_promote", "__mul__", PW_BF, lambda a, b: a * b, ("mul",), F32),
    cpu("torch_16", "conv1d", CONV1, conv, CONV, BF16),
    cpu("torch_16", "conv2d", CONV2, conv, CONV, BF16),
    cpu("torch_16", "conv3d", CONV3, conv, CONV, BF16),
    cpu("torch_16", "bmm", BMM2, jnp.matmul, MATMUL, BF16),
    cpu("torch_16", "mm", MM2, jnp.matmul, MATMUL, BF16),
    cpu("torch_16", "matmul", MM2, jnp.matmul, MATMUL, BF16),
    cpu("torch_16", "baddbmm", BMM3, lambda c, a, b: c + a @ b, MATMUL, BF16),
    cpu("torch_16", "addmm", MM3, lambda c, a, b: c + a @ b, MATMUL, BF16),
    cpu("torch_16", "_addmm_activation", MM3, lambda c, a, b: jax.nn.gelu(c + a @ b), MATMUL, BF16),
    cpu("torch_16", "addbmm", ADDBMM, lambda c, a, b: c + jnp.einsum("bij,bjk->ik", a, b), MATMUL, BF16),
    cpu("torch_16", "conv_tbc", "f32[10,7,3]; f32[5,3,5]; f32[5]", conv_tbc, CONV, BF16),
    cpu("torch_16", "conv_transpose1d", CONV1, conv_transpose, CONV, BF16),
    cpu("torch_16", "conv_transpose2d", CONV2, conv_transpose, CONV, BF16),
    cpu("torch_16", "conv_transpose3d", CONV3, conv_transpose, CONV, BF16),
    cpu("torch_16", "prelu", "f32[8]; f32[1]", prelu, ("mul", "select_n"), BF16),
    cpu("torch_16", "_native_multi_head_attention", MHA, multi_head_attention, MATMUL, BF16),
    cpu("torch_fp32", "poisson_nll_loss", B88x2, poisson_nll_loss, ("exp", "reduce_sum"), F32),
    cpu("torch_fp32", "cosine_embedding_loss", "bf16[1,3] = 1,2,3; bf16[1,3] = 1,3,4; i32[1] ones", cosine_embedding_loss, NORM, F32),
    cpu("torch_fp32", "hinge_embedding_loss", "bf16[8,8]; i32[8] ones", hinge_embedding_loss, MEAN, F32),
    cpu("torch_fp32", "margin_ranking_loss", "bf16[8,8]; bf16[8,8]; bf16[8] ones", margin_ranking_loss, MEAN, F32),
    cpu("torch_fp32", "triplet_margin_loss", B88x3, triplet_margin_loss, NORM, F32),
    cpu("torch_fp32", "binary_cross_entropy_with_logits", "bf16[8,8]; bf16[8,8] rand", binary_cross_entropy_with_logits, ("exp", "log1p", "reduce_sum"), F32),
    cpu("nn_16", "linear", MM2, lambda x, w: x @ w.T, MATMUL, BF16),
    cpu("nn_fp32", "avg_pool3d", "bf16[8,8,8,8]", avg_pool3d, ("reduce_window_sum",), F32),
    cpu("nn_fp32", "binary_cross_entropy", "bf16[8,8] rand; bf16[8,8] rand", binary_cross_entropy, (*LOG, "log1p", "reduce_sum"), F32),
    cpu("nn_fp32", "reflection_pad1d", "bf16[8,8,8]", lambda x: jnp.pad(x, ((0, 0), (0, 0), (3, 3)), mode="reflect"), ("concatenate",), F32),
    cpu("nn_fp32", "nll_loss", "bf16[8,8] rand; i32[8] zeros", nll_loss, MEAN, F32),
    cpu("nn_fp32", "nll_loss2d", "bf16[8,8,8,8] rand; i32[8,8,8] zeros", lambda x, t: -jnp.mean(jnp.take_along_axis(x, t[:, None], 1)), MEAN, F32),
    cpu("nn_fp32", "l1_loss", B88x2, l1_loss, MEAN, F32),
    cpu("nn_fp32", "smooth_l1_loss", B88x2, smooth_l1_loss, MEAN, F32),
    cpu("nn_fp32", "mse_loss", B88x2, mse_loss, MEAN, F32),
    cpu("nn_fp32", "multilabel_margin_loss", "bf16[8,8]; i32[8,8] ones", multilabel_margin_loss, MEAN, F32),
    cpu("nn_fp32", "soft_margin_loss", "bf16[8,8]; i32[8,8] ones", soft_margin_loss, ("exp", "log1p", "reduce_sum"), F32),
    cpu("nn_fp32", "multi_margin_loss", "bf16[8,8]; i32[8] ones", multi_margin_loss, MEAN, F32),
    cpu("nn_fp32", "huber_loss", B88x2, smooth_l1_loss, MEAN, F32),
    cpu("torch_need_autocast_promote", "cat", "bf16[8]; f32[8]", lambda a, b: jnp.concatenate([a, b]), ("concatenate",), F32),
    cpu("torch_need_autocast_promote", "stack", "bf16[8]; f32[8]", lambda a, b: jnp.stack([a, b]), ("stack", "concatenate"), F32),
)
# fmt: on


def _floating(atom) -> bool:
    return jnp.issubdtype(atom.aval.dtype, jnp.floating)


def _narrowest(dtypes) -> str:
    return min(dtypes, key=lambda name: jnp.finfo(name).bits)


def _core_equations(jaxpr: Jaxpr, core: tuple[str, ...], program_outputs: set):
    """(operand dtypes, result dtype) of each live equation of a `core` primitive in `jaxpr` and the
    jaxprs nested in it (jit, custom_jvp, scan ...). The result dtype is the narrowest the equation's
    output is cast to by the casts that read it and whose results are read in turn (a rounding the
    program never reads rounds nothing), bar the casts that give the program's outputs (which give
    them back in the caller's dtypes)."""
    casts_reading = {}
    read = {atom for equation in jaxpr.eqns for atom in equation.invars if not isinstance(atom, Literal)}
    read |= {atom for atom in jaxpr.outvars if not isinstance(atom, Literal)}
    for equation in jaxpr.eqns:
        if equation.primitive.name == "convert_element_type" and equation.outvars[0] in read:
            casts_reading.setdefault(equation.invars[0], []).append(equation)
    for equation in jaxpr.eqns:
        live = not all(isinstance(var, DropVar) for var in equation.outvars)
        if live and equation.primitive.name in core:
            operands = {str(atom.aval.dtype) for atom in equation.invars if _floating(atom)}
            results = {str(var.aval.dtype) for var in equation.outvars if _floating(var)}
            for var in filter(_floating, equation.outvars):
                results |= {
                    str(cast.outvars[0].aval.dtype)
                    for cast in casts_reading.get(var, [])
                    if not isinstance(cast.outvars[0], DropVar)
                    and cast.outvars[0] not in program_outputs
                    and _floating(cast.outvars[0])
                }
            yield operands, results
        for value in equation.params.values():
            for candidate in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(candidate, ClosedJaxpr):
                    yield from _core_equations(candidate.jaxpr, core, program_outputs)
                elif isinstance(candidate, Jaxpr):
                    yield from _core_equations(candidate, core, program_outputs)


@dataclasses.dataclass(frozen=True)
class Observed:
    """What the rewritten program does with a case's core primitives."""

    computes_in: str  # their floating operands' dtypes, joined with " and " where they differ
    result_in: str  # the narrowest dtype their results are kept in ("bool" for comparisons)

    def agrees_with(self, torch_dtype: str) -> bool:
        return self.computes_in == torch_dtype and self.result_in in ("bool", torch_dtype)


def observe(case: Case, float32_argnums: tuple[int, ...] = ()) -> Observed:
    """Traces `case` under autocast (no compiling) and reads its core primitives' dtypes."""
    rewritten = jaxamp.autocast(case.jax_fn, case.policy, float32_argnums=float32_argnums)
    program = jax.make_jaxpr(rewritten)(*case.arrays())
    found = list(_core_equations(program.jaxpr, case.core, set(program.jaxpr.outvars)))
    operands = set().union(*(operand for operand, _ in found))
    if not operands:
        raise AssertionError(f"{case.key}: the rewritten program has no {case.core} on floating operands.")
    results = set().union(*(result for _, result in found))
    computes_in = " and ".join(sorted(operands, key=lambda name: jnp.finfo(name).bits))
    return Observed(computes_in, _narrowest(results) if results else "bool")


# The op names of torch's lists, in torch's order: the port must cover each list whole.
DUNDER_PROMOTE = "__eq__ __ge__ __gt__ __le__ __lt__ __ne__ __add__ __div__ __mul__"
TORCH_LISTS = {
    ("CUDA", "torch_expect_builtin_promote"): "eq ge gt le lt ne add div mul cat equal stack",
    ("CUDA", "methods_expect_builtin_promote"): DUNDER_PROMOTE,
    ("CUDA", "torch_fp16"): "_convolution _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d "
    "conv_transpose2d conv_transpose3d convolution cudnn_convolution cudnn_convolution_transpose prelu addmm "
    "addmv addr matmul einsum mm mv chain_matmul addbmm baddbmm bmm lstm_cell gru_cell rnn_tanh_cell "
    "rnn_relu_cell",
    ("CUDA", "torch_fp32"): "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan "
    "pow pow softmax log_softmax layer_norm rms_norm group_norm norm norm norm norm cosine_similarity "
    "poisson_nll_loss cosine_embedding_loss hinge_embedding_loss kl_div margin_ranking_loss "
    "triplet_margin_loss binary_cross_entropy_with_logits cumprod cumsum dist pdist cdist prod prod renorm "
    "sum sum logsumexp",
    ("CUDA", "torch_need_autocast_promote"): "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler "
    "index_put index_put tensordot scatter_add scatter_add",
    ("CUDA", "nn_fp16"): "linear",
    ("CUDA", "nn_fp32"): "softplus nll_loss nll_loss2d l1_loss smooth_l1_loss mse_loss "
    "multilabel_margin_loss soft_margin_loss multi_margin_loss",
    ("CUDA", "linalg_fp16"): "linalg_vecdot linalg_multi_dot",
    ("CUDA", "methods_fp16"): "__matmul__",
    ("CUDA", "methods_fp32"): "__pow__",
    ("CUDA", "banned"): "binary_cross_entropy",
    ("CPU", "torch_expect_builtin_promote"): "eq ge gt le lt ne add div mul",
    ("CPU", "methods_expect_builtin_promote"): DUNDER_PROMOTE,
    ("CPU", "torch_16"): "conv1d conv2d conv3d bmm mm matmul baddbmm addmm _addmm_activation addbmm conv_tbc "
    "conv_transpose1d conv_transpose2d conv_transpose3d prelu _native_multi_head_attention",
    ("CPU", "torch_fp32"): "poisson_nll_loss cosine_embedding_loss hinge_embedding_loss margin_ranking_loss "
    "triplet_margin_loss binary_cross_entropy_with_logits",
    ("CPU", "nn_16"): "linear",
    ("CPU", "nn_fp32"): "avg_pool3d binary_cross_entropy reflection_pad1d nll_loss nll_loss2d l1_loss "
    "smooth_l1_loss mse_loss multilabel_margin_loss soft_margin_loss multi_margin_loss huber_loss",
    ("CPU", "torch_need_autocast_promote"): "cat stack",
}
# The lists that name the dtype an op runs in (the others: where float32 and half meet, and banned).
DTYPE_LISTS = {"torch_fp16", "torch_fp32", "nn_fp16", "nn_fp32", "linalg_fp16", "methods_fp16",
               "methods_fp32", "torch_16", "nn_16"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PageRow:
    """A row of the rules page's table: a case where jaxamp differs from torch.autocast."""

    inputs: str
    torch_dtype: str
    computes_in: str
    result_in: str
    why: str = dataclasses.field(default="", compare=False)


def rules_page_table() -> dict[tuple[str, str, str], PageRow]:
    """The table under `TABLE_HEADING`, by case key.

    Its columns: torch list, op, inputs, torch computes in, jaxamp computes in, result, why."""
    section = RULES_PAGE.read_text().split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if len(cells) != 7 or cells[0] in ("torch list", "---"):
            continue
        device, torch_list = cells[0].split(" `")
        key = (device, torch_list, cells[1])
        assert key not in rows, f"The rules page lists {key} twice."
        rows[key] = PageRow(*cells[2:7])
    return rows


def page_row(case: Case, seen: Observed, why: str) -> str:
    cells = (f"{case.device} `{case.torch_list}`", f"`{case.op}`", case.floating_input_dtypes(),
             case.torch_dtype, seen.computes_in, seen.result_in, why)  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def is_safer(case: Case, seen: Observed) -> bool:
    """Float32 where torch computes in half."""
    return case.torch_dtype != F32 and seen.computes_in == F32 and seen.result_in == F32


# The reasons of the page's table whose cases `float32_argnums` brings to torch's answer, as it says.
REMEDIED = ("a float32 argument", "a scatter")
JAX_KEEPS = "JAX keeps the array's dtype"


@pytest.fixture(scope="module")
def observed() -> dict[tuple[str, str, str], Observed]:
    return {case.key: observe(case) for case in CASES}


@pytest.fixture(scope="module")
def documented() -> dict[tuple[str, str, str], PageRow]:
    return rules_page_table()


def base_name(op: str) -> str:
    return op.split("(")[0].split(" ")[0]


def test_the_port_covers_each_of_torchs_lists_whole_and_names_each_case_once():
    ported = {}
    for case in CASES:
        ported.setdefault((case.device, case.torch_list), []).append(base_name(case.op))
    assert {key: " ".join(names) for key, names in ported.items()} == TORCH_LISTS
    assert len({case.key for case in CASES}) == len(CASES)
    assert sum(len(names.split()) for names in TORCH_LISTS.values()) == 176


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.device}-{case.torch_list}-{case.op}")
def test_each_case_computes_as_torch_autocast_does_or_as_the_rules_page_says(case, observed, documented):
    seen = observed[case.key]
    row = documented.get(case.key)
    if row is None:
        assert seen.agrees_with(case.torch_dtype), (
            f"{case.key} computes in {seen.computes_in} (result in {seen.result_in}), torch.autocast in "
            f"{case.torch_dtype}. Say why on {RULES_PAGE.name}, under {TABLE_HEADING!r}:\n"
            + page_row(case, seen, "WHY")
        )
    else:
        assert not seen.agrees_with(case.torch_dtype), (
            f"{case.key} now computes as torch.autocast does ({case.torch_dtype}): remove its row from "
            f"{RULES_PAGE.name}."
        )
        expected = PageRow(case.floating_input_dtypes(), case.torch_dtype, seen.computes_in, seen.result_in)
        assert row == expected, (
            f"{RULES_PAGE.name} says {row} for {case.key}; the program says:\n" + page_row(case, seen, "WHY")
        )


def test_the_rules_page_names_only_cases_of_torchs_lists(documented):
    assert set(documented) - {case.key for case in CASES} == set()


def test_the_rules_page_counts_what_its_table_holds(observed, documented):
    """The page's sentence of counts, against the program: all cases, and those on torch's dtype lists."""
    page = RULES_PAGE.read_text().split(TABLE_HEADING, 1)[1]
    safer = {case.key for case in CASES if is_safer(case, observed[case.key])}
    on_purpose = {case.key for case in CASES if not observed[case.key].agrees_with(case.torch_dtype)} - safer
    dtype_lists = {case.key for case in CASES if case.torch_list in DTYPE_LISTS}
    figures = (
        len(CASES), len(CASES) - len(safer) - len(on_purpose), len(safer), len(on_purpose),
        len(dtype_lists), len(dtype_lists - safer - on_purpose), len(dtype_lists & safer),
        len(dtype_lists & on_purpose),
    )  # fmt: skip
    sentence = re.search(
        r"Of the (\d+) cases, jaxamp computes (\d+) as torch does, (\d+) in float32 where torch uses "
        r"half, and (\d+) otherwise, on purpose\. On the lists that name a dtype \((\d+) cases\), (\d+) "
        r"agree, (\d+) (?:is|are) safer and (\d+) (?:differs|differ)",
        " ".join(page.split()),
    )
    assert sentence is not None, f"{RULES_PAGE.name} has no sentence of counts under {TABLE_HEADING!r}."
    assert tuple(int(figure) for figure in sentence.groups()) == figures
    assert set(documented) == safer | on_purpose


# A handful of cases run, eagerly, on tiny arrays: where float32's output is finite, autocast's is
# too, and within the half dtype's rounding of it.
FINITE_CASES = [("CUDA", "torch_fp32", "cosh"), ("CUDA", "torch_fp32", "pow(x, y)"),
                ("CUDA", "torch_fp32", "logsumexp"), ("CUDA", "torch_fp32", "prod"),
                ("CUDA", "torch_need_autocast_promote", "addcdiv"),
                ("CUDA", "torch_need_autocast_promote", "cross"),
                ("CUDA", "torch_need_autocast_promote", "dot"), ("CPU", "nn_fp32", "mse_loss")]  # fmt: skip
ROUNDING = {"mixed_float16": 1e-2, "mixed_bfloat16": 5e-2}


@pytest.mark.parametrize("key", FINITE_CASES, ids="-".join)
def test_where_float32_gives_finite_values_autocast_does_too(key):
    case = next(case for case in CASES if case.key == key)
    arrays = case.arrays()
    in_float32 = [array.astype(jnp.float32) if jnp.issubdtype(array.dtype, jnp.floating) else array
                  for array in arrays]  # fmt: skip
    reference = np.asarray(case.jax_fn(*in_float32))
    result = np.asarray(jaxamp.autocast(case.jax_fn, case.policy)(*arrays), np.float32)
    finite = np.isfinite(reference)
    assert finite.any()
    assert np.isfinite(result[finite]).all(), f"{key}: {result} where float32 gives {reference}"
    tolerance = ROUNDING[case.policy] * max(1.0, float(np.abs(reference[finite]).max()))
    np.testing.assert_allclose(result[finite], reference[finite], rtol=0, atol=tolerance)


def test_naming_the_float32_argument_in_float32_argnums_gives_torchs_promotion(documented):
    """The page's remedy for the cases it marks "a float32 argument" or "a scatter": a float32 island
    decides."""
    marked = [case for case in CASES if case.key in documented and documented[case.key].why in REMEDIED]
    assert {documented[case.key].why for case in marked} == set(REMEDIED)
    for case in marked:
        float32_argnums = tuple(i for i, array in enumerate(case.arrays()) if array.dtype == jnp.float32)
        assert observe(case, float32_argnums).agrees_with(case.torch_dtype), case.key


def test_the_cases_the_page_says_jax_keeps_in_half_are_half_without_autocast_too(documented):
    """The page's "JAX keeps the array's dtype": the plain JAX expression scatters in half already."""
    marked = [case for case in CASES if getattr(documented.get(case.key), "why", "") == JAX_KEEPS]
    assert marked
    for case in marked:
        program = jax.make_jaxpr(case.jax_fn)(*case.arrays())
        operands = set().union(*(dtypes for dtypes, _ in _core_equations(program.jaxpr, case.core, set())))
        assert operands == {F16}, case.key


def test_the_rows_the_page_calls_matmuls_are_the_matmul_cases(documented):
    called_matmuls = {key for key, row in documented.items() if row.why == "a matmul"}
    matmuls = {case.key for case in CASES if case.key in documented and case.core == MATMUL}
    assert called_matmuls == matmuls
