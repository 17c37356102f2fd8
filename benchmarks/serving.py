"""Serving against the session it serves: what `infmoe-export serve` adds to a decode step.

    .venv/bin/python -m benchmarks.serving [--rounds 5] [--tokens 48] [--threads 2] [--repo REPO]
                                           [--json benchmarks/results/serving.json]

The GPT-2-Small-size ∞-MoE (shapes.SMALL, random weights) at all-int4, K = 2, the onnxruntime
target, in a repository of `triton-repo` (serving.repository.build_repository, the preferred
batch sizes measured as it does; or --repo, one written before) served by the local Triton
(`serve`'s TritonServer) on loopback. Measured side by side, each round the stream counts in a
shuffled order:

- the load test (serving.load.run_load) at 1, 4 and 16 concurrent streams, one sequence of
  --tokens greedy tokens each after a short prompt (the past runs from about 10 to 10 + --tokens):
  tokens/s over the whole run, steady tokens/s (while every stream decodes: after the last
  stream's first token, the prompts' prefill, and before the first stream's last), and p50 / p95
  ms per token at the client; and from Triton's metrics, per request, the ms it spent in the
  server, queued there and in the front model's execute (the rest of p50 is the client and
  loopback HTTP);
- the same load test in mode generate at 1 and 16 streams: one request per sequence to the
  generate model over gRPC, its tokens streamed back (ms per token: between a stream's tokens);
- just before and just after the load at 1 and at 16 streams, the plain session (onnxruntime +
  kernel, --threads, the repository's kernel library) decoding as many sequences on a shared
  cache, each its own text, --tokens tokens after a prompt of --past (as the streams do): the
  median ms of --steps steps; the round's baseline is the mean of the two, so that a machine
  whose load drifts moves both sides alike.

- one stream paired with the session: each of --tokens tokens served right after one session
  step of a sequence at about the same past; the medians of the served token, of the step and of
  their differences. Token by token, a load that drifts falls on both alike.

- the front model's own work: its pool and runner (serving/tritonserver_model.py) in this process,
  without Triton, each of --tokens tokens served right after a step of the same session on a
  cache of its own; the median difference is what the front model's Python adds to a token, and
  the paired difference above less it is Triton's own (its HTTP endpoint and the Python
  backend's hand-over of each request to the model's process).

Then the goals, each the median over rounds of the round's own figure (a round's figures are
measured within a minute of each other; rounds on a shared machine may be far apart): at 1
stream, a served token minus the session's batch-1 step, paired token by token (goal <= 1.5 ms;
the load test's p50 minus the session's step around it is printed too); at 16 streams, steady
tokens/s over the session's B = 16 decode tokens/s (goal >= 0.8; both decode only); and the same
two for the generate model (at 1 stream its p50 ms per token minus the session's step around the
load). The server's onnxruntime runs with the same threads (INFMOE_SERVE_THREADS).
"""

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import arguments, record

STREAMS = (1, 4, 16)
GENERATE_STREAMS = (1, 16)
SESSION_BATCHES = (1, 16)
K, PRECISION = 2, "int4"
GOALS = {"1 stream, per token: served - session batch-1 step, ms (paired)": ("at most", 1.5),
         "steady tokens/s at 16 streams / session B=16 tokens/s": ("at least", 0.8),
         "generate model, 1 stream: p50 ms/token - session batch-1 step, ms": ("at most", 1.5),
         "generate model, steady tokens/s at 16 streams / session B=16 tokens/s": ("at least", 0.8)}
# Per mode of the load test: (the round's key of its load rows, of the session's steps around them).
MODE_KEYS = {"step": ("server", "session_ms"), "generate": ("generate", "generate_session_ms")}


def build(scratch: Path, log) -> Path:
    """The repository of the Small model at all-int4, K = 2 (export, validation, batch curve)."""
    import torch

    from infmoe_export.model import InfMoEGPT
    from infmoe_export.options import export_choices
    from infmoe_export.serving.repository import build_repository

    from .shapes import SMALL

    torch.manual_seed(0)
    model = InfMoEGPT(SMALL).eval()
    repo = scratch / "repository"
    build_repository(model, repo, [K], export_choices(model.config, [PRECISION]), progress=log)
    return repo


def session_steps(repo: Path, past: int, span: int, threads: int) -> dict:
    """{B: the next decode step of B sequences} on the served model's own file, with the kernel
    library the server loads (the repository's copy, not whatever is installed now): each
    sequence a stretch of text of its own, a prompt of `past` tokens then `span` tokens decoded
    one at a time, again and again (the cache set back to the prompt), as a generation reads
    them: new tokens and windows every step, the past from `past` to `past + span`."""
    from infmoe_export.contract import ExportedModel
    from infmoe_export.report.bench import text_tokens
    from infmoe_export.runtimes import ort_kernel
    from infmoe_export.runtimes.ort import SharedCache, create_session
    from infmoe_export.serving.repository import LIBRARY, read_repository

    route = read_repository(repo)["routes"][f"{K}/{PRECISION}"]
    exported = ExportedModel.read(repo / route["onnx"])
    os.environ[ort_kernel.ENV_VAR] = str(repo / route["triton"] / LIBRARY)
    # Its threads sleep when a step returns, as the server's do: the paired measurement serves a
    # token right after each step, which spinning threads would slow.
    session = create_session(exported, providers=["CPUExecutionProvider"], intra_op_threads=threads,
                             stop_spinning=True)
    length = past + span
    text = text_tokens(length * max(SESSION_BATCHES))
    steps = {}
    for batch in SESSION_BATCHES:
        ids = text[:length * batch].reshape(batch, length)
        cache = SharedCache(session, exported.io, batch)
        cache.step(ids[:, :past])

        def step(cache=cache, ids=ids):
            if cache.length == length:
                cache.length = past
            cache.step(ids[:, cache.length:cache.length + 1])
        steps[batch] = step
    return steps


def front_model_steps(repo: Path, threads: int, route_key: str = f"{K}/{PRECISION}"):
    """A step of the front model's own work without Triton, and the same session's step: its Pool
    and SharedRunner (serving/tritonserver_model.py, as the server runs them) serving one greedy
    sequence, and a SharedCache of one sequence on the same session (so the two differ in the front
    model's Python alone). Returns (restart(), served(), alone()): a new sequence on both sides
    after the same prompt; one token of each, on the last served token, giving the greedy next."""
    from infmoe_export.contract import ExportedModel
    from infmoe_export.runtimes.ort import SharedCache
    from infmoe_export.serving.load import PROMPTS
    from infmoe_export.serving.repository import read_repository
    from infmoe_export.serving.tritonserver_model import BYTE_VOCAB, Pool, Sequence, SharedRunner, Step, local_session

    route = read_repository(repo)["routes"][route_key]
    exported = ExportedModel.read(repo / route["onnx"])
    session = local_session(str(repo / route["onnx"]), threads, route.get("activations", "float"))
    io, config = exported.io, exported.io.config
    runner = SharedRunner(session, io.past_names)
    runner.pool = Pool(runner, io.past_names, 1, config.n_head, config.n_positions, config.head_dim,
                       config.vocab_size, cache_dtype=io.cache_dtype)
    prompt = np.frombuffer(PROMPTS[0], np.uint8).astype(np.int64)
    state = {"sequence": None, "cache": None, "token": None}

    def restart():
        if state["sequence"] is not None:
            runner.pool.release(state["sequence"])
        state["sequence"] = sequence = Sequence(route_key)
        first = Step(0, 1, sequence, prompt, False, False)
        runner.pool.serve([first])
        state["cache"] = SharedCache(session, io)
        state["cache"].step(prompt[None])
        state["token"] = first.token

    def served():
        step = Step(0, 1, state["sequence"], np.array([state["token"]], np.int64), False, False)
        runner.pool.serve([step])
        state["token"] = step.token
        return step.token

    def alone():
        logits = state["cache"].step(np.array([[state["token"]]], np.int64))["logits"]
        return int(np.argmax(logits[0, -1, :BYTE_VOCAB]))

    restart()
    return restart, served, alone


def side_by_side(alone, served, tokens: int, skip: int = 0) -> dict:
    """For each of `tokens` tokens, alone(index) and right after it served(index): the medians, ms,
    of each and of their differences (the first `skip` tokens left out). Token by token, a load
    that drifts falls on both alike."""
    from infmoe_export.report.timing import settle

    settle()
    times = []
    for index in range(tokens):
        began = time.perf_counter()
        alone(index)
        middle = time.perf_counter()
        served(index)
        times.append(((time.perf_counter() - middle) * 1e3, (middle - began) * 1e3))
    times = times[skip:]
    return {"served_ms": statistics.median(t[0] for t in times), "session_ms": statistics.median(t[1] for t in times),
            "overhead_ms": statistics.median(t[0] - t[1] for t in times)}


SERVER_TIMES = ("request_duration", "queue_duration", "compute_input_duration", "compute_infer_duration",
                "compute_output_duration")


def server_counters(metrics_url: str) -> dict:
    """The front model's cumulative counters from Triton's metrics: requests, executions, and
    microseconds per part of a request's time in the server."""
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition('{model="infmoe",version="1"} ')
        if value and name.startswith("nv_inference_"):
            found[name[len("nv_inference_"):]] = float(value)
    return found


def server_share(before: dict, after: dict) -> dict:
    """Per request between two readings: ms in the server (and in its queue, in the front model's
    execute, moving inputs and outputs), and requests per execution."""
    requests = after["request_success"] - before["request_success"]
    shares = {f"{key.replace('_duration', '')}_ms": round((after[f"{key}_us"] - before[f"{key}_us"]) / requests / 1e3,
                                                          3) for key in SERVER_TIMES}
    executions = after["exec_count"] - before["exec_count"]
    return {**shares, "requests_per_execution": round((after["count"] - before["count"]) / executions, 2)}


def goals(rounds: list) -> list:
    """Each goal's median over rounds of the round's own figure (the generate model's where the
    rounds measured it)."""
    figures = [[r["paired"]["overhead_ms"] for r in rounds],
               [r["server"]["16"]["steady_tokens_per_s"] / (16e3 / r["session_ms"]["16"]) for r in rounds]]
    if all("generate" in r for r in rounds):
        figures += [[r["generate"]["1"]["p50_ms"] - r["generate_session_ms"]["1"] for r in rounds],
                    [r["generate"]["16"]["steady_tokens_per_s"] / (16e3 / r["generate_session_ms"]["16"])
                     for r in rounds]]
    values = {what: statistics.median(figure) for what, figure in zip(GOALS, figures)}
    return [{"what": what, "value": round(values[what], 3), "goal": f"{word} {bound}",
             "met": values[what] <= bound if word == "at most" else values[what] >= bound}
            for what, (word, bound) in GOALS.items() if what in values]


def summary(rounds: list) -> dict:
    """Medians over rounds: the session's ms per step, the server's figures per stream count."""
    batches, streams = (sorted(rounds[0][key], key=int) for key in ("session_ms", "server"))
    session = {b: statistics.median(r["session_ms"][b] for r in rounds) for b in batches}
    server = {s: {key: statistics.median(r["server"][s][key] for r in rounds)
                  for key in ("tokens_per_s", "steady_tokens_per_s", "p50_ms", "p95_ms")} for s in streams}
    in_server = {s: {key: statistics.median(r["server"][s]["in_server"][key] for r in rounds)
                     for key in rounds[0]["server"][s]["in_server"]} for s in streams}
    paired = {key: statistics.median(r["paired"][key] for r in rounds) for key in rounds[0]["paired"]}
    front = {key: statistics.median(r["front_model"][key] for r in rounds) for key in rounds[0]["front_model"]}
    generate = {s: {key: statistics.median(r["generate"][s][key] for r in rounds)
                    for key in ("tokens_per_s", "steady_tokens_per_s", "p50_ms", "p95_ms")}
                for s in rounds[0].get("generate", {})}
    return {"front_model": front, "session_ms": session, **({"generate": generate} if generate else {}),
            "session_tokens_per_s": {b: int(b) * 1e3 / ms for b, ms in session.items()},
            "server": server, "in_server": in_server, "paired": paired,
            "load_test_p50_minus_session_ms": statistics.median(r["server"]["1"]["p50_ms"] - r["session_ms"]["1"]
                                                                for r in rounds)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--rounds", type=arguments.count(1, 100), default=5, help="interleaved rounds")
    parser.add_argument("--tokens", type=arguments.count(2, 512), default=48, help="greedy tokens per stream")
    parser.add_argument("--past", type=arguments.count(1, 512), default=10,
                        help="the session's prompt, as long as the load test's (it then decodes --tokens)")
    parser.add_argument("--steps", type=arguments.count(1, 1000), default=8, help="session steps per sample")
    parser.add_argument("--threads", type=arguments.thread_count, default=2, help="onnxruntime threads, both sides")
    parser.add_argument("--repo", type=Path, default=None,
                        help="a repository of `triton-repo` holding K=2 all-int4 (default: built now)")
    parser.add_argument("--json", type=Path, default=record.default_path("serving"), help="where to write the results")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from infmoe_export.report.timing import median_ms, settle
    from infmoe_export.runtimes.ort_kernel import custom_op_library
    from infmoe_export.serving.client import FrontClient, new_sequence_id
    from infmoe_export.serving.load import PROMPTS, run_load
    from infmoe_export.serving.repository import read_repository
    from infmoe_export.serving.server import TritonServer

    if custom_op_library() is None:
        sys.exit("benchmarks.serving: the compiled kernel is not installed (docs/guide/onnxruntime.md)")
    sys.stdout.reconfigure(line_buffering=True)

    def log(what):
        print(f"[serving] {what}")

    os.environ["INFMOE_SERVE_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="serving-") as scratch:
        repo = args.repo or build(Path(scratch), log)
        batching = read_repository(repo).get("batching")
        steps = session_steps(repo, args.past, args.tokens, args.threads)

        def session(batch):
            settle()
            return median_ms(steps[batch], args.steps)

        def load(streams, mode):
            settle()
            before = server_counters(server.metrics_url)
            row = run_load(server.http_url if mode == "step" else server.grpc_url, streams, [K], sequences_per_stream=1,
                           tokens=args.tokens, precision=PRECISION, deadline_s=600, mode=mode)
            if row["failures"]:
                sys.exit(f"benchmarks.serving: the load test had failures: {row['failures'][0]}")
            if mode != "step":  # Triton's metrics count requests: one per generation here
                return row
            return {**row, "in_server": server_share(before, server_counters(server.metrics_url))}

        def paired():
            """One stream whose every token is served right after a session step of one sequence
            at about the same past (the prompt's first token left out)."""
            client = FrontClient(server.http_url)
            state = {"sequence": new_sequence_id(), "ids": list(PROMPTS[0])}

            def served(index):
                first, last = index == 0, index == args.tokens - 1
                token, _ = client.step(state["sequence"], state["ids"], start=first, end=last,
                                       k=K if first else None, precision=PRECISION if first else None, logits=False)
                state["ids"] = [token]
            try:
                return side_by_side(lambda index: steps[1](), served, args.tokens, skip=1)
            finally:
                client.close()

        restart, front_served, front_alone = front_model_steps(repo, args.threads)

        def front_model():
            """The front model's own work, in this process: each token served by its pool right
            after a step of the same session."""
            restart()
            return side_by_side(lambda index: front_alone(), lambda index: front_served(), args.tokens)

        # What times a served token right after a session step: name in a round's order -> (key in
        # the round's results, the measurement).
        pairings = {"1 stream paired with the session": ("paired", paired),
                    "the front model in this process, no Triton": ("front_model", front_model)}
        rounds = []
        with TritonServer(repo) as server:
            run_load(server.http_url, 1, [K], sequences_per_stream=1, tokens=4, precision=PRECISION)  # warm up
            run_load(server.grpc_url, 1, [K], sequences_per_stream=1, tokens=4, precision=PRECISION, mode="generate")
            order = [("step", s) for s in STREAMS] + [("generate", s) for s in GENERATE_STREAMS] + list(pairings)
            for number in range(args.rounds):
                random.Random(number).shuffle(order)
                found = {"session_ms": {}, "session_bracket_ms": {}, "server": {}, "generate": {},
                         "generate_session_ms": {}}
                for entry in order:
                    if entry in pairings:
                        key, measure = pairings[entry]
                        found[key] = pair = measure()
                        log(f"round {number + 1}: {entry}: served {pair['served_ms']:.2f}, session "
                            f"{pair['session_ms']:.2f}, difference {pair['overhead_ms']:.2f} ms")
                        continue
                    mode, streams = entry
                    rows_key, session_key = MODE_KEYS[mode]
                    # the session's step of as many sequences just before and just after the load, against drift
                    batch = streams if streams in SESSION_BATCHES else None
                    first = session(batch) if batch else None
                    found[rows_key][str(streams)] = row = load(streams, mode)
                    if batch:
                        bracket = [first, session(batch)]
                        if mode == "step":
                            found["session_bracket_ms"][str(batch)] = bracket
                        found[session_key][str(batch)] = statistics.mean(bracket)
                    log(f"round {number + 1}: {mode}, {streams} streams: {row['tokens_per_s']} tokens/s (steady "
                        f"{row['steady_tokens_per_s']}), p50 {row['p50_ms']} ms"
                        + (f"; session B={batch}: {bracket[0]:.2f}, {bracket[1]:.2f} ms" if batch else ""))
                found["load_average"] = list(os.getloadavg())
                rounds.append(found)
    result = {"model": f"GPT-2-Small-size ∞-MoE, onnxruntime all-int4, K = {K}", "options": {**vars(args),
              "json": str(args.json), "repo": str(args.repo) if args.repo else None},
              "batching": batching, "rounds": rounds, "median": summary(rounds), "goals": goals(rounds)}
    print_result(result)
    print(f"results: {record.save(args.json, 'serving', result, args.threads)}")


def print_result(result: dict) -> None:
    median = result["median"]
    print(f"session: batch-1 step {median['session_ms']['1']:.2f} ms, B=16 step {median['session_ms']['16']:.2f} ms "
          f"({median['session_tokens_per_s']['16']:.1f} tokens/s)")
    print("| protocol | streams | tokens/s | steady tokens/s | p50 ms/token | p95 ms/token |")
    print("|---|---|---|---|---|---|")
    for mode, key in (("a request per token (front model)", "server"),
                      ("a request per sequence (generate model)", "generate")):
        for streams, row in median.get(key, {}).items():
            print(f"| {mode} | {streams} | {row['tokens_per_s']:.1f} | {row['steady_tokens_per_s']:.1f} | "
                  f"{row['p50_ms']:.2f} | {row['p95_ms']:.2f} |")
    print("per request in the server (Triton's metrics), ms: | streams | in the server | queued | execute "
          "| requests per execute |")
    for streams, row in median["in_server"].items():
        print(f"| {streams} | {row['request_ms']:.2f} | {row['queue_ms']:.2f} | {row['compute_infer_ms']:.2f} | "
              f"{row['requests_per_execution']:.2f} |")
    paired = median["paired"]
    print(f"1 stream, each token right after a session step: served {paired['served_ms']:.2f} ms, session "
          f"{paired['session_ms']:.2f} ms, difference {paired['overhead_ms']:.2f} ms (the load test's p50 minus the "
          f"session's step around it: {median['load_test_p50_minus_session_ms']:.2f} ms)")
    front = median["front_model"]
    print(f"the front model's own work, in this process without Triton: {front['overhead_ms']:.2f} ms a token over "
          f"the session's step ({front['served_ms']:.2f} against {front['session_ms']:.2f} ms); the rest of the "
          f"difference above is Triton's: its HTTP endpoint and the Python backend's hand-over to the model")
    for goal in result["goals"]:
        print(f"{goal['what']}: {goal['value']} (goal {goal['goal']}: {'met' if goal['met'] else 'missed'})")


if __name__ == "__main__":
    main()
