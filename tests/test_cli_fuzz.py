"""Over 500 hostile invocations of every command (tests/fuzz_cli.py), in one child process so
that its peak resident memory is its own: 0 tracebacks, 0 internal errors, 0 writes outside the
given outputs, 0 pre-existing files lost or changed, peak RSS under 2 GiB."""

import json
import os
import subprocess
import sys
from pathlib import Path

FUZZ = Path(__file__).with_name("fuzz_cli.py")


def unfinished(log: str):
    """The line of the invocation the fuzzer started and never finished, if any (its log names each
    one before it runs: "N runs: ...", and after it: "N exit ...")."""
    last = None
    for line in log.splitlines():
        word = line.split(" ", 2)[1:2]
        if word in (["runs"], ["runs:"]):
            last = line
        elif word == ["exit"]:
            last = None
    return last


def test_unfinished_names_the_invocation_that_never_ended():
    log = "0 runs: ['onnx']\n0 exit 1 in 0.10 s, peak 300 MiB\n1 runs (interrupted after 0.5 s): ['bench']\n"
    assert unfinished(log) == "1 runs (interrupted after 0.5 s): ['bench']"
    assert unfinished(log + "1 exit 130 in 0.50 s, peak 310 MiB\n") is None


def test_hostile_invocations(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(FUZZ), str(tmp_path), str(seed)], capture_output=True, text=True,
                            env=env, timeout=1500)
    if result.returncode != 0:
        during = unfinished(result.stderr)
        raise AssertionError(f"seed {seed}: the fuzzing process ended with status {result.returncode}"
                             f"{', during ' + during if during else ''}\n{result.stderr[-3000:]}")
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["invocations"] >= 500 and summary["interrupted"] >= 50
    assert summary["problems"] == [], f"seed {seed}: " + "\n".join(summary["problems"][:10])
    # Refusals dominate, and some invocations ran for real (the matrix is not all rejected).
    codes = summary["exit_codes"]
    assert codes.get("1", 0) > 100 and codes.get("0", 0) > 20, codes
    assert summary["peak_rss_mib"] < 2048, summary
