"""Tests for `jaxamp.Policy` and `jaxamp.get_policy`.

The string grammar is checked name by name against the issue's table and,
wherever jmp accepts a string, against `jmp.get_policy` itself. Casting is
checked property-based over random pytrees of mixed leaf types.
"""

import dataclasses

import hypothesis
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jaxamp

F32, F16, BF16 = np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16)
HALF = np.dtype(jmp.half_dtype())  # float16 on CPU and GPU, bfloat16 on TPU

# The table of names: (params, compute, output).
NAMED_POLICIES = {
    "float32": (F32, F32, F32),
    "fp32": (F32, F32, F32),
    "full": (F32, F32, F32),
    "mixed": (F32, F16, F32),
    "mixed_float16": (F32, F16, F32),
    "mixed_fp16": (F32, F16, F32),
    "mixed_bfloat16": (F32, BF16, F32),
    "mixed_bf16": (F32, BF16, F32),
    "float16": (F16, F16, F16),
    "fp16": (F16, F16, F16),
    "bfloat16": (BF16, BF16, BF16),
    "bf16": (BF16, BF16, BF16),
}

# jmp's grammar: a lone dtype alias, or key=dtype parts with jmp's defaults
# (params float32, compute follows params, output follows compute).
GRAMMAR_POLICIES = {
    "f32": (F32, F32, F32),
    "f16": (F16, F16, F16),
    "half": (HALF, HALF, HALF),
    "c=f16": (F32, F16, F16),
    "compute=bfloat16": (F32, BF16, BF16),
    "p=f16": (F16, F16, F16),
    "params=bf16": (BF16, BF16, BF16),
    "p=f16,c=bf16": (F16, BF16, BF16),
    "o=bf16": (F32, F32, BF16),
    "output=float16": (F32, F32, F16),
    "p=f32,c=f16,o=f32": (F32, F16, F32),
    "params=float32,compute=float16,output=float32": (F32, F16, F32),
    "p=full,c=half,o=full": (F32, HALF, F32),
    "o=f32,c=f16": (F32, F16, F32),
    "c=bf16,p=full": (F32, BF16, BF16),
}

# Every dtype alias jmp 0.0.4's parser knows, and the key spellings.
JMP_DTYPE_ALIASES = ["bf16", "bfloat16", "f16", "float16", "full", "f32", "float32", "f64", "float64", "half"]
JMP_KEYS = {"param": ("p", "params"), "compute": ("c", "compute"), "output": ("o", "output")}


def dtypes(policy):
    return (policy.param_dtype, policy.compute_dtype, policy.output_dtype)


def jmp_dtypes(policy):
    return tuple(np.dtype(dtype) for dtype in dtypes(policy))


# --- the grammar --------------------------------------------------------------


@pytest.mark.parametrize("spec, expected", sorted({**NAMED_POLICIES, **GRAMMAR_POLICIES}.items()))
def test_every_name_alias_and_grammar_string_gives_its_dtypes(spec, expected):
    policy = jaxamp.get_policy(spec)
    assert isinstance(policy, jaxamp.Policy)
    assert dtypes(policy) == expected


@pytest.mark.parametrize(
    "spec, same_as",
    [
        ("MIXED_FLOAT16", "mixed_float16"),
        ("Mixed_BF16", "mixed_bf16"),
        ("  mixed  ", "mixed"),
        ("\tFP16\n", "fp16"),
        ("mixed _ float 16", "mixed_float16"),
        ("P = F32 , C = F16 , O = F32", "p=f32,c=f16,o=f32"),
        ("Params=Float32, Compute=BFloat16", "params=float32,compute=bfloat16"),
        ("HALF", "half"),
    ],
)
def test_strings_are_case_insensitive_and_ignore_spaces(spec, same_as):
    assert jaxamp.get_policy(spec) == jaxamp.get_policy(same_as)


@pytest.mark.parametrize("spec", sorted(GRAMMAR_POLICIES) + ["float16", "bfloat16", "bf16", "full", "f64"])
def test_jmp_valid_strings_parse_as_jmp_parses_them(spec):
    assert dtypes(jaxamp.get_policy(spec)) == jmp_dtypes(jmp.get_policy(spec))


@st.composite
def jmp_grammar_strings(draw):
    """A string jmp accepts: a lone alias, or key=alias parts in any order."""
    if draw(st.booleans()):
        return draw(st.sampled_from(JMP_DTYPE_ALIASES))
    roles = draw(st.lists(st.sampled_from(sorted(JMP_KEYS)), min_size=1, max_size=3, unique=True))
    return ",".join(
        f"{draw(st.sampled_from(JMP_KEYS[role]))}={draw(st.sampled_from(JMP_DTYPE_ALIASES))}"
        for role in roles
    )


@hypothesis.given(spec=jmp_grammar_strings(), data=st.data())
def test_any_jmp_grammar_string_matches_jmp_also_respelled(spec, data):
    expected = jmp_dtypes(jmp.get_policy(spec))
    assert dtypes(jaxamp.get_policy(spec)) == expected
    # jmp is case-sensitive and rejects spaces; jaxamp accepts the same string
    # in any case, with spaces anywhere.
    respelled = "".join(
        (character.upper() if data.draw(st.booleans()) else character)
        + (" " if data.draw(st.booleans()) else "")
        for character in spec
    )
    assert dtypes(jaxamp.get_policy(respelled)) == expected


def test_a_jmp_policy_is_converted():
    policy = jaxamp.get_policy(jmp.get_policy("p=f32,c=bf16,o=f16"))
    assert isinstance(policy, jaxamp.Policy)
    assert dtypes(policy) == (F32, BF16, F16)
    assert jmp_dtypes(policy.to_jmp()) == (F32, BF16, F16)


def test_a_policy_is_returned_as_is():
    policy = jaxamp.Policy(jnp.float32, jnp.float16, jnp.float32)
    assert jaxamp.get_policy(policy) is policy


# A mistyped name is answered with each policy's main name (its aliases are in get_policy's docstring).
NAME_LIST = ["mixed_float16", "mixed_bfloat16", "mixed_float8", "float32", "float16", "bfloat16", "half",
             "bfloat16_kahan", "bfloat16_stochastic", "bfloat16_int8", "p=f32,c=f16,o=f32"]  # fmt: skip
DTYPE_LIST = ["f32", "float32", "full", "f16", "float16", "bf16", "bfloat16", "half"]
KEY_LIST = ["p", "params", "c", "compute", "o", "output"]


@pytest.mark.parametrize(
    "spec, bad_token, valid_choices",
    [
        ("mixd", "mixd", NAME_LIST),
        ("float8", "float8", NAME_LIST),
        ("mixed_float32", "mixed_float32", NAME_LIST),
        ("", "''", NAME_LIST),
        ("p=f8", "f8", DTYPE_LIST),
        ("c=f16,o=double", "double", DTYPE_LIST),
        ("q=f32", "q", KEY_LIST),
        ("param=f32", "param", KEY_LIST),
        ("p=f32,", "''", ["key=dtype"]),
        ("mixed,c=f16", "mixed", ["key=dtype"]),
        ("p=", "p=", ["key=dtype"]),
        ("=f32", "=f32", ["key=dtype"]),
        ("p==f32", "'=f32'", DTYPE_LIST),
    ],
)
def test_bad_strings_raise_a_value_error_naming_the_token_and_the_choices(spec, bad_token, valid_choices):
    with pytest.raises(ValueError) as error:
        jaxamp.get_policy(spec)
    message = str(error.value)
    assert bad_token in message
    for choice in valid_choices:
        assert choice in message


@pytest.mark.parametrize("spec", [None, 16, 1.5, jnp.float16, np.dtype("float16"), b"mixed", ["mixed"]])
def test_specs_of_other_types_raise_a_type_error(spec):
    with pytest.raises(TypeError, match="string"):
        jaxamp.get_policy(spec)


def test_an_update_of_1e_4_relative_size_vanishes_in_a_float16_weight_but_not_in_float32():
    # Why params stay in float32 under a mixed policy: float16 keeps 11
    # significant bits, so 1 + 1e-4 rounds back to 1.
    weight, update = 1.0, 1e-4
    assert jnp.float16(weight) + jnp.float16(update) == jnp.float16(weight)
    assert jnp.float32(weight) + jnp.float32(update) > jnp.float32(weight)


# --- the Policy value ---------------------------------------------------------


def test_a_policy_reads_half_as_jmps_half_dtype():
    policy = jaxamp.Policy("half", "half", "float32")
    assert (policy.param_dtype, policy.compute_dtype) == (np.dtype(jmp.half_dtype()),) * 2


def test_a_policy_is_immutable():
    policy = jaxamp.get_policy("mixed")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.compute_dtype = jnp.float32


def test_equal_policies_hash_alike_and_jit_treats_them_as_one_static_argument():
    spellings = [
        jaxamp.get_policy("mixed"),
        jaxamp.get_policy("MIXED_FP16"),
        jaxamp.Policy(np.float32, "float16", jnp.dtype("float32")),
        jaxamp.get_policy(jmp.get_policy("c=f16,o=f32")),
    ]
    assert len(set(spellings)) == 1
    assert len({hash(policy) for policy in spellings}) == 1

    traces = []

    def cast(x, policy):
        traces.append(policy)
        return policy.cast_to_compute(x)

    cast = jax.jit(cast, static_argnums=1)
    for policy in spellings:
        assert cast(jnp.ones(2), policy).dtype == F16
    assert len(traces) == 1


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, "banana", object(), None])
def test_a_policy_rejects_non_floating_dtypes(dtype):
    with pytest.raises(ValueError, match="Policy compute_dtype must be a floating dtype"):
        jaxamp.Policy(jnp.float32, dtype, jnp.float32)


def test_one_parser_reads_every_dtype_a_policy_or_a_communication_policy_names():
    """The same names, the same error type and the same choices, whichever setting is read (before the one
    parser, "half" was refused by CommunicationPolicy, and a bad name was a TypeError from Policy but a
    ValueError from get_policy)."""
    half = np.dtype(jmp.half_dtype())
    assert jaxamp.Policy("half", "half", "half").compute_dtype == half
    assert jaxamp.get_policy("c=half").compute_dtype == half
    assert jaxamp.fsdp.CommunicationPolicy(gather_dtype="half").gather_dtype == half
    assert jaxamp.fsdp.get_communication_policy("gather=half").gather_dtype == half
    refusals = [
        lambda: jaxamp.Policy("f32", "double", "f32"),
        lambda: jaxamp.get_policy("c=double"),
        lambda: jaxamp.fsdp.CommunicationPolicy(reduce_dtype="double"),
        lambda: jaxamp.fsdp.get_communication_policy("reduce=double"),
    ]
    for refuse in refusals:
        with pytest.raises(ValueError) as refused:
            refuse()
        message = str(refused.value)
        assert "must be a floating dtype" in message and "got 'double'" in message, message
        assert all(name in message for name in DTYPE_LIST), message


def test_precision_and_communication_strings_share_one_grammar_and_its_errors():
    from jaxamp._policy import parse_fields

    keys = {"a": "alpha", "b": "beta"}
    assert parse_fields(" A = x , b=Y ", keys, kind="thing", example="a=x") == {"alpha": "x", "beta": "y"}
    assert parse_fields("a=x,on", keys, kind="thing", example="a=x", flags=("on",)) == {"alpha": "x", "on": True}
    with pytest.raises(ValueError, match=r"^Unknown key 'q' in thing 'q=1'\. Valid keys: a, b; e\.g\. 'a=x'\.$"):
        parse_fields("q=1", keys, kind="thing", example="a=x")
    with pytest.raises(ValueError, match=r"^Malformed part 'a' in thing 'a': expected key=dtype, on, e\.g\. 'a=x'\.$"):
        parse_fields("a", keys, kind="thing", example="a=x", flags=("on",))
    for spec, kind in (("q=f32", "precision policy"), ("q=f32", "communication policy")):
        parse = jaxamp.get_policy if kind == "precision policy" else jaxamp.fsdp.get_communication_policy
        with pytest.raises(ValueError, match=rf"^Unknown key 'q' in {kind} 'q=f32'"):
            parse(spec)


@pytest.mark.parametrize("spec", sorted({**NAMED_POLICIES, **GRAMMAR_POLICIES}))
def test_str_is_readable_and_round_trips_through_get_policy_and_jmp(spec):
    policy = jaxamp.get_policy(spec)
    text = str(policy)
    assert text == (
        f"params={policy.param_dtype.name},compute={policy.compute_dtype.name},"
        f"output={policy.output_dtype.name}"
    )
    assert jaxamp.get_policy(text) == policy
    assert jmp_dtypes(jmp.get_policy(text)) == dtypes(policy)


def test_with_output_dtype_returns_a_new_policy_and_leaves_the_old_one_alone():
    mixed = jaxamp.get_policy("mixed_float16")
    half_output = mixed.with_output_dtype(jnp.float16)
    assert dtypes(half_output) == (F32, F16, F16)
    assert dtypes(mixed) == (F32, F16, F32)
    assert dtypes(mixed.with_output_dtype("bfloat16")) == (F32, F16, BF16)
    with pytest.raises(ValueError, match="Policy output_dtype must be a floating dtype"):
        mixed.with_output_dtype(jnp.int8)


# --- the update rounding ------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected_dtypes, rounding",
    [
        ("bfloat16_nearest", (BF16, BF16, BF16), "nearest"),
        ("bfloat16_stochastic", (BF16, BF16, BF16), "stochastic"),
        ("bfloat16_kahan", (BF16, BF16, BF16), "kahan"),
        ("BF16_Kahan", (BF16, BF16, BF16), "kahan"),
        ("bf16_stochastic", (BF16, BF16, BF16), "stochastic"),
        ("p=bf16,update=kahan", (BF16, BF16, BF16), "kahan"),
        ("p=bf16,c=bf16,o=f32,u=Stochastic", (BF16, BF16, F32), "stochastic"),
        ("params=float16, update = nearest", (F16, F16, F16), "nearest"),
        ("bfloat16", (BF16, BF16, BF16), None),
        ("mixed_bf16", (F32, BF16, F32), None),
    ],
)
def test_a_policy_names_how_updates_land_and_round_trips_through_its_string(spec, expected_dtypes, rounding):
    policy = jaxamp.get_policy(spec)
    assert dtypes(policy) == expected_dtypes
    assert policy.update_rounding == rounding
    assert str(policy).endswith(f",update={rounding}") == (rounding is not None)
    assert jaxamp.get_policy(str(policy)) == policy
    # jmp has no update rounding: the dtypes survive, the rounding is dropped.
    assert jmp_dtypes(policy.to_jmp()) == expected_dtypes


def test_a_policy_with_an_update_rounding_differs_from_the_one_without_and_autocasts_alike():
    kahan, plain = jaxamp.get_policy("bfloat16_kahan"), jaxamp.get_policy("bfloat16")
    assert kahan != plain
    assert dataclasses.replace(kahan, update_rounding=None) == plain
    tree = {"w": jnp.ones(3), "step": jnp.int32(2)}
    for method in ("cast_to_param", "cast_to_compute", "cast_to_output"):
        assert jax.tree.map(lambda leaf: leaf.dtype, getattr(kahan, method)(tree)) == jax.tree.map(
            lambda leaf: leaf.dtype, getattr(plain, method)(tree)
        )


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: jaxamp.get_policy("p=bf16,update=round"),
            ("Unknown update rounding 'round' in precision policy 'p=bf16,update=round'. Valid: nearest, "
             "stochastic, kahan (how jaxamp.low_precision_optimizer lands each update on the params); leave "
             "the key out for the optimizer's own update."),
        ),
        (
            lambda: jaxamp.Policy("bf16", "bf16", "bf16", update_rounding="Kahn"),
            ("Policy update_rounding must be None (the optimizer's update as optax applies it) or one of "
             "nearest, stochastic, kahan (how jaxamp.low_precision_optimizer lands each update on the "
             "params); got 'Kahn'."),
        ),
        (
            lambda: jaxamp.Policy("bf16", "bf16", "bf16", update_rounding=1),
            ("Policy update_rounding must be None (the optimizer's update as optax applies it) or one of "
             "nearest, stochastic, kahan (how jaxamp.low_precision_optimizer lands each update on the "
             "params); got 1."),
        ),
    ],
    ids=["grammar", "field", "not_a_string"],
)  # fmt: skip
def test_a_bad_update_rounding_names_the_valid_ones(make, message):
    with pytest.raises(ValueError) as raised:
        make()
    assert str(raised.value) == message


def test_the_policy_field_reads_its_rounding_case_insensitively():
    assert jaxamp.Policy("bf16", "bf16", "bf16", update_rounding=" KAHAN ").update_rounding == "kahan"


# --- casting ------------------------------------------------------------------

SHAPES = st.sampled_from([(), (3,), (2, 2)])


def astype_quietly(values, dtype):
    # Overflowing to inf is a legitimate result of a narrowing cast.
    with np.errstate(over="ignore"):
        return values.astype(dtype)


def jax_arrays():
    floating = st.builds(
        lambda values, dtype: jnp.asarray(astype_quietly(values, dtype)),
        hnp.arrays(np.float32, SHAPES),
        st.sampled_from([np.float16, jnp.bfloat16, np.float32]),
    )
    integral = hnp.arrays(st.sampled_from([np.int32, np.uint8, np.bool_]), SHAPES).map(jnp.asarray)
    return floating | integral


def numpy_arrays():
    floating = hnp.arrays(st.sampled_from([np.float16, np.float32, np.float64]), SHAPES)
    bfloat16 = hnp.arrays(np.float32, SHAPES).map(lambda values: astype_quietly(values, jnp.bfloat16))
    integral = hnp.arrays(st.sampled_from([np.int8, np.int64, np.bool_]), SHAPES)
    return floating | bfloat16 | integral


def numpy_scalars():
    dtypes = st.sampled_from([np.float16, np.float32, np.float64, np.int32, np.bool_])
    return dtypes.flatmap(lambda dtype: hnp.from_dtype(np.dtype(dtype)))


LEAVES = (
    jax_arrays()
    | numpy_arrays()
    | numpy_scalars()
    | st.integers()
    | st.floats()
    | st.booleans()
    | st.text(max_size=3)
    | st.none()
)
TREES = st.recursive(
    LEAVES,
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(st.text("abc", max_size=2), children, max_size=3)
    ),
    max_leaves=8,
)
FLOAT_DTYPES = st.sampled_from([F16, BF16, F32])


def is_floating_array(leaf):
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(leaf.dtype, jnp.floating)


@hypothesis.given(
    tree=TREES,
    policy_dtypes=st.tuples(FLOAT_DTYPES, FLOAT_DTYPES, FLOAT_DTYPES),
    method=st.sampled_from(["param", "compute", "output"]),
)
def test_casting_changes_floating_array_leaves_only(tree, policy_dtypes, method):
    policy = jaxamp.Policy(*policy_dtypes)
    target = getattr(policy, f"{method}_dtype")
    with np.errstate(over="ignore"):
        cast = getattr(policy, f"cast_to_{method}")(tree)

    assert jax.tree.structure(cast) == jax.tree.structure(tree)
    for before, after in zip(jax.tree.leaves(tree), jax.tree.leaves(cast), strict=True):
        if is_floating_array(before):
            assert after.dtype == target
            assert np.shape(after) == np.shape(before)
            # A JAX array stays a JAX array; NumPy values stay NumPy values.
            assert isinstance(after, jax.Array) == isinstance(before, jax.Array)
            expected = astype_quietly(np.asarray(before), target)
            # Compared in float32 (exact for every target): NumPy's NaN-aware
            # comparison does not recognise bfloat16 NaNs.
            np.testing.assert_array_equal(np.asarray(after).astype(np.float32), expected.astype(np.float32))
        else:
            assert after is before


def test_casting_works_on_traced_values_inside_jit():
    policy = jaxamp.get_policy("mixed_bfloat16")
    tree = {"x": jnp.ones(3), "labels": jnp.arange(3), "mask": jnp.ones(3, bool)}
    cast = jax.jit(policy.cast_to_compute)(tree)
    assert jax.tree.map(lambda leaf: leaf.dtype, cast) == {
        "x": BF16,
        "labels": np.dtype(jnp.int32),
        "mask": np.dtype(bool),
    }


@pytest.mark.parametrize(
    "names, dtypes",
    [(("f32", "f16", "bf16"), (F32, F16, BF16)), (("float32", "Float16", "full"), (F32, F16, F32))],
)
def test_a_policy_reads_dtype_names_with_jmps_aliases_not_numpys(names, dtypes):
    # NumPy alone would read "f16" as a 16-byte float.
    policy = jaxamp.Policy(*names)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == dtypes


# --- the whole message of every error: the interface a user reads ----------------------

_ALIASES = "bf16, bfloat16, f16, f32, f64, float16, float32, float64, fp16, fp32, full, half"
_GRAMMAR_EXAMPLE = "'params=float32,compute=float16,output=float32'"
_UNKNOWN_NAME = (
    "unknown precision policy {spec!r}. Did you mean mixed? Choose one of:\n"
    "  half compute:  mixed_float16 (mixed), mixed_bfloat16, mixed_float8, mixed_mxfp8, mixed_nvfp4\n"
    "  one dtype:     float32, float16, bfloat16, half (float16; bfloat16 on TPU)\n"
    "  bf16 params:   bfloat16_kahan, bfloat16_stochastic, bfloat16_nearest, bfloat16_int8, bfloat16_fp8\n"
    "  or a spec:     'p=f32,c=f16,o=f32'; help(jaxamp.get_policy) lists every alias and key"
)


@pytest.mark.parametrize(
    "make, error_type, message",
    [
        (
            lambda: jaxamp.Policy(jnp.float32, None, jnp.float32),
            ValueError,
            ("Policy compute_dtype must be a floating dtype, such as jnp.float32, jnp.float16 or "
             f"jnp.bfloat16, or one of the names {_ALIASES}; got None."),
        ),
        (
            lambda: jaxamp.Policy("f17", jnp.float32, jnp.float32),
            ValueError,
            ("Policy param_dtype must be a floating dtype, such as jnp.float32, jnp.float16 or "
             f"jnp.bfloat16, or one of the names {_ALIASES}; got 'f17'."),
        ),
        (
            lambda: jaxamp.get_policy(3),
            TypeError,
            ("A precision policy must be a jaxamp.Policy, a jmp.Policy or a string such as "
            "'mixed_float16'; got int: 3."),
        ),
        (lambda: jaxamp.get_policy("mixd"), ValueError, _UNKNOWN_NAME.format(spec="mixd")),
        (
            lambda: jaxamp.get_policy("p=f32,x=f16"),
            ValueError,
            ("Unknown key 'x' in precision policy 'p=f32,x=f16'. Valid keys: p, params, c, compute, o, output, "
             f"m, matmul, u, update, s, state, b, block; e.g. {_GRAMMAR_EXAMPLE}."),
        ),
        (
            lambda: jaxamp.get_policy("p=f32,c"),
            ValueError,
            f"Malformed part 'c' in precision policy 'p=f32,c': expected key=dtype, e.g. {_GRAMMAR_EXAMPLE}.",
        ),
        (
            lambda: jaxamp.get_policy("p=f32,c=f99"),
            ValueError,
            ("The compute dtype 'f99' of precision policy 'p=f32,c=f99' must be a floating dtype, such as "
             f"jnp.float32, jnp.float16 or jnp.bfloat16, or one of the names {_ALIASES}; got 'f99'."),
        ),
    ],
    ids=["none_dtype", "unknown_alias", "not_a_spec", "unknown_name", "unknown_key", "malformed_part",
         "unknown_dtype_in_grammar"],
)  # fmt: skip
def test_each_bad_policy_gets_one_whole_message_naming_the_value_and_the_valid_choices(
    make, error_type, message
):
    with pytest.raises(error_type) as raised:
        make()
    assert str(raised.value) == message


def test_half_is_read_case_insensitively_as_jmps_half_dtype():
    assert jaxamp.Policy("HALF", "half", "float32").compute_dtype == jnp.dtype(jmp.half_dtype())


MISTYPED = {"mixed_flaot16": "mixed_float16", "mixed_bfloat": "mixed_bfloat16", "bf16_kahn": "bf16_kahan"}


@pytest.mark.parametrize("entry_point", ["get_policy", "apply_policy", "autocast"])
@pytest.mark.parametrize(("mistyped", "meant"), MISTYPED.items())
def test_a_mistyped_policy_name_is_answered_with_the_nearest_name_in_a_few_short_lines(entry_point, mistyped, meant):
    """It was one line of 681 characters listing 26 names, 12 aliases and the grammar, with no suggestion."""
    import flax.linen as nn

    call = {
        "get_policy": lambda: jaxamp.get_policy(mistyped),
        "apply_policy": lambda: jaxamp.apply_policy(nn.Dense(3), mistyped),
        "autocast": lambda: jaxamp.autocast(jnp.exp, mistyped),
    }[entry_point]
    with pytest.raises(ValueError) as raised:
        call()
    first, *choices = str(raised.value).splitlines()
    assert first == f"unknown precision policy {mistyped!r}. Did you mean {meant}? Choose one of:"
    assert len(choices) <= 4 and all(len(line) <= 100 for line in choices), choices


def test_the_library_and_the_commands_flags_answer_a_mistyped_name_with_one_code():
    """`experiments.flags` reads the library's message without importing jaxamp (which loads JAX)."""
    from experiments import flags
    from jaxamp import _unknown_name

    assert flags.unknown_name.__code__.co_filename == _unknown_name.unknown_name.__code__.co_filename
    assert flags.unknown_name("model", "resnet19", ["resnet18", "mobilenetv2"]) == _unknown_name.unknown_name(
        "model", "resnet19", ["resnet18", "mobilenetv2"]
    )


@pytest.mark.parametrize(
    ("typed", "nearest"),
    [("bfloat16_int9", "bfloat16_int8"), ("bflt_int", "bfloat16_int8"), ("mixflt16", "mixed_float16"),
     ("MIXED_BF61", "mixed_bf16"), (" mixed bf16", "mixed_bf16")],
)  # fmt: skip
def test_a_far_or_oddly_written_policy_name_is_answered_with_the_nearest(typed, nearest):
    """8-bit names are among the answers; a typo two or three letters off, in capitals or with spaces
    still gets its nearest name."""
    with pytest.raises(ValueError, match=f"Did you mean {nearest}\\?"):
        jaxamp.get_policy(typed)
