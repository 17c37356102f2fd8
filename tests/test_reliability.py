"""Hardening (docs/design/reliability.md), written as a user would hit each problem: real files, FIFOs,
symlinks and device nodes made inside tmp_path, real signals to a child process. Every refusal
is one line on stderr and a non-zero exit, and leaves what was there untouched."""

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from infmoe_export import files
from infmoe_export.checkpoint import WEIGHTS_FILE, load_checkpoint
from infmoe_export.errors import InfMoEError

from conftest import TINY

CLI = str(Path(sys.executable).parent / "infmoe-export")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def one_line_refusal(code, err, *words):
    assert code != 0, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "unexpected" not in err, err
    for word in words:
        assert word in err, err


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(os.urandom(64).hex().encode() * 8)
    return path


# -- never destroy what is not ours --------------------------------------------------------------


def test_train_refuses_a_folder_of_user_files(tmp_path, run_cli, text_file):
    out = tmp_path / "home"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    code, _, err = run_cli("train", "--out", out, "--corpus", text_file, "--steps", "1", "--d-model", "8",
                           "--n-layer", "1", "--n-head", "2", "--ffn-hidden", "16", "--slice-width", "4",
                           "--n-positions", "16", "--batch-size", "2")
    one_line_refusal(code, err, "did not write")
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]
    assert (out / "thesis.tex").read_text() == "years of work"


def test_train_replaces_its_own_checkpoint(tmp_path, run_cli, text_file):
    out = tmp_path / "ckpt"
    args = ["train", "--out", out, "--corpus", text_file, "--steps", "1", "--d-model", "8", "--n-layer", "1",
            "--n-head", "2", "--ffn-hidden", "16", "--slice-width", "4", "--n-positions", "16", "--batch-size", "2"]
    assert run_cli(*args)[0] == 0
    first = digest(out / WEIGHTS_FILE)
    code, _, err = run_cli(*args, "--seed", "5")
    assert code == 0, err
    assert digest(out / WEIGHTS_FILE) != first and files.is_ours(out)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def special_files(tmp_path):
    """A FIFO, a symlink to a user file and (as root) a character device, made in tmp_path."""
    made = {}
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    made["fifo"] = fifo
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = tmp_path / "link.onnx"
    link.symlink_to(target)
    made["symlink"] = link
    if os.geteuid() == 0:
        device = tmp_path / "null"
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        made["device"] = device
    return made


@pytest.mark.parametrize("kind", ["fifo", "symlink", "device"])
def test_outputs_refuse_fifos_symlinks_and_devices(kind, tmp_path, run_cli, make_checkpoint):
    made = special_files(tmp_path)
    if kind not in made:
        pytest.skip("making a device node needs root")
    path = made[kind]
    before = path.lstat()
    ckpt = make_checkpoint()
    for args in (["onnx", "--checkpoint", ckpt, "--out", path, "--no-validate"],
                 ["bench", "--checkpoint", ckpt, "--json", path, "--k", "1", "--backends", "torch"]):
        code, _, err = run_cli(*args)
        one_line_refusal(code, err, "refusing to write")
        after = path.lstat()
        assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode) and after.st_ino == before.st_ino
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_onnx_refuses_to_overwrite_its_own_input(make_checkpoint, run_cli):
    ckpt = make_checkpoint()
    before = digest(ckpt / WEIGHTS_FILE)
    (ckpt / "model.onnx").symlink_to(ckpt / WEIGHTS_FILE)
    for out in (ckpt / WEIGHTS_FILE, ckpt / "model.onnx", ckpt / "config.json"):
        code, _, err = run_cli("onnx", "--checkpoint", ckpt, "--out", out, "--no-validate")
        one_line_refusal(code, err, "refusing to write")
    assert digest(ckpt / WEIGHTS_FILE) == before
    with pytest.raises(InfMoEError, match="inputs"):  # the same file under another name
        files.output_file(ckpt / ".." / ckpt.name / WEIGHTS_FILE, inputs=[ckpt / WEIGHTS_FILE])


def test_report_folders_refuse_user_folders(tmp_path, run_cli, make_checkpoint):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    code, _, err = run_cli("parity", "--checkpoint", make_checkpoint(), "--model", tmp_path / "none.onnx",
                           "--out", out)
    one_line_refusal(code, err, "did not write")
    assert [p.name for p in out.iterdir()] == ["notes.md"]


# -- publish only what validated; one run per folder ---------------------------------------------


def test_staged_dir_publishes_whole_or_not_at_all(tmp_path):
    target = tmp_path / "run"
    with files.staged_dir(target) as work:
        (work / "a.onnx").write_text("first run")
    assert (target / "a.onnx").read_text() == "first run" and files.is_ours(target)
    with pytest.raises(RuntimeError):
        with files.staged_dir(target) as work:
            (work / "b.onnx").write_text("half of a second run")
            raise RuntimeError("stopped")
    assert sorted(p.name for p in target.iterdir()) == [files.MARKER, "a.onnx"]  # the first run, whole
    with files.staged_dir(target) as work:  # a rerun with fewer models leaves none of the old ones
        (work / "c.onnx").write_text("third run")
    assert sorted(p.name for p in target.iterdir()) == [files.MARKER, "c.onnx"]
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_a_second_run_into_a_locked_folder_is_refused(tmp_path, run_cli, make_checkpoint):
    out = files.output_dir(tmp_path / "out")
    with files.locked(out):
        code, _, err = run_cli("pipeline", "--checkpoint", make_checkpoint(), "--out", out, "--k", "1")
    one_line_refusal(code, err, "another infmoe-export run")
    assert [p.name for p in out.iterdir()] == [files.MARKER]


def test_run_cache_holds_only_validated_models_after_a_kill(tmp_path, make_checkpoint):
    """SIGKILL the child right after it starts exporting into the cache: no entry may appear, and
    the next run exports again (it finds nothing half-made to trust)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    args = [CLI, "run", "--checkpoint", str(make_checkpoint(seed=4)), "--prompt", "ab", "--max-new-tokens", "2",
            "--no-kernel"]
    child = subprocess.Popen(args, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert "exporting" in child.stderr.readline()
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    entries = list((tmp_path / "cache" / "infmoe-export").glob("*/model.onnx"))
    assert entries == []
    again = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "exporting" in again.stderr
    assert len(list((tmp_path / "cache" / "infmoe-export").glob("*/model.onnx"))) == 1


# -- no silent wrong answers ---------------------------------------------------------------------


def test_non_finite_weights_are_refused_at_load(make_checkpoint, run_cli):
    ckpt = make_checkpoint()
    tensors = load_file(str(ckpt / WEIGHTS_FILE))
    tensors["h.1.moe.router.mu.bias"] = torch.tensor([float("nan")])
    save_file(tensors, str(ckpt / WEIGHTS_FILE))
    with pytest.raises(InfMoEError, match="h.1.moe.router.mu.bias.*NaN"):
        load_checkpoint(ckpt)
    code, out, err = run_cli("eval", "--checkpoint", ckpt, "--json", "--k", "1")
    one_line_refusal(code, err, "NaN")
    assert out == ""


# -- memory bombs ----------------------------------------------------------------------------------


def peak_rss_mib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("key, value, words", [("n_layer", 10**6, "tensors"), ("n_layer", 10**9, "memory available"),
                                               ("ffn_hidden", 10**12, "memory available"),
                                               ("vocab_size", 10**15, "memory available")])
def test_huge_configs_are_refused_before_allocating(key, value, words, make_checkpoint, run_cli):
    ckpt = make_checkpoint()
    config = json.loads((ckpt / "config.json").read_text())
    config[key] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    before = peak_rss_mib()
    code, _, err = run_cli("eval", "--checkpoint", ckpt, "--k", "1")
    one_line_refusal(code, err, words)
    assert peak_rss_mib() - before < 200


def test_huge_k_and_training_sizes_are_refused(make_checkpoint, run_cli, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("INFMOE_MAX_MEMORY_GIB", "2")  # as on a small edge box, whatever this machine has
    before = peak_rss_mib()
    code, _, err = run_cli("eval", "--checkpoint", make_checkpoint(), "--k", "1000000")
    one_line_refusal(code, err, "memory available")
    code, _, err = run_cli("train", "--out", tmp_path / "big", "--corpus", text_file, "--d-model", "65536",
                           "--n-head", "1", "--ffn-hidden", "1000000", "--slice-width", "4")
    one_line_refusal(code, err, "memory available")
    assert peak_rss_mib() - before < 200
    assert not (tmp_path / "big").exists()


# -- one line, never a traceback -------------------------------------------------------------------


def test_deep_and_huge_files(make_checkpoint, run_cli, tmp_path):
    ckpt = make_checkpoint()
    (ckpt / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    code, _, err = run_cli("eval", "--checkpoint", ckpt)
    one_line_refusal(code, err)
    sparse = tmp_path / "sparse.txt"
    with open(sparse, "wb") as f:
        f.truncate(1 << 40)  # a terabyte of holes: must be refused from its size, never read
    code, _, err = run_cli("eval", "--checkpoint", make_checkpoint("other"), "--text", sparse)
    one_line_refusal(code, err, "MiB")


@pytest.mark.parametrize("args, words", [
    (["--seed", str(2**70)], ["--seed"]),
    (["--temperature", "0"], ["temperature"]),
    (["--top-k", "0"], ["top-k"]),
    (["--max-new-tokens", "-1"], ["new tokens"]),
])
def test_run_bad_numbers(args, words, make_checkpoint, run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code, out, err = run_cli("run", "--checkpoint", make_checkpoint(), "--prompt", "a", "--no-kernel", *args)
    assert code != 0 and "Traceback" not in err and "unexpected" not in err
    assert all(w in err for w in words), err
    assert out == ""  # the prompt is not echoed before the request is checked


def test_run_takes_any_bytes_and_tiny_temperatures(make_checkpoint, run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ckpt = make_checkpoint()
    not_utf8 = os.fsdecode(b"\xff\xfeab")  # how click hands over undecodable argument bytes
    code, out, err = run_cli("run", "--checkpoint", ckpt, "--prompt", not_utf8, "--max-new-tokens", "3",
                             "--no-kernel")
    assert code == 0, err
    assert out.startswith("\ufffd\ufffdab")
    code, out, err = run_cli("run", "--checkpoint", ckpt, "--prompt", "ab", "--max-new-tokens", "3",
                             "--temperature", "1e-45", "--no-kernel")
    assert code == 0, err
    greedy = run_cli("run", "--checkpoint", ckpt, "--prompt", "ab", "--max-new-tokens", "3", "--no-kernel")[1]
    assert out == greedy  # a vanishing temperature is greedy decoding, not NaN


def test_a_prompt_that_fills_the_context_is_refused(make_checkpoint, run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code, out, err = run_cli("run", "--checkpoint", make_checkpoint(), "--prompt", "x" * TINY["n_positions"],
                             "--no-kernel")
    last = err.strip().splitlines()[-1]  # after the cache's "exporting ..." line
    assert code == 1 and last.startswith("error: ") and "no room" in last and out == ""


def test_a_ctrl_c_a_library_swallowed_is_still_an_interruption(run_cli, monkeypatch):
    """Polygraphy's bare `except:` can turn a Ctrl-C into its own error: the command still exits
    130, "interrupted", not as an internal error; the SIGINT handler is put back after."""
    import signal

    from infmoe_export.commands import doctor

    def swallowing():
        try:
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # Ctrl-C, as the process gets it
        except BaseException:
            pass
        raise RuntimeError("Function: dtype is unsupported for objects of type: ndarray")
    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(doctor, "report", swallowing)
    code, _, err = run_cli("doctor")
    assert code == 130 and err.strip() == "interrupted"
    assert signal.getsignal(signal.SIGINT) is before


def test_a_ctrl_c_during_torch_onnx_export_is_taken_after_it():
    """torch.onnx's export calls back into Python from native code that a KeyboardInterrupt
    raised there aborts the process with: a Ctrl-C in the body is held until it returns, then
    raised by the handler that was in place, which is put back."""
    from infmoe_export.export.exporter import _interrupts_held

    before = signal.getsignal(signal.SIGINT)
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with _interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs at the next bytecode: here, held
            reached.append("end of body")
    assert reached == ["end of body"] and signal.getsignal(signal.SIGINT) is before
    with _interrupts_held():  # no Ctrl-C: nothing raised
        reached.append("again")
    assert reached[-1] == "again"


@pytest.mark.timeout(120)  # without the check it trains for ever
def test_a_dropped_ctrl_c_still_stops_a_long_loop(tmp_path, run_cli, text_file):
    """Python drops a KeyboardInterrupt raised while a finalizer runs (a garbage collection in the
    middle of a training step): the Ctrl-C's flag still stops training (2^64 steps asked) at its
    next step, and the command exits 130 with no checkpoint written. Here the handler runs on
    another thread, whose KeyboardInterrupt is dropped there, as a finalizer's would be."""
    handler = signal.getsignal(signal.SIGINT)

    def ctrl_c_dropped():
        deadline = time.monotonic() + 20
        while signal.getsignal(signal.SIGINT) is handler and time.monotonic() < deadline:
            time.sleep(0.05)  # until the command has put its handler in
        time.sleep(0.5)  # training under way
        try:
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
        except KeyboardInterrupt:
            pass
    ctrl_c = threading.Thread(target=ctrl_c_dropped)
    ctrl_c.start()
    started = time.monotonic()
    code, _, err = run_cli("train", "--out", tmp_path / "out", "--corpus", text_file, "--steps", 2 ** 64,
                           "--d-model", "8", "--n-layer", "1", "--n-head", "2", "--ffn-hidden", "16",
                           "--slice-width", "4", "--n-positions", "16", "--batch-size", "2")
    ctrl_c.join()
    assert code == 130 and time.monotonic() - started < 30, err
    assert not (tmp_path / "out").exists() and signal.getsignal(signal.SIGINT) is handler


def test_unexpected_errors_are_one_line_unless_debug(run_cli, monkeypatch):
    from infmoe_export.commands import doctor

    def broken():
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(doctor, "report", broken)
    code, _, err = run_cli("doctor")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "ZeroDivisionError" in err and "--debug" in err
    with pytest.raises(ZeroDivisionError):
        run_cli("--debug", "doctor")
