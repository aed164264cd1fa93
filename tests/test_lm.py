"""The language-model experiment: model, corpus, precision, and the command line.

Tiny settings throughout (two layers of width 64, contexts of 16 tokens,
batches of 4); the sharded runs are in tests/test_lm_sharding.py.
"""

import dataclasses
import json
import math

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import strategies as st

import jaxamp
from experiments.lm import __main__ as lm_cli
from experiments.lm import config as config_lib
from experiments.lm import data as data_lib
from experiments.lm import model as model_lib
from experiments.lm import train
from experiments.train import resolve_loss_scale, resolve_precision
from jaxamp._optimizer.low_precision import LowPrecisionState
from jaxamp._optimizer.quantized import QuantizedArray

TINY_RUN = ["--model", "tiny", "--context", "16", "--batch-size", "4", "--eval-batches", "1", "--no-progress"]


def test_the_model_has_the_parameters_its_formula_counts_and_gpt2_size_is_124m():
    """Fails if a layer is added or dropped (or the embedding is not tied: +V*d)."""
    tiny = model_lib.create_model("tiny", 256)
    variables = jax.eval_shape(lambda: tiny.init(jax.random.key(0), jnp.zeros((2, 16), jnp.int32)))
    counted = model_lib.num_params(model_lib.SIZES["tiny"], 256)
    assert sum(leaf.size for leaf in jax.tree.leaves(variables)) == counted
    logits = jax.eval_shape(tiny.apply, variables, jnp.zeros((2, 16), jnp.int32))
    assert logits.shape == (2, 16, 256)
    # GPT-2 small with its padded vocabulary, as nanoGPT counts it.
    assert model_lib.num_params(model_lib.SIZES["gpt2"], 50304) == 124_475_904


@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16"])
def test_the_scanned_model_computes_the_loop_models_logits_from_its_params_stacked(precision):
    """``scan_layers=True`` holds each block param once, stacked over the layers in layer order under
    ``blocks`` (each layer initialized apart), and computes what the loop of ``block0`` ..
    ``block{n-1}`` computes: the same logits (float32 to rounding, the same half-precision program
    under a policy). Fails if the layers run in another order, a layer is skipped or repeated, or the
    layers start from one init."""
    size = model_lib.SIZES["tiny"]
    loop = jaxamp.apply_policy(model_lib.GPT(vocab_size=256, size=size), precision)
    scanned = jaxamp.apply_policy(model_lib.GPT(vocab_size=256, size=size, scan_layers=True), precision)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    params = loop.init(jax.random.key(0), tokens)["params"]
    layers = [params.pop(f"block{layer}") for layer in range(size.num_layers)]
    stacked = {**params, "blocks": jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers)}
    scanned_init = scanned.init(jax.random.key(0), tokens)["params"]
    assert jax.tree.map(jnp.shape, stacked) == jax.tree.map(jnp.shape, scanned_init)
    first, second = np.asarray(scanned_init["blocks"]["mlp"]["up"]["kernel"][:2], np.float32)
    assert not np.array_equal(first, second)  # each layer initialized from a key of its own
    for name in ("up", "down"):  # the residual projections' init scaled down, as in the loop model
        init_std, loop_std = (
            np.std(tree["blocks"]["mlp"][name]["kernel"]) for tree in (scanned_init, stacked)
        )
        assert np.isclose(init_std, loop_std, rtol=0.1)

    expected = loop.apply(
        {"params": {**params, **{f"block{i}": layer for i, layer in enumerate(layers)}}}, tokens
    )
    logits = scanned.apply({"params": stacked}, tokens)
    assert logits.dtype == expected.dtype
    tolerance = 1e-5 if precision == "float32" else 2e-2
    np.testing.assert_allclose(np.float32(logits), np.float32(expected), rtol=tolerance, atol=tolerance)
    reversed_layers = {**params, "blocks": jax.tree.map(lambda *leaves: jnp.stack(leaves[::-1]), *layers)}
    reversed_logits = scanned.apply({"params": reversed_layers}, tokens)
    assert not np.allclose(np.float32(reversed_logits), np.float32(expected), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_weight_decay_falls_on_the_weights_and_not_on_biases_or_norm_scales_in_either_form(scan_layers):
    """AdamW decays kernels and the token and position embeddings, by name: not the attention's
    (3, heads, head_dim) bias, and not the biases and LayerNorm scales a scanned model stacks into two
    dimensions. Two steps with zero gradients from params of one (the second at the peak learning
    rate): exactly the decayed params move, under ``--scan-layers`` as without it."""
    args = lm_cli.build_parser().parse_args([*TINY_RUN, "--precisions", "fp32", "--warmup-steps", "1"]
                                            + (["--scan-layers"] if scan_layers else []))  # fmt: skip
    (config,) = lm_cli.configs_from_args(args)
    assert config.scan_layers is scan_layers
    model, _ = train.create_model(config, resolve_precision("fp32"), 256, "cpu")
    assert getattr(model, "module", model).scan_layers is scan_layers
    initial = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]
    params = jax.tree.map(jnp.ones_like, initial)
    tx = train.create_optimizer(config)
    opt_state = tx.init(params)
    moved = params
    for _ in range(2):
        updates, opt_state = tx.update(jax.tree.map(jnp.zeros_like, moved), opt_state, moved)
        moved = optax.apply_updates(moved, updates)
    changed = {
        jax.tree_util.keystr(path): bool(np.any(np.asarray(leaf) != 1.0))
        for path, leaf in jax.tree_util.tree_flatten_with_path(moved)[0]
    }
    decayed = {path for path, did in changed.items() if did}
    weights = ("['kernel']", "['embedding']", "['positions']")
    assert decayed == {path for path in changed if path.endswith(weights)}
    qkv_bias = "['blocks']['attn']['qkv']['bias']" if scan_layers else "['block0']['attn']['qkv']['bias']"
    assert qkv_bias in changed and qkv_bias not in decayed


def test_the_analytic_flops_per_token_count_every_weight_but_the_position_table_and_attention():
    """GPT-2 small at a context of 1024: 6 FLOPs per weight (forward and backward) of its
    124,439,808 parameters less the 1024 x 768 position table (a lookup, not a matmul), plus
    12 x 12 layers x 768 x 1024 for attention's score and value products. Fails if the position
    table is counted, attention's share is left out, or either is scaled otherwise."""
    gpt2 = model_lib.SIZES["gpt2"]
    weights = 124_439_808 - 1024 * 768
    assert model_lib.model_flops_per_token(gpt2, 50257, 1024) == 6 * weights + 12 * 12 * 768 * 1024
    assert model_lib.model_flops_per_token(gpt2, 50257, 512) == 6 * weights + 12 * 12 * 768 * 512


def test_attention_is_cudnn_on_a_gpu_in_half_precision_and_einsum_or_xla_elsewhere():
    choose = model_lib.choose_attention
    assert choose("auto", "gpu", jnp.bfloat16, 64) == "cudnn"  # float32 params too: traced in bfloat16
    assert choose("auto", "gpu", jnp.float16, 64) == "cudnn"
    assert choose("auto", "gpu", jnp.float32, 64) == "xla"
    assert choose("auto", "cpu", jnp.float16, 16) == "einsum"
    assert choose("auto", "gpu", jnp.float16, 12) == "einsum"  # head size not a multiple of 8
    with pytest.raises(ValueError, match="cudnn needs a GPU.*platform cpu"):
        choose("cudnn", "cpu", jnp.float16, 16)


def test_the_einsum_attention_is_causal_and_equals_jax_attention_in_float32():
    """Fails if the mask lets a token see its future or the scale is off."""
    query, key, value = np.random.default_rng(0).standard_normal((3, 2, 8, 2, 4), np.float32)

    @jax.jit  # one compile; run op by op, this test compiled every operation of both attentions
    def attentions(query, key, value):
        ours = model_lib.einsum_attention(query, key, value)
        reference = jax.nn.dot_product_attention(query, key, value, is_causal=True, implementation="xla")
        changed_future = model_lib.einsum_attention(query, key.at[:, -1].add(1.0), value.at[:, -1].add(1.0))
        return ours, reference, changed_future

    ours, reference, changed_future = attentions(query, key, value)
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(changed_future[:, :-1], ours[:, :-1])


def write_python_files(folder, count):
    for index in range(count):
        path = folder / f"pkg{index % 3}" / f"module{index}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"# module {index}\nvalue = {index}\n" * 20)


def test_the_held_out_split_is_a_stable_hash_of_the_path_and_disjoint_from_training(tmp_path):
    """Fails if the split depends on file order or seed, or a file lands in both splits."""
    write_python_files(tmp_path, 120)
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "third_party.py").write_text("x = 1\n")
    paths = data_lib.stdlib_files(str(tmp_path))
    assert paths == sorted(paths) and len(paths) == 120  # site-packages left out
    held_out = [path for path in paths if data_lib.is_held_out(path)]
    assert 0 < len(held_out) < 20
    corpus = data_lib.load_stdlib_corpus(str(tmp_path))
    again = data_lib.load_stdlib_corpus(str(tmp_path))
    np.testing.assert_array_equal(corpus.held_out, again.held_out)
    held_out_text = bytes(corpus.held_out).decode()
    train_text = bytes(corpus.train).decode()
    for path in paths:
        marker = f"# module {path.split('module')[1][:-3]}\n"
        assert (marker in held_out_text) == data_lib.is_held_out(path) != (marker in train_text)
    # The hash of a fixed path never changes (SHA-256, not Python's salted hash).
    assert [data_lib.is_held_out(f"json/decoder{n}.py") for n in range(8)] == [
        data_lib.is_held_out(f"json/decoder{n}.py") for n in range(8)
    ]


def test_the_standard_library_corpus_holds_about_five_percent_out():
    corpus = data_lib.load_stdlib_corpus()
    share = corpus.held_out.size / (corpus.train.size + corpus.held_out.size)
    assert corpus.vocab_size == 256 and corpus.train.size > 1_000_000
    assert 0.01 < share < 0.15


def test_each_process_reads_only_its_rows_and_the_rows_make_the_global_batch():
    tokens = np.arange(1000, dtype=np.int32)
    offsets = data_lib.batch_offsets(tokens.size, 8, 16, seed=3, step=7)
    np.testing.assert_array_equal(offsets, data_lib.batch_offsets(tokens.size, 8, 16, seed=3, step=7))
    whole = data_lib.batch_rows(tokens, offsets, 16, slice(0, 8))
    halves = [data_lib.batch_rows(tokens, offsets, 16, slice(start, start + 4)) for start in (0, 4)]
    np.testing.assert_array_equal(np.concatenate(halves), whole)
    assert whole.shape == (8, 17) and np.all(np.diff(whole, axis=1) == 1)


def test_the_held_out_windows_are_evenly_spaced_from_the_first_token_to_the_last():
    """Windows of context + 1 = 17 tokens over 100: the first starts at token 0, the last ends
    on token 99. Fails if the last window stops short of the split's end or runs past it."""
    offsets = data_lib.held_out_offsets(100, 5, 16)
    np.testing.assert_array_equal(offsets, [0, 20, 41, 62, 83])
    assert offsets.dtype == np.int64 and offsets[-1] + 17 == 100


@pytest.mark.parametrize("split, name", [("train", "training"), ("held_out", "held-out")])
def test_a_split_shorter_than_one_window_is_refused_naming_it_and_one_window_fits(split, name):
    """A context of 16 needs windows of 17 tokens: 17 fit, 16 do not, in either split. Fails if
    the comparison is off by one, a split goes unchecked or the message loses its figures."""
    fits = data_lib.Corpus("synthetic", np.zeros(17, np.uint8), np.zeros(17, np.uint8), 256, "a tiny corpus")
    data_lib.check_fits(fits, 16)
    short = dataclasses.replace(fits, **{split: np.zeros(16, np.uint8)})
    message = (
        rf"^The {name} split of a tiny corpus has 16 tokens, fewer than one window of 17; use a "
        r"larger folder or a smaller --context\.$"
    )
    with pytest.raises(data_lib.DataUnavailableError, match=message):
        data_lib.check_fits(short, 16)


@hypothesis.settings(max_examples=500)
@hypothesis.example(start=0, size=10, process_count=3)  # a boundary rounded up: (0,4), (3,7), (6,10)
@hypothesis.example(start=95, size=5, process_count=8)  # more processes than examples
@hypothesis.given(start=st.integers(0, 10**9), size=st.integers(0, 10**6), process_count=st.integers(1, 300))
def test_the_processes_shares_of_a_split_are_disjoint_contiguous_and_cover_it(start, size, process_count):
    """Each process reads `tfds_share` of every split: together the shares are `[start, stop)`
    cut into consecutive pieces, none overlapping, none left out, their sizes within one of each
    other. Fails if a boundary is rounded differently at the two ends of neighbouring shares
    (examples read by two processes, or by none)."""
    stop = start + size
    shares = [data_lib.tfds_share(start, stop, index, process_count) for index in range(process_count)]
    assert shares[0][0] == start and shares[-1][1] == stop
    assert all(first <= last for first, last in shares)
    assert all(shares[index][1] == shares[index + 1][0] for index in range(process_count - 1))
    sizes = [last - first for first, last in shares]
    assert sum(sizes) == size and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("route", ["apply_policy", "autocast"])
@pytest.mark.parametrize("precision", ["bfloat16_kahan", "bf16_stochastic", "bfloat16_nearest"])
def test_a_precision_naming_an_update_rounding_keeps_params_and_adamw_state_in_bfloat16(precision, route):
    """--precisions bfloat16_kahan reaches AdamW: fails if the step keeps float32 moments or params,
    or optax's own update (no compensation buffer under Kahan)."""
    config = config_lib.LMConfig(model="tiny", precision=precision, route=route, context=16, batch_size=2)
    resolved = resolve_precision(precision)
    model, _ = train.create_model(config, resolved, 256, "cpu")
    tx = train.create_optimizer(config)
    state = jax.eval_shape(lambda: train.create_train_state(config, resolved, model, 16, tx))
    step = train.make_train_step(train.make_loss_fn(model.apply, route, resolved.policy))
    new_state, _ = jax.eval_shape(step, state, jax.ShapeDtypeStruct((2, 17), jnp.int32))
    opt_state = new_state.opt_state
    assert isinstance(opt_state, LowPrecisionState)
    bfloat16 = {jnp.dtype(jnp.bfloat16)}
    adam = opt_state.inner_state[1][0]  # chain(clip, adamw): adamw's ScaleByAdamState
    assert {leaf.dtype for leaf in jax.tree.leaves((adam.mu, adam.nu, new_state.params))} == bfloat16
    assert (opt_state.compensation is not None) == precision.endswith("kahan")


@pytest.mark.parametrize(
    "precision, state_format", [("bfloat16_int8", "int8"), ("bfloat16_fp8", "float8_e4m3fn")]
)
def test_a_precision_naming_an_8_bit_state_keeps_adamws_moments_in_it(precision, state_format):
    """--precisions bfloat16_int8 reaches AdamW: the moments of every param of 4096 elements or more
    (embeddings, attention and MLP kernels) are codes and block scales."""
    config = config_lib.LMConfig(model="tiny", precision=precision, context=16, batch_size=2)
    resolved = resolve_precision(precision)
    model, _ = train.create_model(config, resolved, 256, "cpu")
    tx = train.create_optimizer(config)
    state = jax.eval_shape(lambda: train.create_train_state(config, resolved, model, 16, tx))
    step = train.make_train_step(train.make_loss_fn(model.apply, config.route, resolved.policy))
    new_state, _ = jax.eval_shape(step, state, jax.ShapeDtypeStruct((2, 17), jnp.int32))
    adam = new_state.opt_state.inner_state[1][0]  # chain(clip, adamw): adamw's ScaleByAdamState
    large = [param for param in jax.tree.leaves(new_state.params) if param.size >= 4096]
    for moment in (adam.mu, adam.nu):
        leaves = jax.tree.leaves(moment, is_leaf=lambda leaf: isinstance(leaf, QuantizedArray))
        quantized = [leaf for leaf in leaves if isinstance(leaf, QuantizedArray)]
        assert sorted(leaf.shape for leaf in quantized) == sorted(param.shape for param in large)
        assert {leaf.format for leaf in quantized} == {state_format}
    assert {leaf.dtype for leaf in jax.tree.leaves(new_state.params)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("precision", ["mixed", "mixed_bf16"])
@pytest.mark.parametrize("route", ["apply_policy", "autocast"])
def test_both_routes_run_every_matmul_in_half_precision_with_float32_params_and_grads(precision, route):
    """Fails if any matmul of the step, forward or backward, stays in float32 (as JAX's xla
    attention's score gradient does) or if params or grads are not float32."""
    config = config_lib.LMConfig(model="tiny", precision=precision, route=route, context=16, batch_size=2)
    resolved = resolve_precision(precision)
    model, attention = train.create_model(config, resolved, 256, "cpu")
    assert attention == "einsum"
    tx = train.create_optimizer(config)
    state = jax.eval_shape(lambda: train.create_train_state(config, resolved, model, 16, tx))
    loss_fn = train.make_loss_fn(model.apply, route, resolved.policy)
    loss_scale = resolve_loss_scale(config.loss_scale, resolved.policy)
    windows = jnp.zeros((2, 17), jnp.int32)

    def loss_and_grads(params):
        return jaxamp.scaled_value_and_grad(loss_fn, loss_scale)(params, windows)

    report = jaxamp.precision_report(loss_and_grads, state.params)
    assert report.fraction(resolved.policy.compute_dtype) == 1.0, str(report)
    loss, grads, _ = jax.eval_shape(loss_and_grads, state.params)
    assert loss.dtype == jnp.float32
    assert {leaf.dtype for leaf in jax.tree.leaves((state.params, grads))} == {jnp.dtype(jnp.float32)}


def test_a_run_writes_json_table_and_plots_with_every_reported_figure(tmp_path):
    """The command line end to end: fp32 and mixed (float16, dynamic loss scale)."""
    out = tmp_path / "run"
    argv = [*TINY_RUN, "--precisions", "fp32,mixed", "--steps", "2", "--eval-every", "1"]
    argv += ["--out-dir", str(out)]
    assert lm_cli.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["command"].startswith("python -m experiments.lm --model tiny")
    fp32, mixed = results["runs"]
    assert [entry["step"] for entry in mixed["evaluations"]] == [0, 1, 2]
    for run in (fp32, mixed):
        summary = run["summary"]
        assert 0 < summary["held_out_bits_per_byte"] < 9
        assert summary["tokens_per_s"] > 0 and summary["skipped_steps"] == 0
        assert summary["mfu"] is None and "not applicable" in summary["mfu_note"]
        assert run["cost"]["flops_per_step"] > 0 and run["cost"]["memory_per_device"]["temp_bytes"] > 0
    assert fp32["summary"]["loss_scale"] == 1 and mixed["summary"]["loss_scale"] == 2.0**15
    assert mixed["precision"]["policy"] == "params=float32,compute=float16,output=float32"
    table = (out / "table.md").read_text()
    assert "| tiny | mixed | apply_policy | 0 | 2 |" in table and "vs fp32" in table
    assert (out / "held_out_vs_step.png").stat().st_size > 0 and (out / "held_out_vs_time.png").exists()


def test_bits_per_byte_are_held_out_nats_over_ln_2_and_8_for_an_untrained_model_on_random_bytes():
    """Uniform random bytes hold 8 bits each, and an untrained model (initial weights of
    standard deviation 0.02) predicts each byte with about 1/256: its held-out loss is about
    ln 256 nats, 8 bits per byte. Every evaluation reports the mean held-out loss over ln 2, in
    the results and in its log line. Fails if bits per byte are nats times ln 2 (3.84, not 8)."""
    settings = dict(model="tiny", context=16, batch_size=4, steps=1, eval_every=1, eval_batches=2)
    lines = []
    config = config_lib.LMConfig(**settings, data="synthetic", progress=False)
    results = train.train_and_evaluate(config, log=lines.append)
    assert [entry["step"] for entry in results["evaluations"]] == [0, 1]
    for entry in results["evaluations"]:
        bits_per_byte = entry["held_out_loss"] / math.log(2)
        assert entry["held_out_bits_per_byte"] == pytest.approx(bits_per_byte, rel=1e-12)
    untrained = results["evaluations"][0]
    assert untrained["held_out_loss"] == pytest.approx(math.log(256), abs=0.05)
    assert untrained["held_out_bits_per_byte"] == pytest.approx(8, abs=0.08)
    assert f"held-out {untrained['held_out_bits_per_byte']:.4f} bits/byte" in lines[1]
    summary = results["summary"]
    assert summary["held_out_bits_per_byte"] == results["evaluations"][-1]["held_out_bits_per_byte"]
    bits_per_byte = summary["held_out_loss"] / math.log(2)
    assert summary["held_out_bits_per_byte"] == pytest.approx(bits_per_byte, rel=1e-12)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--precisions", "fp32,fp33"], "fp33"),
        (["--model", "huge"], "unknown model size 'huge'. Choose one of:"),
        (["--model", "smal"], "unknown model size 'smal'. Did you mean small?"),
        (["--route", "autocat"], "autocat"),
        (["--context", "65"], "--context 65 is invalid: expected an integer from 1 to 64"),
        (["--vocab-size", "300"], "--vocab-size 300 is invalid"),
        (["--steps", "0"], "expected a positive integer, got 0"),
        (["--seeds", "a,b"], "comma-separated integers"),
        (
            ["--sharding", "replicated", "--gather-dtype", "bfloat16"],
            "need --sharding fsdp, not 'replicated'",
        ),
    ],
)
def test_a_bad_flag_exits_2_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        lm_cli.main([*TINY_RUN, *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_or_too_small_data_exits_1_with_one_message(tmp_path, capsys):
    out = ["--out-dir", str(tmp_path / "out")]
    assert lm_cli.main([*TINY_RUN, "--data-dir", str(tmp_path / "nowhere"), *out]) == 1
    error = capsys.readouterr().err
    assert "nowhere" in error and "does not exist" in error and "Traceback" not in error
    (tmp_path / "few").mkdir()
    (tmp_path / "few" / "only.py").write_text("x = 1\n")
    assert lm_cli.main([*TINY_RUN, "--data-dir", str(tmp_path / "few"), *out]) == 1
    assert "both splits need at least one" in capsys.readouterr().err


def test_the_step_compiled_for_an_h200_runs_its_matmuls_in_bfloat16_with_a_roofline_bound():
    """On paper (`python -m experiments.lm.on_paper`), tiny settings. Fails if the compiled GPU
    program keeps a float32 matmul under mixed_bf16, or a figure of the entry is missing."""
    from experiments.lm import on_paper

    if not jaxamp.diagnostics.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]'; run with JAX_PLATFORMS=cpu)")
    # The einsum attention: cuDNN's (what auto picks on a GPU) needs libcudnn to compile.
    config = config_lib.LMConfig(
        model="tiny", precision="mixed_bf16", route="autocast", attention="einsum", context=16, batch_size=2
    )
    entry = on_paper.compile_for("h200", config, vocab_size=256)
    assert entry["device_kind"] == "NVIDIA H200" and entry["attention"] == "einsum"
    assert set(entry["matmul_flops_by_dtype"]) == {"bfloat16"}
    assert entry["memory"]["temp_bytes"] > 0 and entry["bytes_accessed_per_step"] > 0
    assert entry["roofline_step_s"] == max(entry["roofline_compute_s"], entry["roofline_memory_s"]) > 0
    # The per-kernel bound, split by kind of kernel: no FP8 kernel under mixed_bf16.
    by_class = entry["roofline_per_kernel_by_class_s"]
    assert set(by_class) == {"other GEMMs", "other"}
    assert entry["roofline_per_kernel_s"] > 0
    assert sum(by_class.values()) == pytest.approx(entry["roofline_per_kernel_s"])


def test_the_on_paper_table_sets_each_per_kernel_bound_against_mixed_bf16_of_the_same_model():
    """No compile: two entries as `compile_for` writes them. Fails if the per-kernel
    column or its speed-up over mixed_bf16 is missing, or FP8 everywhere is not named."""
    from experiments.lm import on_paper

    common = {
        "model": "gpt2", "route": "autocast", "attention": "einsum", "memory": {"temp_bytes": 2**30},
        "bytes_accessed_per_step": 1e9, "flops_per_step": 1e12, "matmul_flops_by_dtype": {"bfloat16": 1e12},
        "fp8_share": 0.0, "roofline_step_s": 0.01, "roofline_compute_s": 0.005, "roofline_memory_s": 0.01,
        "roofline_tokens_per_s": 1.0,
    }  # fmt: skip
    bf16 = {**common, "precision": "mixed_bf16", "roofline_per_kernel_s": 0.018}
    fp8 = {**common, "precision": "mixed_float8", "fp8_where": "everywhere", "roofline_per_kernel_s": 0.012}
    table = on_paper.markdown([bf16, fp8], "python -m experiments.lm.on_paper")
    assert "| per-kernel ms/step | per kernel vs mixed_bf16 |" in table
    assert "| gpt2 | mixed_bf16 | autocast |" in table and "| 18.00 | 1.00x |" in table
    assert "| gpt2 | mixed_float8 (FP8 everywhere) | autocast |" in table and "| 12.00 | 1.50x |" in table


@pytest.mark.parametrize("route", ["apply_policy", "autocast"])
def test_fp8_runs_every_projection_in_fp8_by_either_route(route):
    """`--precisions mixed_bf16,mixed_float8` with no --route: both on apply_policy, and the
    traced FP8 step runs every projection, MLP and logits matmul in FP8, forward and backward
    (only the attention cores, batched dots, stay bfloat16), whether the policy reaches the model
    by apply_policy or by autocast on the loss. Fails if a route loses the FP8 rewrite."""
    args = lm_cli.build_parser().parse_args([*TINY_RUN, "--precisions", "mixed_bf16,mixed_float8"])
    routes = {config.precision: config.route for config in lm_cli.configs_from_args(args)}
    assert routes == {"mixed_bf16": "apply_policy", "mixed_float8": "apply_policy"}

    config = config_lib.LMConfig(
        model="tiny", precision="mixed_float8", route=route, context=16, batch_size=2
    )
    resolved = resolve_precision(config.precision)
    model, _ = train.create_model(config, resolved, 256, "cpu")
    tx = train.create_optimizer(config)
    state = jax.eval_shape(lambda: train.create_train_state(config, resolved, model, 16, tx))
    loss_fn = train.make_loss_fn(model.apply, config.route, resolved.policy)
    windows = jnp.zeros((2, 17), jnp.int32)
    report = jaxamp.precision_report(jax.value_and_grad(loss_fn), state.params, windows)
    # Two layers of 4 projections (qkv, out, MLP in, MLP out) and the tied logits: 9 matmuls, each
    # 3 FP8 GEMMs (forward, input and weight gradients); the 2 attention cores per layer, 3 times
    # each, bfloat16 (jaxamp keeps batched dots out of FP8).
    assert sum(op.is_fp8 for op in report.ops) == 27, str(report)
    assert report.count_by_dtype()["bfloat16"] == 12 and report.fp8_fraction() > 0.9, str(report)


def test_a_steps_cost_is_its_device_count_times_one_programs_flops_with_that_programs_other_figures(
    monkeypatch,
):
    """XLA's cost analysis counts one device's program: the step's FLOPs are 8 times it on 8
    devices, and the bytes, matmul FLOPs and collectives are that program's, each under its own
    name; the collectives the program states are read from the lowered text given. Fails if the
    FLOPs are not multiplied by the device count (or are divided by it), a figure is missing or
    renamed, or a program without a FLOP count fails instead of reporting None."""
    from experiments.lm import figures

    compiled = jax.jit(lambda x, w: jnp.tanh(x @ w)).lower(jnp.ones((8, 16)), jnp.ones((16, 32))).compile()
    one_program = figures.roofline.cost_of(compiled)
    stated = "  %gathered = bf16[8,16]{1,0} all-gather(bf16[1,16]{1,0} %param), dimensions={0}"
    cost = figures.step_cost(compiled, 8, stated)
    assert set(cost) == {
        "flops_per_step",
        "bytes_accessed_per_device",
        "matmul_flops_by_dtype_per_device",
        "memory_per_device",
        "collectives_per_device",
        "collectives_stated",
    }
    assert cost["flops_per_step"] == 8 * one_program["flops"] > 0
    assert cost["bytes_accessed_per_device"] == one_program["bytes accessed"] > 0
    assert cost["matmul_flops_by_dtype_per_device"] == {"float32": 2 * 8 * 16 * 32}
    assert cost["collectives_per_device"] == {}
    assert cost["collectives_stated"] == {"all-gather bfloat16": {"count": 1, "result_bytes": 8 * 16 * 2}}
    assert figures.step_cost(compiled, 8)["collectives_stated"] == {}
    monkeypatch.setattr(figures.roofline, "cost_of", lambda compiled: {})
    assert figures.step_cost(compiled, 8)["flops_per_step"] is None


def test_fp8_mfu_divides_by_the_fp8_peak(monkeypatch):
    """On an H200, mixed_float8's MFU is against 1979 TFLOP/s, not bfloat16's 989. Fails if the
    heavy-math dtype passed is the compute dtype (bfloat16). (The bound's FP8 rate is the library's:
    tests/test_kernel_roofline.py.)"""
    from experiments.lm import figures

    h200 = jaxamp.diagnostics.gpu_spec("h200")
    monkeypatch.setattr(figures, "device_spec", lambda: h200)
    policy = resolve_precision("mixed_float8").policy
    run = figures.throughput(7e12, 8192, 0.02, "mixed_float8", policy.matmul_dtype or policy.compute_dtype)
    assert run["peak_used"] == "float8_e4m3fn"
    assert run["mfu"] == pytest.approx(350e12 / h200.peak_flops["float8_e4m3fn"])
