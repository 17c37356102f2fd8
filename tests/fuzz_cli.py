"""Hostile invocations of every command, run in-process by tests/test_cli_fuzz.py in one child.

Usage: python fuzz_cli.py SANDBOX SEED -> prints one JSON summary line. Everything happens inside
SANDBOX (made by the test): its pre-existing files, a FIFO, symlinks, a device node (as root),
bad checkpoints and texts. Each invocation is `infmoe_export.cli.main(args)`; some are interrupted
by a timer (SIGALRM -> KeyboardInterrupt, as Ctrl-C would). After each one the sandbox is
compared with its snapshot: no pre-existing file lost or changed, nothing written outside
SANDBOX/out and SANDBOX/cache. The matrix: every command, each of its hostile option values in
turn on top of cheap valid arguments.
"""

import contextlib
import hashlib
import importlib
import io
import json
import os
import random
import resource
import signal
import stat
import sys
import time
from pathlib import Path

import torch

from infmoe_export.checkpoint import save_checkpoint
from infmoe_export.cli import main
from infmoe_export.contract import ExportedModel
from infmoe_export.export import export_onnx
from infmoe_export.files import MARKER
from infmoe_export.model import InfMoEConfig, InfMoEGPT

torch.set_num_threads(1)
TINY = InfMoEConfig(vocab_size=259, n_positions=23, d_model=15, n_layer=2, n_head=3, ffn_hidden=37, slice_width=11,
                    num_samples=3)


def build_sandbox(root: Path) -> dict:
    model = InfMoEGPT(TINY)
    model.reset_parameters(seed=1)
    ckpt = save_checkpoint(model, root / "ckpt")
    (ckpt / MARKER).unlink()  # a checkpoint the user brought, not one this program may replace
    text = root / "text.txt"
    text.write_bytes(b"hostile inputs deserve one clear line. " * 40)
    onnx_model = export_onnx(model, root / "model.onnx", k=2).path
    user = root / "user_folder"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    os.mkfifo(root / "fifo")
    (root / "link").symlink_to(user / "thesis.tex")
    (root / "dangling").symlink_to(root / "nowhere")
    if os.geteuid() == 0:
        os.mknod(root / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    deep = root / "deep_ckpt"
    deep.mkdir()
    (deep / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    (deep / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
    huge = root / "huge_ckpt"
    huge.mkdir()
    config = json.loads((ckpt / "config.json").read_text())
    (huge / "config.json").write_text(json.dumps({**config, "n_layer": 10**9}))
    (huge / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
    truncated = root / "truncated_ckpt"
    truncated.mkdir()
    (truncated / "config.json").write_text((ckpt / "config.json").read_text())
    (truncated / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:500])
    with open(root / "sparse.txt", "wb") as f:
        f.truncate(1 << 40)
    (root / "out").mkdir()
    (root / "cache").mkdir()
    return {"ckpt": ckpt, "text": text, "onnx": onnx_model}


def snapshot(root: Path) -> dict:
    """Every path outside out/ and cache/: its type, inode, size, mtime and (regular files) hash."""
    state = {}
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        if here == root:
            dirs[:] = [d for d in dirs if d not in ("out", "cache")]
        for name in dirs + names:
            path = here / name
            info = path.lstat()
            entry = (stat.S_IFMT(info.st_mode), info.st_ino, info.st_size, info.st_mtime_ns)
            if stat.S_ISREG(info.st_mode) and info.st_size < (1 << 24):
                entry += (hashlib.sha256(path.read_bytes()).hexdigest(),)
            state[str(path.relative_to(root))] = entry
    return state


def matrix(root: Path, made: dict) -> list:
    """(args, interrupt seconds or None) for every command and hostile value."""
    paths = [root / "fifo", root / "link", root / "dangling", root / "user_folder", root / "null", root / "ckpt",
             made["ckpt"] / "model.safetensors", root / "out" / ("x" * 300), "", root / "out" / "a\nb.onnx",
             root / "text.txt"]
    numbers = ["0", "-1", str(2**64), "1e309", "nan", "inf", "abc", "", "1,,2", "9" * 40, "-0", "0x10"]
    checkpoints = [root / "deep_ckpt", root / "huge_ckpt", root / "truncated_ckpt", root / "user_folder",
                   root / "fifo", root / "text.txt", root / "nowhere"]
    texts = [root / "fifo", root / "sparse.txt", root / "user_folder", root / "nowhere", root / "dangling",
             root / "null"]
    prompts = ["", "\x00", os.fsdecode(b"\xff\xfe"), "x" * 100_000, "\u202e\ud800"[:1]]
    ckpt, onnx_model, text = str(made["ckpt"]), str(made["onnx"]), str(made["text"])
    out = root / "out"
    base = {
        "eval": ["eval", "--checkpoint", ckpt, "--text", text, "--k", "1", "--batch-size", "2"],
        "onnx": ["onnx", "--checkpoint", ckpt, "--out", str(out / "m.onnx"), "--no-validate"],
        "run": ["run", "--model", onnx_model, "--prompt", "ab", "--max-new-tokens", "2", "--no-kernel"],
        "bench": ["bench", "--checkpoint", ckpt, "--model", onnx_model, "--backends", "torch", "--k", "2",
                  "--batch", "1", "--seq", "1", "--past", "1", "--iters", "1", "--warmup", "0"],
        "parity": ["parity", "--checkpoint", ckpt, "--model", onnx_model, "--out", str(out / "parity"),
                   "--backends", "ort-fallback", "--max-windows", "1", "--text", text],
        "train": ["train", "--out", str(out / "trained"), "--corpus", text, "--steps", "1", "--d-model", "6",
                  "--n-layer", "1", "--n-head", "2", "--ffn-hidden", "11", "--slice-width", "3",
                  "--n-positions", "12", "--batch-size", "2", "--eval-every", "1"],
        "pipeline": ["pipeline", "--checkpoint", ckpt, "--out", str(out / "pipeline"), "--k", "1",
                     "--noise", "quantile", "--max-windows", "1", "--iters", "1", "--warmup", "0", "--dtype", "fp32",
                     "--no-baselines"],
        "trt": ["trt", "--checkpoint", ckpt, "--out", str(out / "engines"), "--k", "1"],
        "deploy": ["deploy", "--checkpoint", ckpt, "--out", str(out / "deploy"), "--k", "1", "--dtype", "fp32",
                   "--max-windows", "1", "--budget", "0.01", "--threads", "1"],
        "inspect": ["inspect", onnx_model],
        "doctor": ["doctor"],
    }
    hostile = {
        "eval": {"--checkpoint": checkpoints, "--text": texts, "--k": numbers + ["1000000"], "--seed": numbers,
                 "--batch-size": numbers, "--noise": ["", "gaussian", "QUANTILE"]},
        "onnx": {"--out": paths, "--checkpoint": checkpoints, "--k": numbers, "--opset": numbers + ["17", "99"],
                 "--dtype": ["int4", "", "fp64"], "--atol": numbers, "--for": ["", "tvm", "tensorrt", "portable"],
                 "--target": ["", "tvm", "onnxruntime"], "--quantize-other": ["", "int2", "int8"],
                 "--block-size": numbers + ["24"]},
        "run": {"--prompt": prompts, "--temperature": numbers + ["1e-45"], "--top-k": numbers, "--seed": numbers,
                "--max-new-tokens": numbers, "--model": paths + [root / "text.txt"],
                "--dtype": ["int4", "", "fp64"], "--for": ["", "tensorrt"]},
        "bench": {"--json": paths, "--model": paths, "--k": numbers, "--batch": numbers, "--seq": numbers,
                  "--past": numbers, "--iters": numbers, "--backends": ["", "cuda", "torch,,", "trt"],
                  "--dtype": ["int4", "", "fp64,int4", ","], "--block-size": numbers},
        "parity": {"--out": paths, "--model": paths, "--atol": numbers, "--k": numbers, "--max-windows": numbers,
                   "--text": texts},
        "train": {"--out": paths, "--corpus": texts, "--steps": numbers, "--d-model": numbers, "--lr": numbers,
                  "--ffn-hidden": ["1000000000", "0", "-5"], "--threads": numbers},
        "pipeline": {"--out": paths, "--k": ["0", "-1", str(2**64), "abc", "", "1000000"],
                     "--noise": ["", "gaussian", "quantile,bogus"], "--checkpoint": checkpoints},
        "trt": {"--out": paths, "--k": numbers, "--max-batch": numbers},
        "deploy": {"--out": paths, "--checkpoint": checkpoints, "--k": numbers + ["1000000"],
                   "--dtype": ["", "fp64", "int4"], "--for": ["", "tvm", "tensorrt"], "--max-ppl-increase": numbers,
                   "--min-top1": numbers, "--block-size": numbers + ["24"], "--max-windows": numbers},
        "inspect": {"": paths},
        "doctor": {"--bogus": ["1"]},
    }
    invocations = []
    for command, options in hostile.items():
        for option, values in options.items():
            for value in values:
                args = list(base[command])
                if option == "":
                    args[-1] = str(value)
                elif option in args:
                    args[args.index(option) + 1] = str(value)
                else:
                    args += [option, str(value)]
                invocations.append((args, None))
    rng = random.Random(0)
    for command in ("eval", "onnx", "run", "bench", "parity", "train"):  # Ctrl-C at a random moment
        for _ in range(10):
            invocations.append((list(base[command]), rng.uniform(0.01, 1.5)))
    return invocations


class Interrupted(Exception):
    pass


# An invocation that is still working after this long is interrupted like the others: a huge
# --steps or --iters is a legitimate (if long) request, not a fault, and Ctrl-C must end it cleanly.
DEADLINE_S = 8.0


def torch_modes() -> list:
    """The torch dispatch and function modes active on this thread: none between commands."""
    keys = (torch._C._TorchDispatchModeKey.FAKE, torch._C._TorchDispatchModeKey.FUNCTIONAL,
            torch._C._TorchDispatchModeKey.PROXY)
    return ([torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]
            + [mode for key in keys if (mode := torch._C._get_dispatch_mode(key)) is not None]
            + [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())])


def end_process_state():
    """What the end of the process does after a real Ctrl-C: a KeyboardInterrupt raised inside
    torch.export leaves its modes pushed on this thread, and the next in-process export would abort
    on them (TorchDispatchModeTLS::set_mode)."""
    while torch._C._len_torch_dispatch_stack():
        torch._C._pop_torch_dispatch_stack()
    for key in (torch._C._TorchDispatchModeKey.FAKE, torch._C._TorchDispatchModeKey.FUNCTIONAL,
                torch._C._TorchDispatchModeKey.PROXY):
        if torch._C._get_dispatch_mode(key) is not None:
            torch._C._unset_dispatch_mode(key)
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    torch.set_grad_enabled(True)


# Libraries the commands import on first use. A real Ctrl-C ends the process, so a first import it
# interrupts never outlives it; in this one process the timer's interrupt landing inside one would
# leave it half-initialized for every later invocation (matplotlib then has no get_data_path, and
# its C extensions cannot be imported afresh). So they are imported before any timer runs.
FIRST_USE_IMPORTS = ("matplotlib", "matplotlib.pyplot", "matplotlib.ticker", "jsonschema", "tokenizers",
                     "onnxruntime", "tritonclient.http", "tritonclient.grpc")


def import_first_use_libraries():
    for name in FIRST_USE_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # not installed: the commands that need it say so
            pass


def run_one(args, interrupt):
    stdout, stderr = io.StringIO(), io.StringIO()
    code = None

    def fire(signum, frame):  # Ctrl-C: whatever SIGINT handler the command runs under
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, frame)
        raise KeyboardInterrupt

    signal.signal(signal.SIGALRM, fire)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            signal.setitimer(signal.ITIMER_REAL, interrupt or DEADLINE_S)
            try:
                main(args)
                code = 0
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except KeyboardInterrupt:  # the timer fired after main returned: the invocation itself finished
        code = code if code is not None else 130
    return code, stdout.getvalue(), stderr.getvalue()


def main_fuzz(root: Path, seed: int):
    os.environ["XDG_CACHE_HOME"] = str(root / "cache")
    os.environ["INFMOE_MAX_MEMORY_GIB"] = "1.5"  # as on a small edge box, whatever this machine has
    os.environ["MPLBACKEND"] = "Agg"  # the backend the report selects, before pyplot's import here
    made = build_sandbox(root)
    import_first_use_libraries()  # after the sandbox: matplotlib makes its cache folder under it
    invocations = matrix(root, made)
    random.Random(seed).shuffle(invocations)
    before = snapshot(root)
    problems, codes, replaced_as_asked = [], {}, 0
    for number, (args, interrupt) in enumerate(invocations):
        # Named before it runs: if it kills the process (a crash inside a library), the test's
        # message ends with this line.
        print(f"{number} runs{f' (interrupted after {interrupt} s)' if interrupt else ''}: {args!r}",
              file=sys.stderr, flush=True)
        started = time.perf_counter()
        code, out, err = run_one(args, interrupt)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        print(f"{number} exit {code} in {time.perf_counter() - started:.2f} s, peak {peak} MiB", file=sys.stderr, flush=True)
        codes[code] = codes.get(code, 0) + 1
        shown = " ".join(a if len(a) < 60 else a[:57] + "..." for a in args)
        if code == 130:
            end_process_state()
        elif torch_modes() or not torch.is_grad_enabled():  # a finished command leaves no mode behind
            problems.append(f"torch modes or grad mode left behind: {shown}: {torch_modes()}")
            end_process_state()
        # Python prints "Exception ignored in ..." when the timer's KeyboardInterrupt lands in a
        # finalizer (a weakref callback): the interpreter's doing, as with a real Ctrl-C.
        err_checked = "" if "Exception ignored in" in err and err.count("Traceback") == 1 and \
            "raise KeyboardInterrupt" in err else err
        if "Traceback" in err_checked or "Traceback" in out or "unexpected" in err_checked:
            problems.append(f"traceback or internal error: {shown}: {err.strip()[-300:]}")
        if code not in (0, 1, 2, 130):
            problems.append(f"exit status {code}: {shown}")
        if code == 1 and not err.strip().splitlines()[-1:][0].startswith("error: "):
            problems.append(f"exit 1 without an error line: {shown}: {err.strip()[-200:]}")
        after = snapshot(root)
        if after != before:
            changed = {name for name, _ in set(after.items()) ^ set(before.items())}
            # Replacing a regular file named as the output file is what the user asked for.
            asked = {str(Path(args[i + 1]).relative_to(root)) for i, a in enumerate(args[:-1])
                     if a in ("--json", "--out", "--repair") and args[i + 1].startswith(str(root) + "/")
                     and before.get(str(Path(args[i + 1]).relative_to(root)), (None,))[0] == stat.S_IFREG}
            if changed == asked:
                replaced_as_asked += 1
            else:
                problems.append(f"sandbox changed outside out/ and cache/: {shown}: {sorted(changed)[:3]}")
            before = after
    cache_entries = list((root / "cache").rglob("model.onnx"))
    for entry in cache_entries:  # whatever the cache holds must be a complete, readable model
        ExportedModel.read(entry)
    print(json.dumps({"invocations": len(invocations), "interrupted": sum(1 for _, i in invocations if i),
                      "exit_codes": {str(k): v for k, v in sorted(codes.items(), key=str)}, "problems": problems,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "cache_entries": len(cache_entries),
                      "regular_output_files_replaced_as_asked": replaced_as_asked}))


if __name__ == "__main__":
    main_fuzz(Path(sys.argv[1]), int(sys.argv[2]))
