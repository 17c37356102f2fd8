"""The local Triton server: nvidia-pytriton's tritonserver binary (Triton 2.51, Python backend
only) started on a repository of `triton-repo`.

What makes its Python backend work from this package's virtual environment (a raw Python-backend
model otherwise fails in the stub with "'_thread.RLock' object has no attribute
'_recursion_count'" or "No module named ..."): a backend folder of our own holding the wheel's
libtriton_python.so with the stub built for *this* interpreter's minor version
(pytriton/tritonserver/python_backend_stubs/3.X), the interpreter's own libpython first on
LD_LIBRARY_PATH (so the stub runs this Python's standard library, not the system's), and the
environment's bin/ first on PATH (so the stub's sys.executable is the venv's python and its
site-packages, numpy and onnxruntime, are on sys.path). PyTriton does the same for its own
models; the repository itself stays a stock one.
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

from ..errors import InfMoEError
from .config import FRONT_MODEL, GENERATE_MODEL

PYTRITON_VERSION = "0.7.0"


def pytriton_dist() -> Path:
    """pytriton/tritonserver of the installed nvidia-pytriton (without importing pytriton)."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise InfMoEError("serving needs the tritonserver of nvidia-pytriton: pip install 'infmoe-export[serve]'")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise InfMoEError(f"nvidia-pytriton is installed without its tritonserver binary ({root})")
    return root


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def backend_dir(into: Path) -> Path:
    """A Triton backend folder with the Python backend and the stub for this interpreter."""
    dist = pytriton_dist()
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise InfMoEError(f"nvidia-pytriton has no Python backend stub for Python {version}")
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        raise InfMoEError(f"this Python ({sys.executable}) is built without a shared libpython; the Triton "
                          "Python backend stub needs one")
    python = into / "python"
    shutil.copytree(dist / "backends" / "python", python, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stub, python / "triton_python_backend_stub")
    return into


def server_env() -> dict:
    dist = pytriton_dist()
    env = dict(os.environ)
    libs = [str(dist.parent.parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR")]
    env["LD_LIBRARY_PATH"] = ":".join(libs + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("PYTHONHOME", None)
    return env


class TritonServer:
    """tritonserver on a repository, bound to `host`; a context manager that always stops it.
    Ports are free ones unless given. Only the front and generate models are loaded (explicit model control):
    the onnxruntime/TensorRT-backend models need backends this binary does not carry."""

    def __init__(self, repository: Path, *, host: str = "127.0.0.1", http_port: Optional[int] = None,
                 grpc_port: Optional[int] = None, metrics_port: Optional[int] = None,
                 log: Optional[Path] = None, load_all: bool = False):
        self.repository = Path(repository).resolve()
        self.host = host
        self.http_port = http_port or free_port(host)
        self.grpc_port = grpc_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.log_path = log
        self.load_all = load_all
        self.process: Optional[subprocess.Popen] = None
        self._workdir: Optional[Path] = None
        self.restarts = 0
        self._stop_watch = threading.Event()
        self._watcher: Optional[threading.Thread] = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self) -> List[str]:
        command = [str(pytriton_dist() / "bin" / "tritonserver"),
                   f"--model-repository={self.repository}", f"--backend-directory={self._workdir / 'backends'}",
                   f"--http-address={self.host}", f"--http-port={self.http_port}",
                   f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                   "--allow-metrics=true", f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
                   "--strict-readiness=true", "--exit-timeout-secs=10", "--log-verbose=0"]
        if not self.load_all:
            command += ["--model-control-mode=explicit"] + [f"--load-model={name}" for name in self.front_models()]
        return command

    def front_models(self) -> List[str]:
        """The repository's Python-backend models: the front model and, in a repository that has
        it, the generate model."""
        return [FRONT_MODEL] + [GENERATE_MODEL] * (self.repository / GENERATE_MODEL).is_dir()

    def start(self, timeout: float = 120.0) -> "TritonServer":
        self._workdir = Path(tempfile.mkdtemp(prefix="infmoe-triton."))
        backend_dir(self._workdir / "backends")
        log = open(self.log_path or self._workdir / "server.log", "ab")
        try:
            self.process = subprocess.Popen(self.command(), env=server_env(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        self.wait_ready(timeout)
        self._stop_watch.clear()
        self._watcher = threading.Thread(target=self._watch, name="infmoe-triton-watch", daemon=True)
        self._watcher.start()
        return self

    def _watch(self, period: float = 0.5):
        """Recovery: this Triton's Python backend does not restart a stub that died (killed, out of
        memory); its requests fail with "Stub process ... is not healthy" until the model is loaded
        again. When a front model's stub is gone, load that model again through the repository API.
        Sequences that lived in it are lost; their next step is refused with a 400 naming why (a
        generation in flight ends with an error)."""
        while not self._stop_watch.wait(period) and self.process is not None and self.process.poll() is None:
            if not self._missing_stubs():
                continue
            time.sleep(period)  # a stub being replaced by a load in progress
            for name in self._missing_stubs():
                if self._stop_watch.is_set():
                    break
                with contextlib.suppress(OSError, urllib.error.URLError):
                    if self._reload(name):
                        self.restarts += 1

    def _missing_stubs(self) -> List[str]:
        running = set(self.stub_pids().values())
        return [name for name in self.front_models() if name not in running]

    def _post(self, name: str, action: str) -> int:
        url = f"http://{self.http_url}/v2/repository/models/{name}/{action}"
        request = urllib.request.Request(url, data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status

    def _reload(self, name: str) -> bool:
        """Unload, then load: a load of an unchanged, loaded model is a no-op in Triton, which
        would leave the dead stub in place."""
        if self._post(name, "unload") != 200:
            return False
        deadline = time.monotonic() + 30
        ready = f"http://{self.http_url}/v2/models/{name}/ready"
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(ready, timeout=2).close()
            except (OSError, urllib.error.URLError):
                break  # 400: not ready any more
            time.sleep(0.2)
        return self._post(name, "load") == 200

    def log_text(self) -> str:
        path = self.log_path or (self._workdir / "server.log" if self._workdir else None)
        try:
            return Path(path).read_text(errors="replace") if path else ""
        except OSError:
            return ""

    def wait_ready(self, timeout: float):
        deadline = time.monotonic() + timeout
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                errors = [line for line in self.log_text().splitlines() if line.startswith("E") or "error" in line]
                self.stop()
                raise InfMoEError(f"tritonserver exited with status {self.process.returncode} while starting: "
                                  + (errors[-1][:300] if errors else "see its log"))
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        return
            time.sleep(0.25)
        self.stop()
        raise InfMoEError(f"tritonserver was not ready within {timeout:g} s")

    def stop(self, timeout: float = 20.0) -> Optional[int]:
        """SIGTERM (Triton finishes in-flight requests, unloads the models), SIGKILL after timeout."""
        code = None
        self._stop_watch.set()
        if self._watcher is not None:
            self._watcher.join(5)
            self._watcher = None
        if self.process is not None:
            if self.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGTERM)
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.process.pid, signal.SIGKILL)
                    self.process.wait()
            code = self.process.returncode
            # the Python backend's stubs are in the same process group; none may outlive the server
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        return code

    def stub_pids(self) -> Dict[int, str]:
        """The Python backend stubs of this server (children of tritonserver) that are alive: process
        id -> the model each runs (its folder, named on the stub's command line)."""
        pids = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                state, ppid = stat.rsplit(")", 1)[1].split()[:2]
                # a killed stub stays a zombie until the server reaps it: it is not alive
                if int(ppid) == self.process.pid and state not in ("Z", "X") and "triton_python_b" in stat:
                    arguments = (entry / "cmdline").read_bytes().split(b"\0")
                    pids[int(entry.name)] = next((name for name in self.front_models() for a in arguments
                                                  if f"/{name}/".encode() in a), "")
        return pids

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
