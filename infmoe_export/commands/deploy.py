"""`infmoe-export deploy`: from a checkpoint to a folder to ship.

    OUT/k{K}/            one folder per K in Optimum's layout (export/hf_folder.py): model.onnx, the
                         clients' files, and the kernel library (named in genai_config.json)
    OUT/certificate.json the parity certificate: each model against PyTorch (level 1, the kernel)
                         and against the float model (level 2, the accuracy budget), with the
                         files' SHA-256
    OUT/latency.json     batch-1 decode and prefill on this machine, on the deployed backend
    OUT/README.md        how to load it from onnxruntime, Optimum, onnxruntime-genai and Triton

The artifact is the export choice of --for and --dtype (default onnxruntime). Without --dtype,
the fastest precision whose certificate passes at every K: all-int4, else all-int8, else fp32;
the certificate names the precisions refused and why. A kernel (level-1) failure is an error,
never a reason to try another precision. Everything is staged beside OUT and published at the
end: a failed or interrupted deploy leaves no output folder (or the previous one whole).
"""

import datetime
import shutil
import sys
from pathlib import Path

import click
import torch
from rich.console import Console

from .. import __version__
from ..checkpoint import CONFIG_FILE, DEFAULT_CHECKPOINT, WEIGHTS_FILE, load_checkpoint
from ..errors import InfMoEError
from ..export import export_onnx
from ..export.hf_folder import GENAI_CONFIG_FILE, MODEL_FILE, genai_config, write_hf_folder
from ..files import sha256, write_json
from ..options import (QUANTIZED_ACTIVATIONS, WINDOWS, THREADS, FiniteFloat, check_forward_memory, choices_from_flags,
                       export_choice_options, positive_ints)
from ..quant import DEFAULT_BLOCK_SIZE
from ..report.bench import DEFAULT_PAST, checked_backends, deployed_backend, level1_backend, run_bench
from ..report.render import interval, pct, ppl, sci, sig, signed_pct
from ..report.timing import REL_CI, environment
from ..runtimes import ort_kernel
from ..verify.parity import DEFAULT_MAX_PPL_INCREASE, DEFAULT_MIN_TOP1, failures, run_parity
from ..verify.validate import validate_onnx
from .pipeline import BUDGET_S, COST, PREFILL, Stages, staged_output

DEFAULT_KS = "1,2,8"
FASTEST_FIRST = ("int4", "int8", "fp32")  # without --dtype: the first whose certificate passes


@click.command("deploy")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
              help="Checkpoint directory (default: the bundled model).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The folder to write (new, or a "
                                                                              "previous deploy's).")
@click.option("--k", "ks", default=DEFAULT_KS, show_default=True, help="Expert budgets K, one model each.")
@export_choice_options(deployments=("onnxruntime", "portable"))
@click.option("--max-windows", type=WINDOWS, default=8, show_default=True,
              help="Windows of n_positions tokens of validation text for the certificate.")
@click.option("--max-ppl-increase", type=FiniteFloat(min=0), default=100 * DEFAULT_MAX_PPL_INCREASE, show_default=True,
              help="Accuracy (level-2) budget: perplexity increase over the float model, in percent.")
@click.option("--min-top1", type=FiniteFloat(0, 1), default=DEFAULT_MIN_TOP1, show_default=True,
              help="Accuracy (level-2) budget: least share of tokens whose top-1 agrees with the float model's.")
@click.option("--budget", "budget_s", type=FiniteFloat(min=0.01), default=BUDGET_S, show_default=True,
              help="Seconds of interleaved timing per latency figure at most.")
@click.option("--threads", type=THREADS, default=None,
              help="Intra-op threads of torch and onnxruntime for latency (default: their own defaults).")
def deploy_command(checkpoint, out, ks, deploy, dtype, quantize_other, block_size, activations, kv_cache, max_windows,
                   max_ppl_increase,
                   min_top1, budget_s, threads):
    """From a checkpoint to a folder to ship: the fastest artifact per K, the kernel library, a
    parity certificate, latency on this machine, and a README on loading it."""
    ks = positive_ints(ks, "--k")
    source = Path(checkpoint) if checkpoint is not None else DEFAULT_CHECKPOINT
    torch_model = load_checkpoint(checkpoint)
    candidates = choices_from_flags(torch_model.config, deploy, dtype or ",".join(FASTEST_FIRST), quantize_other,
                                    block_size, activations=activations, kv_cache=kv_cache)
    candidates.sort(key=lambda c: FASTEST_FIRST.index(c.dtype) if c.dtype in FASTEST_FIRST else 0)
    check_forward_memory(torch_model.config, 1, torch_model.config.n_positions, max(ks))
    if threads:
        torch.set_num_threads(threads)
    console = Console(stderr=True)
    library = ort_kernel.custom_op_library()
    if library is None:
        console.print("note: the onnxruntime kernel library is not built here, so the folder holds none and the "
                      "models run on their fallback function (standard ops, slower); `pip install -e .` builds it "
                      "(docs/guide/onnxruntime.md)", markup=False, highlight=False)
    for note in dict.fromkeys(c.note for c in candidates if c.note):
        console.print(f"note: {note}", markup=False, highlight=False)
    limits = dict(max_windows=max_windows, max_ppl_increase=max_ppl_increase / 100, min_top1=min_top1)
    with staged_output(out, inputs=[source]) as work:
        certificate, latency = build(console, work, torch_model, ks, candidates, library, limits,
                                     budget_s, threads, explicit=dtype is not None)
        certificate.update(checkpoint=str(source),
                           checkpoint_sha256=sha256(source / CONFIG_FILE, source / WEIGHTS_FILE))
        write_json(work / "certificate.json", certificate)
        write_json(work / "latency.json", latency)
        (work / "README.md").write_text(readme(certificate, latency, library is not None))
    steps = ", ".join(f"K={r['k']} {sig(r['latency_ms']['median'])} ms" for r in latency["results"]
                      if r["phase"] == "decode")
    click.echo(f"deployed {certificate['export']} into {out}/ (certificate passed; decode step {steps} on this "
               f"machine); how to load it: {out / 'README.md'}")


def build(console, work: Path, torch_model, ks, candidates, library, limits, budget_s, threads, explicit):
    """Export, validate and certify each candidate precision in turn into work/k{K}/ until one
    passes at every K (on its deployed backend, and on float activations where it takes int8
    ones: level 1); then time it and write the clients' files. Returns (certificate, latency)."""
    per_model = COST["export"] + COST["validate"] + COST["parity"]
    plan = [(f"{candidates[0].precision}", len(ks), per_model), ("latency", 2, budget_s * len(ks))]
    refused = []
    with Stages(console, plan) as stages:
        for choice in candidates:
            if refused:
                stages.add(choice.precision, len(ks), per_model)
            models = []
            backend = deployed_backend(library is not None, choice.activations)

            def certify(advance):
                nonlocal parity
                for k in ks:
                    advance(f"K={k}: export")
                    model = export_onnx(torch_model, work / f"k{k}" / MODEL_FILE, k=k, with_starts=True,
                                        **choice.options())
                    validate_onnx(torch_model, model, kernel=library is not None)
                    models.append(model)
                parity = run_parity(torch_model, models, backends=checked_backends(library is not None,
                                                                                  [choice.activations]), **limits)
                return "ok", None

            parity = None
            stages.run(choice.precision, certify)
            failing = [r["backend"] for r in parity["results"] if r["level1"] == "fail"]
            if failing:
                raise InfMoEError(f"{choice.label}: the {failing[0]} backend disagrees with PyTorch: "
                                  + "; ".join(failures(parity)))
            failed = failures(parity)
            if not failed:
                break
            refused.append({"export": choice.label, "why": failed})
            if explicit or choice is candidates[-1]:
                raise InfMoEError(f"{choice.label} is over the accuracy budget: {'; '.join(failed)} (raise "
                                  "--max-ppl-increase or lower --min-top1, or choose another --dtype)")
            console.print(f"{choice.label}: over the accuracy budget ({failed[0]}); trying the next precision",
                          markup=False, highlight=False)
            for k in ks:
                shutil.rmtree(work / f"k{k}")

        def time_it(advance):
            nonlocal bench
            n = torch_model.config.n_positions
            bench = run_bench(torch_model, models, backends=[backend], batches=(1,), seqs=(1, min(PREFILL, n)),
                              past=min(DEFAULT_PAST, n - 1), warmup=2, budget_s=budget_s, rel_ci=REL_CI,
                              threads=threads, progress=advance)
            return "ok", None

        bench = None
        stages.run("latency", time_it)
    for model in models:
        folder = model.path.parent
        write_hf_folder(folder, model)
        if library is not None and model.io.past:  # genai loads a library only from the model's folder
            shutil.copyfile(library, folder / Path(library).name)
            write_json(folder / GENAI_CONFIG_FILE, genai_config(model, Path(library).name))
    env = environment(threads)
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    certificate = {
        "passed": True, "created": created, "tool_version": __version__,
        "command": "infmoe-export " + " ".join(sys.argv[1:]), "export": choice.label,
        "export_options": choice.options(), "backend": backend,
        "kernel_library": Path(library).name if library else None, "refused": refused,
        "settings": parity["settings"],
        "models": [certified(model, parity["results"], backend) for model in models],
        "environment": env}
    latency = {"created": created, "export": choice.label, "backend": backend, "environment": env,
               "settings": bench["settings"],
               "results": [{key: r[key] for key in ("k", "phase", "batch", "seq", "past", "iters", "latency_ms",
                                                    "tokens_per_s")} for r in bench["results"] if r["status"] == "ok"]}
    return certificate, latency


def certified(model, results, backend: str) -> dict:
    """A model's entry in the certificate: level 2 (and status) on the deployed backend, level 1
    on the backend that checks it (ort beside ort-a8: the same kernels on float activations)."""
    row = next(r for r in results if r["backend"] == backend and r["k"] == model.k)
    checked = level1_backend(backend)
    level1 = next(r for r in results if r["backend"] == checked and r["k"] == model.k)
    return {"k": model.k, "file": f"k{model.k}/{MODEL_FILE}", "sha256": sha256(model.path),
            **{key: row[key] for key in ("status", "level2", "top1_agreement", "perplexity", "float_perplexity",
                                         "perplexity_increase", "float_top1_agreement")},
            "level1_backend": checked,
            **{key: level1[key] for key in ("level1", "start_agreement", "clean_token_share")},
            "max_abs_logit_error_clean": (level1["error_clean"] or level1["error_all"])["max"]}


def export_flags(options: dict) -> str:
    """The flags that export the same artifact again (the defaults left out)."""
    quantized = options["dtype"] in ("int8", "int4")
    flags = [f"--for {options['target']}", f"--dtype {options['dtype']}"]
    if options["quantize_other"] != (options["dtype"] if quantized else "none"):
        flags.append(f"--quantize-other {options['quantize_other']}")
    if quantized and options["block_size"] != DEFAULT_BLOCK_SIZE:
        flags.append(f"--block-size {options['block_size']}")
    if quantized and options["target"] == "onnxruntime" and \
            options.get("activations", "float") != QUANTIZED_ACTIVATIONS:
        flags.append(f"--activations {options.get('activations', 'float')}")
    if options.get("kv_cache", "float32") != "float32":
        flags.append(f"--kv-cache {options['kv_cache']}")
    return " ".join(flags)


def readme(certificate: dict, latency: dict, kernel: bool) -> str:
    """The folder's README: what it holds, the certificate and latency in short, how to load it."""
    models = certificate["models"]
    ks = [m["k"] for m in models]
    k, env = ks[min(1, len(ks) - 1)], certificate["environment"]
    library = f"k{k}/{certificate['kernel_library']}" if kernel else None
    register = (f'so.register_custom_ops_library("{library}")  # the kernel; without it the fallback function runs'
                if kernel else "# no kernel library was built: the models run on their fallback function")
    if kernel and certificate["export_options"].get("activations") == "int8":  # read when the library is registered
        register = (f'so.add_session_config_entry("{ort_kernel.ACTIVATIONS}", "int8")  # as deployed: integer dot products\n'
                    + register)
    s = certificate["settings"]
    lines = [
        f"# ∞-MoE deployment: {certificate['export']}, K = {', '.join(map(str, ks))}", "",
        f"Written by infmoe-export {certificate['tool_version']} on {certificate['created']} from "
        f"`{certificate['checkpoint']}` (SHA-256 of its config and weights {certificate['checkpoint_sha256'][:16]}…): "
        f"`{certificate['command']}`.", "",
        "| path | what |", "|---|---|",
        *(f"| `k{m['k']}/` | K = {m['k']}: `{MODEL_FILE}` and the clients' files (Optimum's layout"
          f"{', the kernel library' if kernel else ''}) |" for m in models),
        "| `certificate.json` | the parity certificate: every model against PyTorch and the float model |",
        "| `latency.json` | decode and prefill on the machine that deployed it |", "",
        "## Parity certificate: passed", "",
        *([f"The quantized ops take int8 activations (integer dot products): `{certificate['backend']}` is judged "
           "against the float model (level 2) and `ort`, the same kernels on float activations, against PyTorch "
           "(level 1). A client that registers the library without the session entry below runs them on float "
           "activations: the same logits within level 1, slower.", ""]
          if certificate["export_options"].get("activations") == "int8" else []),
        *(["The KV cache is float16 (`--kv-cache float16`): keys and values are stored rounded to float16, and "
           "the PyTorch reference rounds them alike.", ""]
          if certificate["export_options"].get("kv_cache") == "float16" else []),
        f"On {s['tokens']} tokens of {s['text']}, the `{certificate['backend']}` backend against PyTorch on the same "
        f"weights (level 1: atol {s['atol']:g} / rtol {s['rtol']:g} on clean tokens, at least "
        f"{pct(s['min_start_agreement'])} of window starts agreeing) and against the float model (level 2: "
        f"perplexity at most {signed_pct(s['max_perplexity_increase'])}, top-1 agreeing on at least "
        f"{pct(s['min_float_top1_agreement'])} of tokens).", "",
        "| K | starts agree | max \\|Δlogit\\| clean | perplexity | vs float | top-1 vs float |",
        "|---|---|---|---|---|---|",
        *(f"| {m['k']} | {pct(m['start_agreement'])} | {sci(m['max_abs_logit_error_clean'])} | {ppl(m['perplexity'])} "
          f"| {signed_pct(m['perplexity_increase'])} | {pct(m['float_top1_agreement'])} |" for m in models), ""]
    lines += [f"Refused first: {r['export']}: {'; '.join(r['why'])}." for r in certificate["refused"]]
    lines += ["", f"## Latency on the machine that deployed it ({env['cpu']}, {env['usable_cores']} cores)", "",
              "| K | decode step, ms [95% CI] | prefill tokens/s |", "|---|---|---|"]
    for k_ in ks:
        mine = {r["phase"]: r for r in latency["results"] if r["k"] == k_}
        decode, prefill = mine.get("decode"), mine.get("prefill")
        lines.append(f"| {k_} | {interval(decode['latency_ms']) if decode else '—'} | "
                     f"{sig(prefill['tokens_per_s']) if prefill else '—'} |")
    lines += [
        "", f"Batch 1; decode after {latency['settings']['decode_past']} tokens of cache. Rerun "
        f"`infmoe-export bench --model k{k}/{MODEL_FILE}` on the target machine.", "",
        "## Load it", "",
        f"Every folder is one model; the examples use `k{k}/`, from this folder. The models also output the "
        "routing diagnostics `expert_starts.{i}`, which clients ignore.", "",
        "**infmoe-export**:", "", "```bash", f'infmoe-export run --model k{k}/{MODEL_FILE} --prompt "def main("', "```", "",
        "**onnxruntime** (Python):", "", "```python", "import onnxruntime as ort", "so = ort.SessionOptions()", register,
        f'session = ort.InferenceSession("k{k}/{MODEL_FILE}", so)',
        "# inputs: input_ids, attention_mask, past_key_values.{i}.key / .value (the KV cache); outputs: logits, "
        "present.{i}.*", "```", "",
        "**Optimum** (transformers' `generate`):", "", "```python", "import onnxruntime as ort",
        "from optimum.onnxruntime import ORTModelForCausalLM", "from transformers import AutoTokenizer",
        "so = ort.SessionOptions()", register,
        f'model = ORTModelForCausalLM.from_pretrained("k{k}", session_options=so)',
        f'tokenizer = AutoTokenizer.from_pretrained("k{k}")',
        'ids = model.generate(**tokenizer("def main(", return_tensors="pt"), max_new_tokens=40)',
        "print(tokenizer.decode(ids[0]))", "```", "",
        "**onnxruntime-genai** (the kernel library is named in `genai_config.json`):" if kernel else
        "**onnxruntime-genai**:", "", "```python", "import onnxruntime_genai as og",
        f'model = og.Model("k{k}")', "params = og.GeneratorParams(model); params.set_search_options(max_length=64)",
        'generator = og.Generator(model, params); generator.append_tokens([list(b"def main(")])',
        "while not generator.is_done(): generator.generate_next_token()",
        'print(bytes(list(generator.get_sequence(0))).decode(errors="replace"))', "```", "",
        "**Triton Inference Server**: a model repository (one model per K and a decoding front model), served:", "",
        "```bash", f"infmoe-export triton-repo --checkpoint {certificate['checkpoint']} --k {','.join(map(str, ks))} "
        f"{export_flags(certificate['export_options'])} --out repo", "infmoe-export serve --repo repo", "```", ""]
    return "\n".join(lines)


# export_choice_options' --dtype help states the export default (fp32); deploy's default is a search.
next(p for p in deploy_command.params if p.name == "dtype").help = (
    "Weights: fp32, fp16 (the experts in float16), int8 / int4 (every matrix but the router, LayerNorms and "
    "biases). Default: the fastest of int4, int8, fp32 whose certificate passes at every K.")
