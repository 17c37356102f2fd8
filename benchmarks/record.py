"""Where results go: benchmarks/results/<name>.json, written whole or not at all (a temporary file
renamed over the old one), with the machine that measured them."""

import datetime
import os
from importlib import metadata
from pathlib import Path
from typing import Optional

from infmoe_export.files import write_json
from infmoe_export.report.timing import environment

RESULTS = Path(__file__).resolve().parent / "results"
PEER_PACKAGES = ("llama-cpp-python", "gguf", "triton")


def default_path(name: str) -> Path:
    return RESULTS / f"{name}.json"


def machine(threads: Optional[int] = None) -> dict:
    """CPU, cores, threads, the date, the library versions of this run, and the machine's load
    average (1, 5, 15 minutes) as it ended: how quiet the machine was."""
    env = environment(threads)
    env["load_average"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    for package in PEER_PACKAGES:
        try:
            env["versions"][package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env["versions"][package] = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **env}


def save(path, benchmark: str, result: dict, threads: Optional[int] = None) -> Path:
    """result with the benchmark's name and this machine (in place of any the result holds: a
    child's results merged by its parent), as JSON at path, atomically."""
    rest = {key: value for key, value in result.items() if key not in ("benchmark", "machine")}
    return write_json(path, {"benchmark": benchmark, "machine": machine(threads), **rest})
