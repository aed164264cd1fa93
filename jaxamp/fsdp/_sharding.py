"""Sharding for `jaxamp.fsdp`: the communication policy, the shardings and the sharded loss.

One job: gather parameters and reduce-scatter gradients in the dtypes a
`CommunicationPolicy` states (the algorithm is in the `jaxamp.fsdp`
namespace's docstring); the FP8 weight gather is `_fp8_gather`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxamp._policy import PolicySpec, get_policy, parse_dtype, parse_fields
from jaxamp._optimizer.quantized import QuantizedArray, splits_by_rows
from jaxamp.fsdp._fp8_gather import FP8_GATHER_DTYPES, fp8_gather_eligible, gather_fp8

_OWN_DTYPE = ("param", "params", "none")  # each parameter's own dtype

_FP8_NAMES = {
    "fp8": jnp.float8_e4m3fn,
    "f8": jnp.float8_e4m3fn,
    "float8": jnp.float8_e4m3fn,
    "e4m3": jnp.float8_e4m3fn,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "e5m2": jnp.float8_e5m2,
    "float8_e5m2": jnp.float8_e5m2,
}


def _communication_dtype(dtype: Any, field_name: str) -> np.dtype | None:
    """The floating dtype `dtype` names (`jaxamp._policy.parse_dtype`, or an FP8 name), or None for "the parameter's own"."""
    if dtype is None or (isinstance(dtype, str) and dtype.strip().lower() in _OWN_DTYPE):
        return None
    if isinstance(dtype, str) and dtype.strip().lower() in _FP8_NAMES:
        return jnp.dtype(_FP8_NAMES[dtype.strip().lower()])
    try:
        parsed = parse_dtype(dtype, f"CommunicationPolicy {field_name}")
    except ValueError as error:
        fp8 = " Or float8_e4m3fn (fp8) for FP8 weight gathers." if field_name == "gather_dtype" else ""
        raise ValueError(f"{error} Or 'param' (or None) for each parameter's own dtype.{fp8}") from None
    if jnp.finfo(parsed).bits <= 8 and parsed not in FP8_GATHER_DTYPES:
        raise ValueError(
            f"CommunicationPolicy {field_name} {parsed.name} is an 8-bit format jaxamp does not gather in; "
            "use float8_e4m3fn (or float8_e5m2)."
        )
    return parsed


def _is_fp8(dtype: np.dtype | None) -> bool:
    return dtype is not None and dtype in FP8_GATHER_DTYPES


def is_narrower(dtype: Any, than: Any) -> bool:
    """Whether summing in `dtype` loses what `than` holds.

    Fewer bits is narrower; so is another format of as many bits (bfloat16
    against float16 loses mantissa, float16 against bfloat16 loses range).
    """
    dtype, than = jnp.dtype(dtype), jnp.dtype(than)
    if dtype == than:
        return False
    return jnp.finfo(dtype).bits <= jnp.finfo(than).bits


@dataclasses.dataclass(frozen=True)
class CommunicationPolicy:
    """The dtypes in which sharded parameters are gathered and gradients summed.

    Immutable and hashable (a static argument of `jax.jit`); ``str(policy)``
    gives a string that `get_communication_policy` parses back.

    Examples:
        >>> str(CommunicationPolicy(gather_dtype="bf16", reduce_dtype="f32"))
        'gather=bfloat16,reduce=float32'
        >>> str(CommunicationPolicy.from_policy("mixed_bf16"))
        'gather=bfloat16,reduce=float32'

    Attributes:
        gather_dtype: the dtype each parameter shard is cast to before the
            all-gather, hence the dtype of the full parameters the loss
            function receives. None: each parameter's own dtype. An FP8
            dtype (``"float8_e4m3fn"``, or ``"fp8"``/``"e4m3"``; also
            ``"float8_e5m2"``) gathers the weights of matmuls
            (`fp8_gather_eligible`) in FP8 with one global scale each,
            and the loss receives them in `dequantize_dtype`.
        reduce_dtype: the dtype local gradients are cast to before they are
            summed over the devices (reduce-scatter for sharded parameters,
            all-reduce for replicated ones); the sum is cast back to the
            parameter's dtype. None: each parameter's own dtype.
        allow_narrow_reduce: accept a `reduce_dtype` narrower than a
            parameter's dtype (bfloat16 sums of float32 gradients; replicated
            parameters then also reach the loss rounded to it). Off by
            default: a bfloat16 sum over many devices keeps 8 significant
            bits.
        dequantize_dtype: with an FP8 `gather_dtype` only: the dtype the
            FP8 weights are dequantized into after the gather, and the
            dtype the other floating parameters are gathered in (the compute
            dtype; bfloat16 when not given).
    """

    gather_dtype: np.dtype | None = None
    reduce_dtype: np.dtype | None = None
    allow_narrow_reduce: bool = False
    dequantize_dtype: np.dtype | None = None

    def __post_init__(self):
        gather_dtype = _communication_dtype(self.gather_dtype, "gather_dtype")
        reduce_dtype = _communication_dtype(self.reduce_dtype, "reduce_dtype")
        dequantize_dtype = _communication_dtype(self.dequantize_dtype, "dequantize_dtype")
        if _is_fp8(reduce_dtype):
            raise ValueError(
                f"CommunicationPolicy reduce_dtype {reduce_dtype.name}: gradients are not summed in FP8 "
                "(a sum over devices in 3 mantissa bits, with no scale per gradient). FP8 is for "
                "gathers: pass gather_dtype='float8_e4m3fn' and reduce_dtype=None (each parameter's "
                "own dtype) or 'float32'."
            )
        if _is_fp8(dequantize_dtype):
            raise ValueError(
                f"CommunicationPolicy dequantize_dtype {dequantize_dtype.name}: the loss receives the "
                "gathered weights in a compute dtype; use 'bfloat16', 'float16' or 'float32'."
            )
        if dequantize_dtype is not None and not _is_fp8(gather_dtype):
            raise ValueError(
                f"CommunicationPolicy dequantize_dtype={dequantize_dtype.name} applies to FP8 gathers "
                f"only, and gather_dtype is {'param' if gather_dtype is None else gather_dtype.name}. "
                "Pass gather_dtype='float8_e4m3fn', or leave dequantize_dtype out."
            )
        if _is_fp8(gather_dtype) and dequantize_dtype is None:
            dequantize_dtype = jnp.dtype(jnp.bfloat16)
        object.__setattr__(self, "gather_dtype", gather_dtype)
        object.__setattr__(self, "reduce_dtype", reduce_dtype)
        object.__setattr__(self, "dequantize_dtype", dequantize_dtype)
        if not isinstance(self.allow_narrow_reduce, bool):
            raise TypeError(
                "CommunicationPolicy allow_narrow_reduce must be True or False; got "
                f"{self.allow_narrow_reduce!r}."
            )

    @property
    def fp8_gathers(self) -> bool:
        """Whether the weights of matmuls are gathered in FP8 (`gather_dtype` is an FP8 dtype)."""
        return _is_fp8(self.gather_dtype)

    @classmethod
    def from_policy(cls, policy: PolicySpec, **overrides) -> CommunicationPolicy:
        """Gathers in the policy's compute dtype and reduces in its param dtype.

        The model computes in ``compute_dtype`` anyway (`jaxamp.apply_policy`
        casts its params there), so gathering them in that dtype moves fewer
        bytes and changes no matmul; gradients are summed in the dtype the
        params are stored and updated in.

        With ``gather_dtype="float8_e4m3fn"`` among the overrides, the FP8
        weights are dequantized into the compute dtype.

        Args:
            policy: anything `jaxamp.get_policy` accepts.
            **overrides: fields to set instead (``reduce_dtype=...``).
        """
        policy = get_policy(policy)
        fields = {"gather_dtype": policy.compute_dtype, "reduce_dtype": policy.param_dtype}
        if _is_fp8(_communication_dtype(overrides.get("gather_dtype"), "gather_dtype")):
            fields["dequantize_dtype"] = policy.compute_dtype
        return cls(**{**fields, **overrides})

    def gather_dtype_for(self, param_dtype: Any) -> np.dtype:
        """The dtype a floating parameter stored in `param_dtype` is gathered in, if not in FP8."""
        if self.fp8_gathers:
            return self.dequantize_dtype
        return jnp.dtype(param_dtype) if self.gather_dtype is None else self.gather_dtype

    def reduce_dtype_for(self, param_dtype: Any) -> np.dtype:
        """The dtype the gradients of a parameter stored in `param_dtype` are summed in."""
        return jnp.dtype(param_dtype) if self.reduce_dtype is None else self.reduce_dtype

    def __str__(self) -> str:
        gather = "param" if self.gather_dtype is None else self.gather_dtype.name
        reduce = "param" if self.reduce_dtype is None else self.reduce_dtype.name
        text = f"gather={gather},reduce={reduce}"
        if self.fp8_gathers:
            text += f",dequantize={self.dequantize_dtype.name}"
        return text + (",allow_narrow_reduce" if self.allow_narrow_reduce else "")


_COMMUNICATION_KEYS = {
    "gather": "gather_dtype",
    "g": "gather_dtype",
    "reduce": "reduce_dtype",
    "r": "reduce_dtype",
    "dequantize": "dequantize_dtype",
}


def get_communication_policy(spec: CommunicationPolicy | str | None) -> CommunicationPolicy:
    """Returns the `CommunicationPolicy` that `spec` names.

    Args:
        spec: a `CommunicationPolicy` (returned as is); None or ``"param"``
            (each parameter's own dtype both ways); or a string such as
            ``"gather=bf16,reduce=f32"`` with keys ``gather``/``g``,
            ``reduce``/``r`` and ``dequantize`` (with FP8 gathers:
            ``"gather=fp8,reduce=f32,dequantize=bf16"``), values a dtype
            alias or ``param``, and the bare token ``allow_narrow_reduce``
            to accept a narrow reduce dtype.

    Raises:
        ValueError: the string is malformed; the message names the bad part.
    """
    if isinstance(spec, CommunicationPolicy):
        return spec
    if spec is None:
        return CommunicationPolicy()
    if not isinstance(spec, str):
        raise TypeError(
            "A communication policy must be a jaxamp.fsdp.CommunicationPolicy, None or a string such as "
            f"'gather=bf16,reduce=f32'; got {type(spec).__name__}: {spec!r}."
        )
    normalized = "".join(spec.split()).lower()
    if normalized in ("", *_OWN_DTYPE):
        return CommunicationPolicy()
    fields = parse_fields(
        spec, _COMMUNICATION_KEYS, kind="communication policy", example="gather=bf16,reduce=f32",
        flags=("allow_narrow_reduce",),
    )  # fmt: skip
    return CommunicationPolicy(**fields)


def _check_axis(mesh: Any, axis: str) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"FSDP needs a jax.sharding.Mesh (e.g. jax.make_mesh((jax.device_count(),), ('data',))); "
            f"got {type(mesh).__name__}."
        )
    if axis not in mesh.axis_names:
        raise ValueError(
            f"Mesh axis {axis!r} is not in the mesh, whose axes are {tuple(mesh.axis_names)}. Pass "
            "axis= one of them, or build the mesh with that axis name."
        )
    return mesh.shape[axis]


def shard_dimension(shape: tuple[int, ...], axis_size: int) -> int | None:
    """The dimension a leaf of `shape` is split along, or None to replicate it.

    The largest dimension that divides by `axis_size` (the first of equals);
    None for scalars and for leaves none of whose dimensions divides. The
    rule depends on shapes only, so a parameter and its optimizer moments
    split alike, and `fsdp_loss` finds the same split from traced shapes.
    """
    candidates = [(size, -index) for index, size in enumerate(shape) if size % axis_size == 0 and size > 0]
    if not candidates:
        return None
    return -max(candidates)[1]


def _param_spec(shape: tuple[int, ...], axis: str, axis_size: int) -> PartitionSpec:
    dimension = shard_dimension(tuple(shape), axis_size)
    if dimension is None:
        return PartitionSpec()
    return PartitionSpec(*([None] * dimension), axis)


def fsdp_shardings(tree: Any, mesh: Mesh, *, axis: str = "data") -> Any:
    """`NamedSharding`s that split each array leaf of `tree` over `axis`.

    Use it for params, optimizer state or a whole `jaxamp.TrainState`:
    ``jax.device_put(state, fsdp_shardings(state, mesh))``. Each leaf is
    split along the dimension `shard_dimension` picks (the same one
    `fsdp_loss` gathers along); scalars and leaves with no divisible
    dimension are replicated. An 8-bit optimizer state leaf of
    `jaxamp.low_precision_optimizer` (codes shaped like the array, a scale
    per block of its flattened elements) is split along its first dimension,
    each device holding whole blocks and their scales; a leaf of one block
    (a scale per leaf) splits its codes so, its scale on every device; a
    leaf whose blocks would straddle devices is replicated.

    Args:
        tree: a pytree of arrays (or ``ShapeDtypeStruct``s).
        mesh: the device mesh.
        axis: the mesh axis to split over.

    Returns:
        A pytree of `NamedSharding` with the structure of `tree`.
    """
    axis_size = _check_axis(mesh, axis)

    def sharding(leaf):
        if isinstance(leaf, QuantizedArray):
            codes_split, scales_split = splits_by_rows(
                np.shape(leaf.codes), np.shape(leaf.scales)[0], axis_size
            )
            return QuantizedArray(
                NamedSharding(mesh, PartitionSpec(axis if codes_split else None)),
                NamedSharding(mesh, PartitionSpec(axis if scales_split else None)),
                leaf.format,
            )
        return NamedSharding(mesh, _param_spec(np.shape(leaf), axis, axis_size))

    return jax.tree.map(sharding, tree, is_leaf=lambda leaf: isinstance(leaf, QuantizedArray))


def _key_name(path) -> str:
    return jax.tree_util.keystr(path) or "(root)"


def _gather_sharded(shard: jax.Array, axis: str, dimension: int, gather_dtype, reduce_dtype) -> jax.Array:
    """All-gathers `shard` in `gather_dtype`; its VJP reduce-scatters in `reduce_dtype`."""

    @jax.custom_vjp
    def gather(local):
        return jax.lax.all_gather(local.astype(gather_dtype), axis, axis=dimension, tiled=True)

    def forward(local):
        return gather(local), None

    def backward(_, local_grad):
        summed = jax.lax.psum_scatter(
            local_grad.astype(reduce_dtype), axis, scatter_dimension=dimension, tiled=True
        )
        return (summed.astype(shard.dtype),)

    gather.defvjp(forward, backward)
    return gather(shard)


def _reshard(tree: Any, specs: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda leaf, spec: jax.sharding.reshard(leaf, NamedSharding(mesh, spec)), tree, specs)


def _batch_argument_name(loss_fn: Callable[..., Any], index: int) -> str:
    """How to name batch argument `index` (the loss function's argument ``index + 1``)."""
    try:
        parameters = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if index + 1 < len(positional):
        return f"argument {positional[index + 1].name!r}"
    return f"argument {index + 2} of the loss function (params are argument 1)"


def _check_reduce_dtype(path, leaf, communication: CommunicationPolicy) -> None:
    reduce_dtype = communication.reduce_dtype_for(leaf.dtype)
    if is_narrower(reduce_dtype, leaf.dtype) and not communication.allow_narrow_reduce:
        raise ValueError(
            f"Parameter {_key_name(path)} is {jnp.dtype(leaf.dtype).name}, but the communication "
            f"policy {communication} sums its gradients in {reduce_dtype.name}, a narrower dtype: "
            "each device's gradient would be rounded before the sum and the sum itself kept to "
            f"{jnp.finfo(reduce_dtype).nmant + 1} significant bits. Use reduce_dtype=None (each "
            f"parameter's own dtype) or {jnp.dtype(leaf.dtype).name}, or pass "
            "allow_narrow_reduce=True to accept it."
        )


def fsdp_loss(
    loss_fn: Callable[..., Any],
    mesh: Mesh,
    communication: CommunicationPolicy | str | None = None,
    *,
    axis: str = "data",
    has_aux: bool = False,
    fp8_eligible: Callable[[Any, tuple[int, ...], Any, bool], bool] = fp8_gather_eligible,
) -> Callable[..., Any]:
    """Makes a loss function run fully sharded, communicating as `communication` says.

    The returned function has `loss_fn`'s signature, ``(params, *batch)``,
    and returns the loss of the whole batch. Differentiate it with
    `jax.value_and_grad` or `jaxamp.scaled_value_and_grad` inside `jax.jit`:
    the gradients come out split like the params (`fsdp_shardings`), ready
    for the optimizer, which then updates each shard where it lives.

    Per step and per parameter leaf split over `axis`, each device:

    1. casts its shard to the gather dtype and all-gathers it (the full
       parameter is in the gather dtype);
    2. runs ``loss_fn(full_params, *local_batch)`` on its share of the batch;
       the returned loss is averaged over the devices (``pmean``);
    3. in the backward pass, casts the gradient of its local loss to the
       reduce dtype and reduce-scatters it: each device gets the sum of its
       shard, cast back to the parameter's dtype.

    With an FP8 gather dtype, step 1 of the eligible weights (`fp8_eligible`)
    is the FP8 gather's instead: one ``pmax`` of all their amaxes, each
    shard quantized with its weight's global scale, FP8 all-gathers, the
    full weights dequantized into ``dequantize_dtype``; step 3 is unchanged.
    Replicated leaves (no dimension divides by the axis size) skip step 1
    and are all-reduced in step 3. The loss equals the unsharded loss of
    the whole batch when `loss_fn` returns a mean over examples, as losses
    usually do (each device holds as many examples). The gathered params
    stay in memory from the forward to the backward pass (one full copy in
    the gather dtype; the backward pass does not gather again).

    Args:
        loss_fn: ``loss_fn(params, *batch)`` returning a scalar loss, or
            ``(loss, aux)`` with `has_aux`. Compose precision policies
            inside it: an `apply_policy` model, or ``jaxamp.autocast(loss_fn,
            policy)`` passed here.
        mesh: the device mesh; the params must be placed with
            `fsdp_shardings` on it (or the partitioner will reshard them).
        communication: a `CommunicationPolicy` or a string
            `get_communication_policy` parses; None communicates in each
            parameter's own dtype.
        axis: the mesh axis params and batch are split over. Other mesh axes,
            if any, see the params and the batch replicated.
        has_aux: whether `loss_fn` returns ``(loss, aux)``; aux leaves must be
            floating arrays and are averaged over the devices, like the loss.
        fp8_eligible: with an FP8 gather dtype, which parameters are
            gathered in FP8: ``fp8_eligible(path, shape, dtype, sharded)``
            (`fp8_gather_eligible` by default; e.g. also refuse the paths
            of embedding tables to gather only ``Dense`` kernels in FP8, as
            torchao does).

    Returns:
        ``sharded_loss(params, *batch)``. Every batch leaf with a dimension
        is split along its leading one (which must divide by the axis size);
        scalar leaves are passed to every device as they are.

    Raises:
        ValueError: `axis` is not in `mesh` (at once); a batch leaf's leading
            dimension does not divide by the axis size, or the reduce dtype
            is narrower than a parameter's dtype without
            ``allow_narrow_reduce`` (when traced).
        TypeError: the loss is not a scalar, or an aux leaf not a float
            (when traced).
    """
    axis_size = _check_axis(mesh, axis)
    communication = get_communication_policy(communication)

    def gather(params, layout):
        """The full params from this device's shards; `layout` from the global arrays."""
        leaves, treedef = jax.tree.flatten(params)
        fp8_indices = [index for index, (_, _, in_fp8) in enumerate(layout) if in_fp8]
        in_fp8 = dict(zip(fp8_indices, gather_fp8(
            [leaves[index] for index in fp8_indices],
            [layout[index][0] for index in fp8_indices],
            [communication.reduce_dtype_for(layout[index][1]) for index in fp8_indices],
            axis=axis, fp8_dtype=communication.gather_dtype, dequantize_dtype=communication.dequantize_dtype,
        )))  # fmt: skip
        gathered = []
        for index, (leaf, (dimension, dtype, _)) in enumerate(zip(leaves, layout)):
            if index in in_fp8:
                gathered.append(in_fp8[index])
                continue
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                # No gradient to reduce: a plain gather in the leaf's own dtype.
                if dimension is not None:
                    leaf = jax.lax.all_gather(leaf, axis, axis=dimension, tiled=True)
                gathered.append(leaf)
                continue
            if dimension is None:
                # Replicated: made per-device here, in the reduce dtype, so
                # that the transpose of this cast to varying (the sum of
                # the devices' gradients) runs in the reduce dtype.
                reduce_dtype = communication.reduce_dtype_for(dtype)
                varying = jax.lax.pcast(leaf.astype(reduce_dtype), axis, to="varying")
                gathered.append(varying.astype(dtype))
            else:
                reduce_dtype = communication.reduce_dtype_for(dtype)
                gather_dtype = communication.gather_dtype_for(dtype)
                gathered.append(_gather_sharded(leaf, axis, dimension, gather_dtype, reduce_dtype))
        return jax.tree.unflatten(treedef, gathered)

    def local_loss(layout, params, *batch):
        output = loss_fn(gather(params, layout), *batch)
        if has_aux:
            if not (isinstance(output, tuple) and len(output) == 2):
                raise TypeError(
                    f"fsdp_loss(has_aux=True) needs loss_fn to return a (loss, aux) pair; it returned "
                    f"{type(output).__name__}."
                )
            loss, aux = output
        else:
            loss, aux = output, None
        loss = jnp.asarray(loss)
        if loss.shape != ():
            raise TypeError(
                f"fsdp_loss needs loss_fn to return a scalar loss; got shape {loss.shape}. Reduce it "
                "(e.g. with .mean()) first."
            )
        for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
            if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
                raise TypeError(
                    f"fsdp_loss averages aux over the devices; aux leaf {_key_name(path)} is "
                    f"{jnp.result_type(leaf).name}. Return it as a float (e.g. a count as float32)."
                )
        averaged = jax.lax.pmean(loss, axis)
        return (averaged, jax.lax.pmean(aux, axis)) if has_aux else averaged

    def batch_spec(path, leaf):
        shape = np.shape(leaf)
        if not shape:
            return PartitionSpec()
        if shape[0] % axis_size:
            name = _batch_argument_name(loss_fn, path[0].idx) + jax.tree_util.keystr(path[1:])
            raise ValueError(
                f"Batch {name}, of shape {shape}, does not split over the {axis_size} "
                f"devices of mesh axis {axis!r}: its leading dimension {shape[0]} must be a multiple "
                f"of {axis_size}. Choose a batch size that is."
            )
        return PartitionSpec(axis)

    @functools.wraps(loss_fn)
    def sharded_loss(params, *batch):
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                _check_reduce_dtype(path, leaf, communication)
        param_specs = jax.tree.map(lambda leaf: _param_spec(np.shape(leaf), axis, axis_size), params)
        layout = tuple(
            (
                dimension := shard_dimension(np.shape(leaf), axis_size),
                leaf.dtype,
                communication.fp8_gathers
                and fp8_eligible(path, tuple(np.shape(leaf)), leaf.dtype, dimension is not None),
            )
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        )
        batch_specs = jax.tree_util.tree_map_with_path(batch_spec, batch)
        out_specs = (PartitionSpec(), PartitionSpec()) if has_aux else PartitionSpec()
        if jax.sharding.AxisType.Explicit in mesh.axis_types:
            # Explicit axes type every array with its sharding, and shard_map
            # refuses an input typed otherwise than its spec: place it first
            # (a no-op for inputs placed by fsdp_shardings).
            params = _reshard(params, param_specs, mesh)
            batch = tuple(_reshard(part, specs, mesh) for part, specs in zip(batch, batch_specs))
        return jax.shard_map(
            functools.partial(local_loss, layout),
            mesh=mesh,
            in_specs=(param_specs, *batch_specs),
            out_specs=out_specs,
            # JAX's varying-axes types (its default): each collective's
            # transpose is typed, so the gradients are summed exactly where
            # the program says (the reduce-scatter of a sharded leaf, the
            # cast to varying of a replicated one) and nowhere else.
            check_vma=True,
        )(params, *batch)

    return sharded_loss
