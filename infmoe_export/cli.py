"""`infmoe-export`: one click group; each command lives beside the code it drives.

Commands are imported lazily so that `--help` is instant and a command whose optional
dependency is missing does not break the others.
"""

import importlib
import os
import signal
import sys
import threading

import click

from .errors import INTERRUPTED, InfMoEError

# command name -> ("module:attribute" of a click.Command, one-line help shown by --help)
COMMANDS = {
    "train": ("infmoe_export.commands.train:train_command", "Train an ∞-MoE model (or the conventional top-k MoE) from scratch on a byte corpus."),
    "eval": ("infmoe_export.commands.eval:eval_command", "Perplexity of a checkpoint per expert budget K."),
    "doctor": ("infmoe_export.commands.doctor:doctor_command", "What this machine can run: torch, onnxruntime, kernels, TensorRT."),
    "onnx": ("infmoe_export.commands.onnx:onnx_command", "Export a checkpoint to ONNX with the ContinuousSliceFFN op."),
    "run": ("infmoe_export.commands.run:run_command", "Generate text with onnxruntime (or a TensorRT engine), streaming it."),
    "trt": ("infmoe_export.commands.trt:trt_command", "Build one TensorRT engine per expert budget K."),
    "parity": ("infmoe_export.commands.parity:parity_command", "Parity of every backend against the PyTorch reference."),
    "bench": ("infmoe_export.commands.bench:bench_command", "Latency, throughput and memory per backend and K."),
    "pipeline": ("infmoe_export.commands.pipeline:pipeline_command", "The main job: export, validate, parity, latency, reports."),
    "deploy": ("infmoe_export.commands.deploy:deploy_command", "A folder to ship: the fastest artifact per K, the kernel, a parity certificate, latency, how to load it."),
    "inspect": ("infmoe_export.commands.inspect:inspect_command", "What an ONNX model holds, what a tool broke, and the fix (--repair)."),
    "triton-repo": ("infmoe_export.commands.triton_repo:triton_repo_command", "A Triton Inference Server model repository: per-K models and a decoding front model."),
    "serve": ("infmoe_export.commands.serve:serve_command", "Serve a model repository on Triton (HTTP, gRPC, metrics), K per request."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, attribute = COMMANDS[name][0].split(":")
        return getattr(importlib.import_module(module), attribute)

    def format_commands(self, ctx, formatter):
        with formatter.section("Commands"):
            formatter.write_dl([(name, COMMANDS[name][1]) for name in self.list_commands(ctx)])


DEBUG = {"on": False}  # set by --debug: show the traceback of an unexpected error


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="infmoe-export")
@click.option("--debug", is_flag=True, help="Show the full traceback of an unexpected error.")
def cli(debug):
    """Export, run, compile and prove ∞-MoE language models."""
    DEBUG["on"] = debug


def one_line(message) -> str:
    """A message on one line, whatever paths it quotes (a file name may hold a newline)."""
    return str(message).replace("\r", "\\r").replace("\n", "\\n")


def _interrupt(signum, frame):
    INTERRUPTED["on"] = True
    raise KeyboardInterrupt


def main(argv=None):
    DEBUG["on"] = False
    INTERRUPTED["on"] = False
    previous = signal.signal(signal.SIGINT, _interrupt) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        _main(argv)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _main(argv):
    # Piped output (CI logs, `| tee`) would otherwise be cut to rich's 80-column default and
    # truncate the report tables; rich reads COLUMNS when the stream is not a terminal.
    if not sys.stdout.isatty():
        os.environ.setdefault("COLUMNS", "200")
    try:
        cli.main(args=argv, prog_name="infmoe-export", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as error:
        error.show()
        sys.exit(error.exit_code)
    except (InfMoEError, OSError) as error:
        if INTERRUPTED["on"]:  # torch.export, for one, turns the Ctrl-C into its own failure
            click.echo("interrupted", err=True)
            sys.exit(130)
        if isinstance(error, InfMoEError):
            click.echo(f"error: {one_line(error)}", err=True)
            sys.exit(1)
        # OSError: the environment, not a bug: a full disk, a name too long, no permission
        where = f": {error.filename}" if error.filename else ""
        click.echo(one_line(f"error: {error.strerror or error}{where}"), err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except (MemoryError, RecursionError) as error:
        click.echo(f"error: out of {'memory' if isinstance(error, MemoryError) else 'stack'}: the input is too large "
                   "for this machine", err=True)
        sys.exit(1)
    except Exception as error:  # the error boundary: one line, never a traceback, unless asked for
        if INTERRUPTED["on"]:  # a library swallowed the Ctrl-C and then failed its own way
            click.echo("interrupted", err=True)
            sys.exit(130)
        if DEBUG["on"]:
            raise
        summary = one_line(str(error).strip())[:300]
        click.echo(f"error: unexpected {type(error).__name__}: {summary} (rerun with `infmoe-export --debug ...` "
                   "for the traceback, and please report it)", err=True)
        sys.exit(2)
