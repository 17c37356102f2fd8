"""TensorRT engines and plugin: everything that runs without TensorRT, and the rest when it is there.

Without TensorRT (this project's machines): the plugin's shape/type rules as plain functions,
the AOT kernel's PTX (compiled for sm_90 by Triton on the CPU and assembled by ptxas), the ONNX
model the builder parses, profiles, the manifest and engine selection by K, and the CLI's
one-line error. Building and running an engine needs TensorRT and a GPU and is skipped otherwise.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from infmoe_export.cli import main
from infmoe_export.errors import InfMoEError
from infmoe_export.contract import ExportedModel
from infmoe_export.export import export_onnx
from infmoe_export.model import InfMoEConfig, InfMoEGPT
from infmoe_export.runtimes import tensorrt as trt_rt

descriptors = trt_rt.import_infmoe_trt("descriptors")
TINY = InfMoEConfig(vocab_size=256, n_positions=32, d_model=16, n_layer=2, n_head=2, ffn_hidden=37,
                    slice_width=5, num_samples=2)


def has_cuda_gpu() -> bool:
    return trt_rt.gpu_name() != "unknown"


needs_tensorrt = pytest.mark.skipif(trt_rt.tensorrt_available() is None or not has_cuda_gpu(),
                                    reason="needs TensorRT >= 10.7 and an NVIDIA GPU (absent on this machine)")


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return InfMoEGPT(TINY).eval()


@pytest.fixture(scope="module")
def plugin_onnx(tiny_model, tmp_path_factory):
    """The tiny model exported for K = 2 the way `infmoe-export trt` exports: no local function."""
    return export_onnx(tiny_model, tmp_path_factory.mktemp("onnx") / "model_k2.onnx", k=2, function=False).path


# ---------------------------------------------------------------------------------------------
# Shape and type descriptors (plain functions)

RANKS = [3, 3, 2, 1, 2, 1]
DTYPES = ["float32", "int64", "float32", "float32", "float32", "float32"]


def test_descriptors_accept_the_op_signature():
    descriptors.check_attributes(5, "gelu_tanh")
    descriptors.check_ranks(RANKS)
    descriptors.check_ranks([1, 1, 2, 1, 2, 1])  # a single token, X [D]
    assert descriptors.output_dtype(DTYPES) == "float32"
    assert descriptors.output_dtype([d.replace("float32", "float16") for d in DTYPES]) == "float16"
    assert descriptors.output_shape(("batch", "seq", 768)) == ("batch", "seq", 768)


@pytest.mark.parametrize("ranks, message", [
    ([3, 2, 2, 1, 2, 1], "starts must have X's rank"),
    ([0, 0, 2, 1, 2, 1], "X must have shape"),
    ([3, 3, 3, 1, 2, 1], "w_in must have rank 2"),
    ([3, 3, 2, 2, 2, 1], "b_in must have rank 1"),
    ([3, 3, 2, 1, 1, 1], "w_out must have rank 2"),
    ([3, 3, 2, 1, 2, 2], "b_out must have rank 1"),
    ([3, 3, 2, 1, 2], "expected 6 inputs"),
])
def test_descriptors_refuse_bad_ranks(ranks, message):
    with pytest.raises(InfMoEError, match=message):
        descriptors.check_ranks(ranks)


@pytest.mark.parametrize("index, dtype, message", [
    (0, "int32", "X must be float32 or float16"),
    (1, "int32", "starts must be int64"),
    (2, "float16", "w_in must have X's dtype"),
    (5, "float16", "b_out must have X's dtype"),
])
def test_descriptors_refuse_bad_types(index, dtype, message):
    dtypes = list(DTYPES)
    dtypes[index] = dtype
    with pytest.raises(InfMoEError, match=message):
        descriptors.output_dtype(dtypes)


@pytest.mark.parametrize("width, activation, message", [
    (0, "gelu_tanh", "slice_width must be a positive integer"),
    (True, "gelu_tanh", "slice_width must be a positive integer"),
    (5, "relu", "unknown activation 'relu'"),
])
def test_descriptors_refuse_bad_attributes(width, activation, message):
    with pytest.raises(InfMoEError, match=message):
        descriptors.check_attributes(width, activation)


def test_specialisation_reads_h_d_k_from_static_dims():
    shapes = [(None, None, 19), (None, None, 3), (37, 19), (37,), (37, 19), (19,)]
    assert descriptors.specialisation(shapes, 5) == {"H": 37, "D": 19, "R": 5, "K": 3}


@pytest.mark.parametrize("shapes, width, message", [
    ([(None, 19), (None, 3), (None, 19), (37,), (37, 19), (19,)], 5, "H .* must be static"),
    ([(None, 19), (None, None), (37, 19), (37,), (37, 19), (19,)], 5, "K .* must be static"),
    ([(None, 19), (None, 3), (37, 19), (36,), (37, 19), (19,)], 5, "b_in must have shape"),
    ([(None, 18), (None, 3), (37, 19), (37,), (37, 19), (19,)], 5, "X's last dim must be D"),
    ([(None, 19), (None, 3), (37, 19), (37,), (37, 19), (19,)], 38, "slice_width must be in"),
])
def test_specialisation_refuses_what_it_cannot_compile(shapes, width, message):
    with pytest.raises(InfMoEError, match=message):
        descriptors.specialisation(shapes, width)


# ---------------------------------------------------------------------------------------------
# The AOT implementation's kernel: PTX with exactly TensorRT's argument list

AOT_SCRIPT = """
import json, re, subprocess, sys, tempfile
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from infmoe_export.runtimes.tensorrt import import_infmoe_trt
kernel = import_infmoe_trt("kernel")
report = {}
for dtype in ("fp32", "fp16"):
    k = kernel.compile_ptx(dtype, H=37, D=19, R=5, K=3, target=GPUTarget("cuda", 90, 32))
    entry = re.search(r"\\.entry\\s+(\\w+)\\(([^)]*)\\)", k["ptx"])
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k["ptx"])
    ptxas = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", f.name, "-o", "/dev/null"],
                           capture_output=True, text=True)
    report[dtype] = dict(name=k["name"], entry=entry.group(1), params=entry.group(2).count(".param"),
                         block_x=k["block_x"], grid_y=k["grid_y"], ptxas=ptxas.returncode, err=ptxas.stderr[-300:])
print(json.dumps(report))
"""


def test_aot_kernel_compiles_to_ptx_with_tensorrts_arguments():
    # A fresh interpreter without TRITON_INTERPRET: the compiler needs real @triton.jit kernels.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", AOT_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for dtype, r in report.items():
        assert r["entry"] == r["name"] == "continuous_slice_ffn_kernel"
        assert r["params"] == 7, f"{dtype}: 6 input pointers + Y, no hidden scratch pointers"
        assert r["block_x"] == 128 and r["grid_y"] == 1  # 4 warps; D = 19 fits one column block
        assert r["ptxas"] == 0, f"{dtype}: ptxas rejected the PTX: {r['err']}"


def test_strip_scratch_params_checks_what_it_removes():
    strip = trt_rt.import_infmoe_trt("kernel").strip_scratch_params
    ptx = ("//\n.visible .entry k(\n\t.param .u64 .ptr .global .align 1 k_param_0,\n"
           "\t.param .u32 k_param_1,\n\t.param .u64 .ptr .global .align 1 k_param_2,\n"
           "\t.param .u64 .ptr .global .align 1 k_param_3\n)\n{\n\tld.param.b64 %rd1, [k_param_0];\n}\n")
    stripped = strip(ptx, "k", n_params=2)
    assert "k_param_1\n)" in stripped and "k_param_2" not in stripped and "k_param_3" not in stripped
    with pytest.raises(InfMoEError, match="reads hidden parameter 2"):
        strip(ptx.replace("[k_param_0]", "[k_param_2]"), "k", n_params=2)
    with pytest.raises(InfMoEError, match="needs Triton scratch memory"):
        strip(ptx, "k", n_params=2, scratch=(64, 0))
    with pytest.raises(InfMoEError, match="unexpected PTX entry"):
        strip(ptx, "k", n_params=1)


# ---------------------------------------------------------------------------------------------
# The ONNX model the builder parses


def test_exported_model_maps_every_layer_to_the_plugin(plugin_onnx):
    model = onnx.load(str(plugin_onnx))
    assert not model.functions  # a local function would be expanded instead of using the plugin
    nodes = [n for n in model.graph.node if n.domain == "infmoe"]
    assert [n.op_type for n in nodes] == ["ContinuousSliceFFN"] * TINY.n_layer
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs == {"slice_width": 5, "activation": b"gelu_tanh", "plugin_namespace": b"infmoe",
                     "plugin_version": b"1"}
    assert len(nodes[0].input) == 6
    assert trt_rt.check_plugin_model(plugin_onnx) == TINY.n_layer


def test_model_with_the_fallback_function_is_refused(plugin_onnx, tmp_path):
    model = onnx.load(str(plugin_onnx))
    model.functions.append(onnx.helper.make_function("infmoe", "ContinuousSliceFFN", ["X"], ["Y"],
                                                     [onnx.helper.make_node("Identity", ["X"], ["Y"])],
                                                     [onnx.helper.make_opsetid("", 18)]))
    onnx.save(model, tmp_path / "with_function.onnx")
    with pytest.raises(InfMoEError, match="--no-function"):
        trt_rt.check_plugin_model(tmp_path / "with_function.onnx")


def test_node_without_plugin_attributes_is_refused(plugin_onnx, tmp_path):
    model = onnx.load(str(plugin_onnx))
    node = next(n for n in model.graph.node if n.domain == "infmoe")
    kept = [a for a in node.attribute if a.name != "plugin_namespace"]
    del node.attribute[:]
    node.attribute.extend(kept)
    onnx.save(model, tmp_path / "no_namespace.onnx")
    with pytest.raises(InfMoEError, match="plugin_namespace='infmoe'"):
        trt_rt.check_plugin_model(tmp_path / "no_namespace.onnx")


def test_plan_models_takes_each_models_fixed_k(plugin_onnx):
    assert trt_rt.plan_models([plugin_onnx], None) == {2: Path(plugin_onnx)}
    assert trt_rt.plan_models([plugin_onnx], [2]) == {2: Path(plugin_onnx)}
    with pytest.raises(InfMoEError, match="no model for K=4"):
        trt_rt.plan_models([plugin_onnx], [2, 4])
    with pytest.raises(InfMoEError, match="two models for K=2"):
        trt_rt.plan_models([plugin_onnx, plugin_onnx], None)


@pytest.mark.parametrize("text, expected", [("1,2,4,8", [1, 2, 4, 8]), ("8, 2,2", [2, 8]), (None, None)])
def test_parse_ks(text, expected):
    assert trt_rt.parse_ks(text) == expected


@pytest.mark.parametrize("text", ["0,1", "two", ",", "-1"])
def test_parse_ks_refuses(text):
    with pytest.raises(InfMoEError, match="--k must be"):
        trt_rt.parse_ks(text)


# ---------------------------------------------------------------------------------------------
# Optimization profiles


def test_profiles_cover_prefill_and_decode(plugin_onnx):
    io = ExportedModel.read(plugin_onnx).io
    prefill, decode = trt_rt.profile_shapes(io, max_batch=3, max_seq=16)
    assert (prefill["name"], decode["name"]) == ("prefill", "decode")
    assert prefill["shapes"]["input_ids"] == {"min": [1, 1], "opt": [1, 8], "max": [3, 16]}
    assert prefill["shapes"]["past_key_values.0.key"] == {"min": [1, 2, 0, 8], "opt": [1, 2, 0, 8],
                                                         "max": [3, 2, 0, 8]}
    assert decode["shapes"]["input_ids"] == {"min": [1, 1], "opt": [1, 1], "max": [3, 1]}
    assert decode["shapes"]["past_key_values.1.value"]["max"] == [3, 2, 15, 8]
    assert decode["shapes"]["attention_mask"] == {"min": [1, 1], "opt": [1, 8], "max": [3, 16]}
    assert set(prefill["shapes"]) == set(io.input_names)

    profiles = [prefill, decode]
    feed = io.dummy_inputs(batch=2, sequence=5, past_sequence=0)
    assert trt_rt.pick_profile(profiles, {n: a.shape for n, a in feed.items()}) == 0
    feed = io.dummy_inputs(batch=1, sequence=1, past_sequence=9, left_pad=0)
    assert trt_rt.pick_profile(profiles, {n: a.shape for n, a in feed.items()}) == 1
    feed = io.dummy_inputs(batch=1, sequence=2, past_sequence=3, left_pad=0)  # chunked prefill: not built
    with pytest.raises(InfMoEError, match="fit no optimization profile"):
        trt_rt.pick_profile(profiles, {n: a.shape for n, a in feed.items()})
    with pytest.raises(InfMoEError, match="the engine's inputs are"):
        trt_rt.pick_profile(profiles, {"input_ids": (1, 1)})


def test_profiles_refuse_impossible_limits(plugin_onnx):
    io = ExportedModel.read(plugin_onnx).io
    with pytest.raises(InfMoEError, match="--max-seq must be in \\[1, 32\\]"):
        trt_rt.profile_shapes(io, max_batch=1, max_seq=33)
    with pytest.raises(InfMoEError, match="--max-batch must be at least 1"):
        trt_rt.profile_shapes(io, max_batch=0, max_seq=8)


# ---------------------------------------------------------------------------------------------
# Manifest and engine selection


def write_fake_build(folder: Path, onnx_path: Path, ks):
    """A manifest as build_engines writes it, with placeholder engine files (no TensorRT here)."""
    profiles = trt_rt.profile_shapes(ExportedModel.read(onnx_path).io, 1, 8)
    entries = []
    for k in ks:
        (folder / f"model_k{k}.engine").write_bytes(b"placeholder engine for K=%d" % k)
        entries.append(trt_rt.engine_entry(k, f"model_k{k}.engine", onnx_path, "fp32", "aot", profiles,
                                           "10.13.0", "NVIDIA H200"))
    return trt_rt.write_manifest(folder, entries)


def test_manifest_round_trip_and_selection_by_k(plugin_onnx, tmp_path):
    path = write_fake_build(tmp_path, plugin_onnx, [4, 1, 2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "model_k1.engine", "model_k2.engine",
                                                          "model_k4.engine"]  # no temporary file left
    written = json.loads(path.read_text())
    assert written["schema_version"] == 1
    assert [e["k"] for e in written["engines"]] == [1, 2, 4]
    entry = written["engines"][1]
    assert entry["onnx"]["sha256"] == trt_rt.file_sha256(plugin_onnx) and len(entry["onnx"]["sha256"]) == 64
    assert (entry["precision"], entry["tensorrt_version"], entry["gpu"]) == ("fp32", "10.13.0", "NVIDIA H200")
    assert [p["name"] for p in entry["profiles"]] == ["prefill", "decode"]
    assert entry["io"]["inputs"] == ExportedModel.read(plugin_onnx).io.input_names

    manifest = trt_rt.read_manifest(tmp_path)
    chosen = trt_rt.select_engine(manifest, 2)
    assert chosen["k"] == 2 and Path(chosen["path"]) == tmp_path / "model_k2.engine"
    assert trt_rt.select_engine(trt_rt.read_manifest(path), 4)["file"] == "model_k4.engine"
    with pytest.raises(InfMoEError, match=r"no TensorRT engine for K=8 .*available: K=1, 2, 4"):
        trt_rt.select_engine(manifest, 8)
    (tmp_path / "model_k1.engine").unlink()
    with pytest.raises(InfMoEError, match="engine file .*model_k1.engine for K=1 is missing"):
        trt_rt.select_engine(manifest, 1)


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ('{"schema_version": 2, "engines": []}', "schema_version must be 1"),
    ('{"schema_version": 1, "engines": []}', "'engines' must be a non-empty list"),
    ('{"schema_version": 1, "engines": [{"k": "2"}]}', "engine 0 needs 'k' of type int"),
])
def test_bad_manifests_are_refused(tmp_path, content, message):
    (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(InfMoEError, match=message):
        trt_rt.read_manifest(tmp_path)


def test_missing_manifest_says_how_to_build_one(tmp_path):
    with pytest.raises(InfMoEError, match="infmoe-export trt --out DIR"):
        trt_rt.read_manifest(tmp_path)


# ---------------------------------------------------------------------------------------------
# The command


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.skipif(trt_rt.tensorrt_available() is not None, reason="TensorRT is installed here")
def test_cli_without_tensorrt_is_one_line_with_the_fix(tmp_path, capsys):
    assert trt_rt.tensorrt_available() is None
    code, err = run_cli(["trt", "--out", str(tmp_path / "engines"), "--k", "1,2"], capsys)
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("error: TensorRT is not installed")
    assert "pip install 'infmoe-export[tensorrt]'" in err and "NVIDIA GPU" in err
    assert not (tmp_path / "engines").exists()  # nothing written before the check


@pytest.mark.parametrize("args, message", [
    (["--k", "0"], "--k must be"),
    (["--model", "{onnx}", "--k", "4"], "no model for K=4"),
    (["--model", "{onnx}", "--checkpoint", "{folder}"], "either --model or --checkpoint"),
    (["--model", "{folder}/missing.onnx"], "does not exist"),
])
def test_cli_refuses_bad_options_in_one_line(args, message, plugin_onnx, tmp_path, capsys):
    args = [a.format(onnx=plugin_onnx, folder=tmp_path) for a in args]
    code, err = run_cli(["trt", "--out", str(tmp_path / "engines"), *args], capsys)
    assert code == 1 and err.count("\n") == 1 and message in err


# ---------------------------------------------------------------------------------------------
# With TensorRT and a GPU


@needs_tensorrt
@pytest.mark.parametrize("jit", [False, True], ids=["aot", "jit"])
def test_engine_matches_the_reference(tiny_model, plugin_onnx, tmp_path, jit):
    manifest = trt_rt.build_engines({2: Path(plugin_onnx)}, tmp_path, fp16=False, timing_cache=tmp_path / "t.cache",
                                    max_batch=2, max_seq=16, jit=jit)
    assert trt_rt.read_manifest(manifest)["engines"][0]["plugin"] == ("jit" if jit else "aot")
    io = ExportedModel.read(plugin_onnx).io
    feed = io.dummy_inputs(batch=2, sequence=6, past_sequence=0)
    with trt_rt.TrtRunner(tmp_path, 2) as runner:
        outputs = runner.infer(feed)
        with torch.no_grad():
            ref = tiny_model(torch.from_numpy(feed["input_ids"]), torch.from_numpy(feed["attention_mask"]), k=2)
        keep = feed["attention_mask"].astype(bool)  # padded positions are garbage by construction
        np.testing.assert_allclose(outputs["logits"][keep], ref.logits.numpy()[keep], rtol=1e-3, atol=1e-3)
        # One decode step on the engine's decode profile, from the prefill cache.
        past = [outputs[name.replace("past_key_values", "present")] for name in io.past_names]
        mask = np.concatenate([feed["attention_mask"], np.ones((2, 1), dtype=np.int64)], axis=1)
        step = runner.infer(io.feed(feed["input_ids"][:, -1:], mask, past))
        with torch.no_grad():
            ref_step = tiny_model(torch.from_numpy(feed["input_ids"][:, -1:]), torch.from_numpy(mask),
                                  ref.present, k=2)
        np.testing.assert_allclose(step["logits"], ref_step.logits.numpy(), rtol=1e-3, atol=1e-3)
