"""A load test of the local server: N concurrent streams, each generating sequences of
greedy tokens with K chosen per sequence in turn, bounded in sequences and time, stopping by
itself. Every request is counted as completed or failed (with its message); none is dropped.
Mode "step" sends a request per token to the front model (HTTP, or gRPC); mode "generate" one
request per sequence to the generate model, its tokens streamed back (gRPC: --url is the
server's gRPC endpoint).

    python -m infmoe_export.serving.load --url 127.0.0.1:8000 --streams 1,4,16 --k 1,2,4,8
    python -m infmoe_export.serving.load --url 127.0.0.1:8001 --mode generate --streams 1,4,16

Loopback only: the URL's host must be a loopback address."""

import argparse
import ipaddress
import json
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..errors import InfMoEError
from .client import FrontClient, GenerateClient, ServingError, StepClient, new_sequence_id

PROMPTS = [b"import os", b"def main(", b"class A:", b"return self.", b"for i in range(", b"# The "]
PERCENTILES = (50, 95, 99)  # of the ms per token at the client: a step's wall time, or a token's since the last
MODES = ("step", "generate")


def check_loopback(url: str) -> None:
    host = url.rsplit(":", 1)[0].strip("[]")
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        raise InfMoEError(f"cannot resolve {host!r}") from None
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise InfMoEError(f"the load test only targets a local server (loopback), not {host}")


def run_load(url: str, streams: int, ks: Sequence[int], *, sequences_per_stream: int = 4, tokens: int = 24,
             deadline_s: float = 120.0, protocol: str = "http", timeout: float = 30.0,
             precision: Optional[str] = None, during=None, mode: str = "step") -> Dict:
    """One load level, every sequence at precision (default: the server's). The streams' clients
    (mode step: StepClient over HTTP, FrontClient over gRPC; mode generate: GenerateClient, url
    the gRPC endpoint) are made first, then all start together.
    `during(stop_event)` runs in its own thread while the load runs (the fault test kills a
    process there). Returns the figures and every failure:
    tokens_per_s over the whole run (prompts included), steady_tokens_per_s while every stream
    is past its first token and none has finished (None when that never holds), and percentiles
    of the ms per token."""
    check_loopback(url)
    if mode not in MODES:
        raise InfMoEError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    latencies: List[float] = []
    done_at: List[List[float]] = [[] for _ in range(streams)]  # each stream's completion times
    failures: List[str] = []
    sent, completed = [0], [0]
    lock = threading.Lock()
    stop = threading.Event()
    clients = [GenerateClient(url, timeout) if mode == "generate" else
               StepClient(url, timeout) if protocol == "http" else FrontClient(url, protocol, timeout)
               for _ in range(streams)]
    together = threading.Barrier(streams + 1)

    def generate(index: int, client, k: int, ids: List[int]):
        last = [time.perf_counter()]

        def arrived(_token):
            now = time.perf_counter()
            with lock:
                latencies.append(now - last[0])
                done_at[index].append(now)
            last[0] = now

        with lock:
            sent[0] += 1
        try:
            client.generate(ids, k, tokens, precision=precision, on_token=arrived)
        except ServingError as error:
            with lock:
                failures.append(str(error)[:200])
            return
        with lock:
            completed[0] += 1

    def stream(index: int):
        client = clients[index]
        together.wait()
        for n in range(sequences_per_stream):
            if time.monotonic() > deadline:
                return
            k = ks[(index + n) % len(ks)]
            sequence_id, ids = new_sequence_id(), list(PROMPTS[(index + n) % len(PROMPTS)])
            if mode == "generate":
                generate(index, client, k, ids)
                continue
            for step in range(tokens):
                began = time.perf_counter()
                with lock:
                    sent[0] += 1
                try:
                    first = step == 0
                    token, _ = client.step(sequence_id, ids, start=first, end=step == tokens - 1,
                                           k=k if first else None, precision=precision if first else None,
                                           logits=False)
                except ServingError as error:
                    with lock:
                        failures.append(str(error)[:200])
                    break  # the sequence is lost (its cache or the request); the next one starts anew
                now = time.perf_counter()
                with lock:
                    latencies.append(now - began)
                    done_at[index].append(now)
                    completed[0] += 1
                ids = [token]

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
    helper = threading.Thread(target=during, args=(stop,), daemon=True) if during else None
    deadline = time.monotonic() + deadline_s
    try:
        for thread in threads:
            thread.start()
        together.wait()
        began = time.perf_counter()
        if helper:
            helper.start()
        for thread in threads:
            thread.join(deadline_s + timeout + 5)
        elapsed = time.perf_counter() - began
    finally:
        stop.set()
        for client in clients:
            client.close()
    if helper:
        helper.join(timeout)
    hung = sum(thread.is_alive() for thread in threads)
    received = sum(len(times) for times in done_at)
    lat = np.array(latencies) * 1000 if latencies else np.array([np.nan])
    return {"streams": streams, "mode": mode, "ks": list(ks), "precision": precision, "requests": sent[0],
            "completed": completed[0], "failed": len(failures), "tokens": received, "hung_streams": hung,
            "seconds": round(elapsed, 3),
            "tokens_per_s": round(received / elapsed, 2), "steady_tokens_per_s": steady_rate(done_at),
            **{f"p{q}_ms": round(float(np.percentile(lat, q)), 2) for q in PERCENTILES}, "failures": failures[:10]}


def steady_rate(done_at: Sequence[Sequence[float]]) -> Optional[float]:
    """Tokens per second between the moment every stream has its first token and the moment the
    first stream has its last: every stream decoding, no ramp at either end. None when that
    window is empty (a stream with one token or none, or streams that never overlapped)."""
    if not done_at or any(len(times) < 2 for times in done_at):
        return None
    start, end = max(times[0] for times in done_at), min(times[-1] for times in done_at)
    if end <= start:
        return None
    count = sum(start < t <= end for times in done_at for t in times)
    return round(count / (end - start), 2)


def main(argv: Optional[Sequence[str]] = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="HOST:PORT of the server's HTTP (or gRPC) endpoint")
    parser.add_argument("--protocol", default="http", choices=["http", "grpc"], help="mode step's protocol")
    parser.add_argument("--mode", default="step", choices=MODES,
                        help="step: a request per token (front model); generate: a request per sequence, its "
                             "tokens streamed (generate model, gRPC)")
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--k", default="1,2,4,8")
    parser.add_argument("--precision", default=None, help="the request parameter precision (default: the server's)")
    parser.add_argument("--sequences", type=int, default=4, help="sequences per stream")
    parser.add_argument("--tokens", type=int, default=24, help="tokens per sequence")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds per level at most")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.k.split(",")]
    rows = [run_load(args.url, int(s), ks, sequences_per_stream=args.sequences, tokens=args.tokens,
                     deadline_s=args.deadline, protocol=args.protocol, precision=args.precision, mode=args.mode)
            for s in args.streams.split(",")]
    print("| streams | requests | completed | failed | tokens/s | steady tokens/s | p50 ms/token | p95 ms/token "
          "| p99 ms/token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['streams']} | {r['requests']} | {r['completed']} | {r['failed']} | {r['tokens_per_s']} | "
              f"{r['steady_tokens_per_s']} | {r['p50_ms']} | {r['p95_ms']} | {r['p99_ms']} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
