"""`infmoe-export inspect`: what an ONNX model (or exported folder) holds, what a tool broke, and
the fix; `--repair OUT` writes the model back with its metadata and fallback function."""

import json
from pathlib import Path

import click

from ..export.inspection import inspect_model, model_path, repair_model
from ..files import output_file
from ..runtimes import ort_kernel


@click.command("inspect")
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.option("--repair", type=click.Path(path_type=Path), default=None,
              help="Write a repaired copy here: metadata restored from the folder's config.json, the fallback "
                   "function added back.")
def inspect_command(model, as_json, repair):
    """What MODEL (a .onnx file or an exported folder) holds, and what is wrong with it."""
    source = model_path(model)
    if repair is not None:
        output_file(repair, inputs=[source])
    found = inspect_model(source, kernel_available=ort_kernel.custom_op_library() is not None)
    if as_json:
        click.echo(json.dumps(found.as_dict(), indent=2))
    else:
        io = found.io
        click.echo(f"{found.path}: {found.size_bytes / 1e6:.1f} MB, opsets "
                   + ", ".join(f"{d} {v}" for d, v in sorted(found.opsets.items())))
        click.echo(f"metadata: {found.metadata_source}"
                   + (f" (exporter {found.metadata.get('infmoe.exporter_version', '?')})" if io else ""))
        if io is not None:
            c = io.config
            ffn = f"E {c.num_experts}, top-{c.top_k}" if io.is_moe else f"r {c.slice_width}"
            click.echo(f"model: D {c.d_model}, L {c.n_layer}, heads {c.n_head}, H {c.ffn_hidden}, {ffn}, "
                       f"V {c.vocab_size}; K {io.k}, noise {io.noise}, past {io.past}, dtype {io.dtype}")
        expert_op = "MoE / QMoE" if io is not None and io.is_moe else "ContinuousSliceFFN"
        click.echo(f"{expert_op} nodes: {found.op_nodes}; fallback function: "
                   f"{'yes' if found.has_function else 'no'} (metadata says {'yes' if found.claims_function else 'no'})")
        for kind, values in (("input", found.inputs), ("output", found.outputs)):
            for name, dims in values.items():
                click.echo(f"  {kind:6} {name} {dims}")
        if found.polygraphy_command():
            click.echo(f"polygraphy: {found.polygraphy_command()}")
        if found.problems:
            for problem in found.problems:
                click.echo(f"problem: {problem}")
        else:
            click.echo("no problems found")
    if repair is not None:
        for step in repair_model(source, repair):
            click.echo(f"repair: {step}", err=True)
        click.echo(f"wrote {repair}", err=True)
