"""`infmoe.activations = int8`: the quantized ops' integer dot products (QMatMul, and
QContinuousSliceFFN's w_in) against the reference `quant.int8_activations` (per row and group of
32 columns) times the dequantized weights, on every path; rows independent of their batch mates;
the option's bad values.

Data is fresh every run (the seed is printed in every failure; INFMOE_TEST_SEED=<n> replays it).
"""

import os
import subprocess
from pathlib import Path
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch

from infmoe_export.errors import InfMoEError
from infmoe_export.quant import int8_activations, q_matmul
from infmoe_export.runtimes import ort_kernel
from conftest import rerun_forcing_path
from test_ort_kernel import relative_error
from test_ort_qmatmul import make_feeds, model
import test_ort_qkernel as qffn

SEED = int(os.environ.get("INFMOE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
PATH = os.environ.get("INFMOE_PATH", "auto")
# (tokens, K, N, block): K odd, below one group, not a multiple of 32; one token to prefill sizes.
CASES = [(1, 13, 37, 32), (2, 301, 77, 64), (5, 768, 131, 32), (9, 100, 33, 128), (40, 97, 61, 32), (1, 64, 5, 256)]


def session(k, n, bits, block, activations="int8", dtype=np.float32, threads=1):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    assert ort_kernel.register(options, activations=activations)
    return ort.InferenceSession(model(k, n, bits, block, dtype), options, providers=["CPUExecutionProvider"])


def reference(feeds, bits, block):
    a = int8_activations(torch.from_numpy(feeds["A"]).float()).double()
    return q_matmul(a, torch.from_numpy(feeds["B"]), torch.from_numpy(feeds["scales"]).double(), bits, block).numpy()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("tokens, k, n, block", CASES)
def test_int8_activations_match_their_reference(library, tokens, k, n, block, bits):
    rng = np.random.default_rng([SEED, tokens, k, bits])
    feeds = make_feeds(rng, (tokens,), k, n, bits, block)
    y = session(k, n, bits, block, threads=2).run(None, feeds)[0]
    assert relative_error(y, reference(feeds, bits, block)) < 1e-5, f"seed {SEED}, path {PATH}"


def test_int8_activations_are_not_float_activations(library):
    """The option takes effect: the product differs from float activations by the activations'
    rounding (~1e-3), far more than float rounding."""
    rng = np.random.default_rng([SEED, 1])
    feeds = make_feeds(rng, (3,), 301, 77, 4, 32)
    y8 = session(301, 77, 4, 32).run(None, feeds)[0]
    y32 = session(301, 77, 4, 32, activations="float").run(None, feeds)[0]
    assert 1e-4 < relative_error(y8, y32.astype(np.float64)) < 3e-2, f"seed {SEED}"


@pytest.mark.parametrize("bits", [8, 4])
def test_rows_do_not_depend_on_batch_mates(library, bits):
    rng = np.random.default_rng([SEED, 2])
    feeds = make_feeds(rng, (6,), 768, 131, bits, 32)
    s = session(768, 131, bits, 32)
    y = s.run(None, feeds)[0]
    for t in range(6):
        alone = s.run(None, dict(feeds, A=feeds["A"][t:t + 1]))[0]
        # Within fp32's tolerance, not bit for bit: a call's path is timed once per process and
        # token count (common/paths.h), on the first call's matrices, whichever test made it; 6
        # tokens and 1 may take paths that sum in other orders.
        assert relative_error(y[t:t + 1], alone.astype(np.float64)) < 1e-5, f"seed {SEED}, row {t}"


def test_non_finite_activations_give_a_non_finite_row(library):
    rng = np.random.default_rng([SEED, 3])
    feeds = make_feeds(rng, (3,), 100, 20, 4, 32)
    feeds["A"][1, 40] = np.inf
    y = session(100, 20, 4, 32).run(None, feeds)[0]
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()


def test_float16_activations(library):
    rng = np.random.default_rng([SEED, 4])
    feeds = make_feeds(rng, (4,), 200, 50, 4, 32, dtype=np.float16)
    y = session(200, 50, 4, 32, dtype=np.float16).run(None, feeds)[0]
    ref = reference({n: v.astype(np.float32) if v.dtype == np.float16 else v for n, v in feeds.items()}, 4, 32)
    assert relative_error(y, ref) < 5e-3, f"seed {SEED}"


def test_bad_option_values_are_errors():
    with pytest.raises(InfMoEError, match="activations must be one of float, int8"):
        ort_kernel.register(ort.SessionOptions(), activations="int4")


def test_bad_option_value_in_the_session_is_refused_by_the_library(library):
    options = ort.SessionOptions()
    options.add_session_config_entry(ort_kernel.ACTIVATIONS, "bf16")
    with pytest.raises(Exception, match="infmoe.activations must be float or int8, got 'bf16'"):
        options.register_custom_ops_library(str(library))


def ffn_session(r, bits, block, activations="int8", dtype=np.float32, threads=2):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    assert ort_kernel.register(options, activations=activations)
    return ort.InferenceSession(qffn.q_model(r, (bits, block), dtype), options, providers=["CPUExecutionProvider"])


def ffn_reference(feeds, r, bits, block):
    """The level-1 reference of QContinuousSliceFFN on the int8 activations: x enters only
    through w_in, whose products the integer dots make; w_out's stay float."""
    x = int8_activations(torch.from_numpy(feeds["X"]).float()).numpy()
    return qffn.reference(dict(feeds, X=x), r, bits, block)


# (leading dims, D, H, r, K, windows, block): D of whole groups of 32 (the integer path) and not
# (odd D: the float paths on the dequantized activations), r = 1 and r = H, one token to prefill.
FFN_CASES = [
    ((1,), 64, 37, 5, 1, "edges", 32),
    ((3,), 96, 101, 1, 2, "disjoint", 32),
    ((2,), 768, 613, 200, 2, "overlapping", 64),
    ((1,), 77, 41, 41, 3, "random", 32),
    ((40,), 160, 257, 19, 4, "edges", 32),
    ((2, 150), 97, 613, 200, 3, "disjoint", 32),
    ((5,), 64, 59, 59, 1, "random", 128),
]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("lead, d, h, r, k, windows, block", FFN_CASES)
def test_expert_op_int8_activations_match_their_reference(library, lead, d, h, r, k, windows, block, bits):
    rng = np.random.default_rng([SEED, d, h, r, bits])
    feeds = qffn.make_feeds(rng, lead, d, h, r, k, bits, block, windows)
    y = ffn_session(r, bits, block).run(None, feeds)[0]
    assert relative_error(y, ffn_reference(feeds, r, bits, block)) < 1e-5, f"seed {SEED}, path {PATH}"


@pytest.mark.parametrize("bits", [8, 4])
def test_expert_op_rows_do_not_depend_on_batch_mates(library, bits):
    rng = np.random.default_rng([SEED, 5])
    feeds = qffn.make_feeds(rng, (7,), 128, 300, 40, 2, bits, 32, "random")
    s = ffn_session(40, bits, 32)
    y = s.run(None, feeds)[0]
    for t in range(7):
        alone = s.run(None, dict(feeds, X=feeds["X"][t:t + 1], starts=feeds["starts"][t:t + 1]))[0]
        # fp32's tolerance: 7 tokens and 1 may take paths that sum in other orders (as above).
        assert relative_error(y[t:t + 1], alone.astype(np.float64)) < 1e-5, f"seed {SEED}, row {t}"


def test_expert_op_int8_activations_are_not_float_activations(library):
    rng = np.random.default_rng([SEED, 6])
    feeds = qffn.make_feeds(rng, (3,), 96, 101, 20, 2, 4, 32, "random")
    y8 = ffn_session(20, 4, 32).run(None, feeds)[0]
    y32 = ffn_session(20, 4, 32, activations="float").run(None, feeds)[0]
    assert 1e-4 < relative_error(y8, y32.astype(np.float64)) < 3e-2, f"seed {SEED}"


def test_expert_op_block_16_keeps_float_activations(library):
    """Blocks of 16 columns cannot scale 32-column groups: the option leaves such a node on
    float activations (documented), the level-1 reference exactly."""
    rng = np.random.default_rng([SEED, 7])
    feeds = qffn.make_feeds(rng, (3,), 64, 50, 9, 2, 4, 16, "random")
    y = ffn_session(9, 4, 16).run(None, feeds)[0]
    assert relative_error(y, qffn.reference(feeds, 9, 4, 16)) < 1e-5, f"seed {SEED}"


@pytest.mark.parametrize("path", ["integer", "batched", "prefill", "gemv"])
def test_each_path(library, path):
    """The kernel tests above again with each path forced, on every CPU variant (the whole-model
    tests below run whatever paths the kernel chooses)."""
    rerun_forcing_path(__file__, path, SEED, select="match or batch_mates or not_float or non_finite or float16 "
                                                    "or block_16 or narrower")


def test_parity_runs_int8_activations_as_the_ort_a8_backend_judged_at_level_2(library, tmp_path):
    """`parity --backends ort,ort-a8` on an all-int4 model: the report names the integer path as
    its own row, judged at level 2 (level 1 "n/a"), and its logits are off the level-1 reference
    by the activations' rounding, far beyond ort's float rounding (so the int8 path ran). A float
    model has nothing for it to quantize: the row is skipped with the reason."""
    from infmoe_export.export import export_onnx
    from infmoe_export.model import InfMoEConfig, InfMoEGPT
    from infmoe_export.verify.parity import run_parity

    config = InfMoEConfig(vocab_size=256, n_positions=40, d_model=64, n_layer=2, n_head=2, ffn_hidden=53,
                          slice_width=11, num_samples=2)
    model = InfMoEGPT(config)
    model.reset_parameters(seed=SEED % 1000)
    model.eval()
    int4 = export_onnx(model, tmp_path / "int4.onnx", k=2, dtype="int4", quantize_other="int4", block_size=32,
                       target="onnxruntime", with_starts=True)
    fp32 = export_onnx(model, tmp_path / "fp32.onnx", k=2, target="onnxruntime", with_starts=True)
    parity = run_parity(model, [int4, fp32], backends=["ort", "ort-a8"], max_windows=2, max_ppl_increase=0.5,
                        min_top1=0.5)
    rows = {(r["backend"], r["dtype"]): r for r in parity["results"]}
    ort_row, a8 = rows["ort", "int4"], rows["ort-a8", "int4"]
    assert ort_row["level1"] == "pass" and ort_row["status"] == "pass", ort_row["reason"]
    assert a8["level1"] == "n/a" and a8["level2"] == "pass" and a8["status"] == "pass", (SEED, a8["reason"])
    assert a8["error_all"]["max"] > 10 * ort_row["error_all"]["max"], SEED
    assert a8["perplexity"] != ort_row["perplexity"]
    skipped = rows["ort-a8", "fp32"]
    assert skipped["status"] == "skipped" and "int8 / int4" in skipped["reason"]


def test_a_model_exported_for_int8_activations_runs_them_unless_a_session_asks_otherwise(library, tmp_path):
    """The default export of an int4 model carries infmoe.activations = int8: a session or
    runner given nothing runs the integer path (its logits equal an explicit int8 session's, and
    differ from float activations'), a session's option or argument still chooses; the deployed
    backend is ort-a8, checked beside ort (level 1)."""
    from infmoe_export.contract import ExportedModel
    from infmoe_export.export import export_onnx
    from infmoe_export.model import InfMoEConfig, InfMoEGPT
    from infmoe_export.options import export_choices
    from infmoe_export.report.bench import checked_backends, deployed_backend
    from infmoe_export.runtimes.ort import OrtRunner, create_session

    config = InfMoEConfig(vocab_size=256, n_positions=40, d_model=64, n_layer=2, n_head=2, ffn_hidden=53,
                          slice_width=11, num_samples=2)
    model = InfMoEGPT(config)
    model.reset_parameters(seed=SEED % 1000)
    model.eval()
    choice, = export_choices(config, ["int4"])
    exported = export_onnx(model, tmp_path / "int4.onnx", k=2, **choice.options())
    assert ExportedModel.read(exported.path).io.activations == "int8"
    assert exported.metadata["infmoe.activations"] == "int8"
    feed = exported.feed(np.random.default_rng([SEED, 7]).integers(0, 256, (2, 9)))

    def logits(session):
        return session.run(["logits"], feed)[0]

    def entry(session):
        return session.get_session_options().get_session_config_entry(ort_kernel.ACTIVATIONS)

    default, explicit = create_session(exported), create_session(exported, activations="int8")
    as_float = create_session(exported, activations="float")
    options = ort.SessionOptions()
    options.add_session_config_entry(ort_kernel.ACTIVATIONS, "float")
    by_option = create_session(exported, options=options)
    assert (entry(default), entry(explicit), entry(as_float), entry(by_option)) == ("int8", "int8", "float", "float")
    np.testing.assert_array_equal(logits(default), logits(explicit))
    np.testing.assert_array_equal(logits(as_float), logits(by_option))
    assert np.abs(logits(default) - logits(as_float)).max() > 1e-4, SEED
    assert OrtRunner(exported.io, exported).activations == "int8"
    assert deployed_backend(True, exported.io.activations) == "ort-a8"
    assert deployed_backend(False, exported.io.activations) == "ort-fallback"
    assert checked_backends(True, ["float", "int8"]) == ["ort", "ort-a8"]
    assert checked_backends(True, ["float"]) == ["ort"]
    with pytest.raises(InfMoEError, match="int8 activations apply to the onnxruntime target's int8 / int4 weights"):
        export_onnx(model, tmp_path / "fp32.onnx", k=2, target="onnxruntime", activations="int8")


@pytest.mark.parametrize("variant", ["avx2", "baseline"])
def test_narrower_cpu_variants(library, variant):
    """This file's kernel tests again with the x86-64-v3 variant (vpmaddubsw, where this CPU may
    take AVX512-VNNI's vpdpbusd) and the portable one (plain C++), each chosen once per process."""
    if os.environ.get("INFMOE_CPU_VARIANT"):
        pytest.skip("already running one variant")
    env = dict(os.environ, INFMOE_CPU_VARIANT=variant, INFMOE_TEST_SEED=str(SEED))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k",
                           "match or batch_mates or not_float"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{variant}, seed {SEED}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"


def _variant_products(out):
    """Child of test_variants_give_the_same_bits: QMatMul (int4, int8) on int8 activations, 1 to 40
    tokens, on the variant its environment names; saved to out. Token counts that both variants
    take as rows (1, 2) or as tiles (9, 40): at 3 and 4 int4 takes rows on avx512 and tiles on
    avx2 (kRowsUpTo), which add a row's groups in other orders (float rounding apart)."""
    rng = np.random.default_rng(int(os.environ["INFMOE_TEST_SEED"]))
    results = {}
    for bits in (4, 8):
        for tokens in (1, 2, 9, 40):
            feeds = make_feeds(rng, (tokens,), 301, 77, bits, 32)
            results[f"int{bits}, {tokens} tokens"] = session(301, 77, bits, 32).run(None, feeds)[0]
    np.savez(out, **results)


@pytest.mark.skipif(sys.platform != "linux" or "avx512_vnni" not in open("/proc/cpuinfo").read(),
                    reason="needs a CPU with AVX512-VNNI (the avx512 variant's integer dots)")
def test_variants_give_the_same_bits(library, tmp_path):
    """QMatMul's integer dots: the avx512 variant's vpdpbusd (rows; 16-row tiles of 8 tokens) and
    the x86-64-v3 variant's vpmaddubsw (rows; 8-row tiles of 4 tokens) make the same integer sums in
    the same lanes and the same float steps on them (docs/design/kernel.md): bit for bit the same
    products. (The float paths, and the expert op's float w_out product, sum in lanes as wide as
    the variant's registers: float rounding apart.)"""
    if os.environ.get("INFMOE_CPU_VARIANT"):
        pytest.skip("already running one variant")
    outputs = {}
    for variant in ("avx512", "avx2"):
        out = tmp_path / f"{variant}.npz"
        env = dict(os.environ, INFMOE_CPU_VARIANT=variant, INFMOE_PATH="integer", INFMOE_TEST_SEED=str(SEED))
        code = f"import sys; sys.path[:0] = {[str(Path(__file__).parent)]!r}; " \
               f"import test_ort_int8_activations as t; t._variant_products({str(out)!r})"
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{variant}: {done.stderr[-2000:]}"
        outputs[variant] = np.load(out)
    for name in outputs["avx512"].files:
        assert np.array_equal(outputs["avx512"][name], outputs["avx2"][name]), f"{name}, seed {SEED}"
