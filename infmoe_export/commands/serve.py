"""`infmoe-export serve`: run a model repository on the local Triton server (docs/guide/serving.md)."""

import shutil
import signal
import tempfile
import time
from pathlib import Path

import click

from ..checkpoint import load_checkpoint
from ..errors import InfMoEError
from ..options import choices_from_flags, export_choice_options, positive_ints
from ..serving.repository import build_repository, read_repository
from ..serving.server import TritonServer

PORT = click.IntRange(0, 65535)


@click.command("serve")
@click.option("--repo", type=click.Path(path_type=Path), default=None,
              help="A repository of `infmoe-export triton-repo` (default: one for the bundled model, built now "
                   "into a temporary folder).")
@click.option("--k", "ks", default="1,2,4,8", show_default=True, help="Without --repo: the expert budgets to serve.")
@export_choice_options(many=True, deployments=("onnxruntime", "portable"))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (HTTP, gRPC, metrics).")
@click.option("--port", type=PORT, default=8000, show_default=True, help="HTTP port (0: a free one).")
@click.option("--grpc-port", type=PORT, default=8001, show_default=True, help="gRPC port (0: a free one).")
@click.option("--metrics-port", type=PORT, default=8002, show_default=True, help="Prometheus metrics port (0: free).")
@click.option("--timeout", type=float, default=180.0, show_default=True, help="Seconds to wait for readiness.")
def serve_command(repo, ks, deploy, dtype, quantize_other, block_size, activations, kv_cache, host, port, grpc_port,
                  metrics_port, timeout):
    """Serve a model repository on Triton (nvidia-pytriton's tritonserver) until SIGTERM or Ctrl-C.
    Without --repo, the bundled model exported as --for and --dtype say (default: onnxruntime,
    fp32; the model `run` runs) into a temporary repository."""
    if repo is not None and any(value is not None for value in
            (deploy, dtype, quantize_other, block_size, activations, kv_cache)):
        raise InfMoEError("--for, --dtype, --quantize-other, --block-size, --activations and --kv-cache choose what to "
                          "export; they cannot be combined with --repo (its models are exported already)")
    temporary = None
    try:
        if repo is None:
            k_list = positive_ints(ks, "--k")
            model = load_checkpoint(None)
            choices = choices_from_flags(model.config, deploy, dtype, quantize_other, block_size,
                                         activations=activations, kv_cache=kv_cache)
            temporary = Path(tempfile.mkdtemp(prefix="infmoe-serve."))
            repo = temporary / "repository"
            build_repository(model, repo, k_list, choices, progress=lambda t: click.echo(t, err=True))
        info = read_repository(repo)
        server = TritonServer(repo, host=host, http_port=port or None, grpc_port=grpc_port or None,
                              metrics_port=metrics_port or None)
        stop = {"signal": None}

        def on_signal(number, _frame):
            stop["signal"] = number

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            server.start(timeout)
            served = [f"{route} ({entry['exported']})" if "exported" in entry else route
                      for route, entry in sorted(info["routes"].items())]
            click.echo(f"serving {', '.join(served)} (K/precision) from {repo}")
            click.echo(f"  HTTP    http://{server.http_url}/v2/models/infmoe   (health: /v2/health/ready)")
            click.echo(f"  gRPC    {server.grpc_url}" + ("   (generate model: infmoe_generate, streamed tokens)"
                                                          if "generate_model" in info else ""))
            click.echo(f"  metrics {server.metrics_url}")
            while stop["signal"] is None and server.process.poll() is None:
                time.sleep(0.2)
            if stop["signal"] is None:
                raise InfMoEError(f"tritonserver exited with status {server.process.returncode}")
            click.echo("stopping: finishing in-flight requests", err=True)
        finally:
            code = server.stop()
            for number, handler in previous.items():
                signal.signal(number, handler)
        click.echo(f"stopped (tritonserver exit status {code})", err=True)
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
