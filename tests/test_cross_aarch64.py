"""The kernel's CPU computations (the float and quantized expert ops, QMatMul, DecoderAttention,
WindowStarts, StepInputs and the starts check) through its C++ test driver
(plugins/onnxruntime/tests/driver.cc), against fresh reference data from the Python references: cross-compiled for aarch64 (armv8-a)
and run under qemu-aarch64, and built natively, where every CPU variant the machine supports runs
(and, when qemu-x86_64 exists, the portable baseline under a CPU model without AVX); and, where nvcc
exists, built with the CUDA computation, which runs the float op's cases on a GPU when one is there."""

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

PLUGIN = pathlib.Path(__file__).resolve().parent.parent / "plugins" / "onnxruntime"
SCRIPT = PLUGIN / "tools" / "cross_test.sh"
WRITER = PLUGIN / "tests" / "write_reference.py"
KINDS = {"ffn", "refuse", "qffn", "qmatmul", "attn", "starts", "steps", "norm"}  # write_reference.py's kinds of case


def headers_or_skip():
    if not (PLUGIN / "third_party" / ".complete").is_file():
        pytest.skip("no kernel headers in plugins/onnxruntime/third_party (the package build fetches them); "
                    "the test does not download them")


def cross_test(target, tmp_path, tools, install):
    """cross_test.sh TARGET on fresh reference cases: (its completed process, the number of cases)."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed ({install})")
    headers_or_skip()
    cases = tmp_path / "cases.bin"
    written = subprocess.run([sys.executable, str(WRITER), str(cases)], capture_output=True, text=True, check=True)
    count = int(re.search(r"(\d+) cases", written.stdout).group(1))
    return subprocess.run(["bash", str(SCRIPT), target, str(cases)], capture_output=True, text=True, timeout=900), count


def run(target, tmp_path, tools):
    result, count = cross_test(target, tmp_path, tools, "apt-get install g++-aarch64-linux-gnu qemu-user")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summaries = re.findall(r"driver: (\d+) of (\d+) cases passed \(variant (\w+)\)", result.stdout)
    assert summaries and all(int(passed) == int(total) == count for passed, total, _ in summaries), result.stdout
    assert set(re.findall(r"^ok   (\w+) ", result.stdout, re.MULTILINE)) == KINDS, result.stdout
    return result.stdout, [variant for *_, variant in summaries]


def test_aarch64_under_qemu(tmp_path):
    out, variants = run("aarch64", tmp_path, ["aarch64-linux-gnu-g++", "qemu-aarch64", "cmake"])
    assert "AArch64 ELF" in out
    assert variants == ["baseline"]
    assert "refused: starts[0] = -1 is outside" in out


def test_native_every_variant(tmp_path):
    out, variants = run("native", tmp_path, ["c++", "cmake"])
    assert "baseline" in variants
    # Float decode's two streamings (Intel's and the others'), each forced, whatever this CPU is.
    forced = re.findall(r"driver: (\d+) of (\d+) cases passed \(variant \w+, INFMOE_INTEL_STREAMS=(\d)\)", out)
    assert sorted(streams for *_, streams in forced) == ["0", "1"], out
    assert all(passed == total for passed, total, _ in forced), out
    assert len(variants) == len(set(variants)) + ("qemu64" in out)  # one run per supported variant (+ qemu64)
    if "qemu64" in out:
        assert variants[-1] == "baseline"


def test_cuda_build(tmp_path):
    """cross_test.sh cuda: the driver and benchmark built with the CUDA computation (where nvcc
    exists). On a GPU every case passes, the float op's also on the GPU; without one the driver
    refuses in one line before any case, so the build is what this checks here."""
    result, _ = cross_test("cuda", tmp_path, ["nvcc", "cmake"], "the CUDA toolkit")
    assert "cross_test: built infmoe_ffn_test libinfmoe_ort.so (cuda)" in result.stdout, result.stdout + result.stderr
    assert (PLUGIN / "build-test-cuda" / "infmoe_cuda_bench").is_file()
    if "driver: ffn cases also on CUDA device 0" in result.stdout:
        assert result.returncode == 0, result.stdout[-3000:]
        assert len(re.findall(r"^ok   ffn .*CUDA fp32 err .*2 runs identical$", result.stdout, re.MULTILINE)) >= 10
    else:
        assert result.returncode != 0
        assert re.search(r"^driver: CUDA device 0: .+", result.stderr, re.MULTILINE), result.stderr
        assert "ok   " not in result.stdout  # refused before any case
