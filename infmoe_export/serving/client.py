"""Clients of the repository's models: FrontClient with tritonclient (HTTP or gRPC), and
StepClient, the load test's lean HTTP one, send one request per step of a sequence to the front
model (Triton's sequence_id / sequence_start / sequence_end); GenerateClient sends one request per
generation to the generate model over a gRPC stream, its tokens streamed back. The expert budget is
the request parameter `k`. Used by the tests, the load test and docs/guide/serving.md."""

import itertools
import json
import os
import queue
import socket
import threading
from typing import List, Optional, Sequence

import numpy as np

from ..errors import InfMoEError
from .config import FRONT_MODEL, GENERATE_MODEL

_ids = itertools.count(1)
_lock = threading.Lock()


def new_sequence_id() -> int:
    """Unique per process and across processes that share a server (pid in the high bits)."""
    with _lock:
        return ((os.getpid() & 0xFFFF) << 40) | next(_ids)


class ServingError(Exception):
    """The server answered with an error (status and message), or the request failed."""

    def __init__(self, message: str, status: Optional[str] = None):
        super().__init__(message)
        self.status = status


class FrontClient:
    """protocol "http" or "grpc"; timeout bounds every request (seconds)."""

    def __init__(self, url: str, protocol: str = "http", timeout: float = 30.0):
        self.protocol = protocol
        self.timeout = timeout
        try:
            if protocol == "http":
                import tritonclient.http as module

                self.client = module.InferenceServerClient(url, connection_timeout=timeout, network_timeout=timeout)
            elif protocol == "grpc":
                import tritonclient.grpc as module

                self.client = module.InferenceServerClient(url)
            else:
                raise InfMoEError(f"protocol must be http or grpc, got {protocol!r}")
        except ImportError:
            raise InfMoEError("the client needs tritonclient: pip install 'infmoe-export[serve]'") from None
        self.module = module

    def close(self):
        self.client.close()

    def step(self, sequence_id: int, ids: Sequence[int], *, start: bool = False, end: bool = False,
             k: Optional[int] = None, precision: Optional[str] = None, logits: bool = True):
        """One step: (next greedy token, logits of the last position, or None without `logits`:
        the server then neither copies nor sends the vocabulary's floats)."""
        array = np.asarray([list(ids)], dtype=np.int64)
        tensor = self.module.InferInput("INPUT_IDS", list(array.shape), "INT64")
        tensor.set_data_from_numpy(array)
        outputs = [self.module.InferRequestedOutput(name) for name in ("NEXT_TOKEN",) + (("LOGITS",) if logits else ())]
        parameters = {}
        if k is not None:
            parameters["k"] = k
        if precision is not None:
            parameters["precision"] = precision
        kwargs = {"client_timeout": self.timeout} if self.protocol == "grpc" else {}
        try:
            result = self.client.infer(FRONT_MODEL, [tensor], outputs=outputs, sequence_id=sequence_id,
                                       sequence_start=start, sequence_end=end, parameters=parameters or None, **kwargs)
            # a reply cut short (the model's process died while answering) has outputs missing or empty
            return int(result.as_numpy("NEXT_TOKEN").reshape(-1)[0]), result.as_numpy("LOGITS")[0] if logits else None
        except self.module.InferenceServerException as error:
            raise ServingError(error.message(), error.status()) from None
        except Exception as error:  # connection reset, timeout, a broken reply: the request failed, said so
            raise ServingError(f"{type(error).__name__}: {error}") from None

    def generate(self, prompt_ids: Sequence[int], k: int, max_new_tokens: int, *, precision: Optional[str] = None,
                 sequence_id: Optional[int] = None, on_token=None) -> List[int]:
        """Greedy tokens after the prompt, as `infmoe-export run` prints them; precision: the
        server's default when None."""
        sequence_id = sequence_id or new_sequence_id()
        tokens: List[int] = []
        ids = list(prompt_ids)
        for index in range(max_new_tokens):
            last = index == max_new_tokens - 1
            first = index == 0
            token, _ = self.step(sequence_id, ids, start=first, end=last, k=k if first else None,
                                 precision=precision if first else None, logits=False)
            tokens.append(token)
            if on_token is not None:
                on_token(token)
            ids = [token]
        return tokens


class StepClient:
    """The front model's step and nothing else over one keep-alive HTTP/1.1 connection, the request
    written by hand in Triton's binary tensor format and only NEXT_TOKEN asked for: about a third
    of tritonclient's CPU per request (docs/guide/serving.md, The load test), so that the load
    test's clients take less of the cores the server runs on. Same step() as FrontClient's, the
    logits always None."""

    def __init__(self, url: str, timeout: float = 30.0):
        host, _, port = url.rpartition(":")
        self.address, self.timeout = (host.strip("[]"), int(port)), timeout
        self.sock: Optional[socket.socket] = None
        self.pending = b""
        self.path = f"POST /v2/models/{FRONT_MODEL}/infer HTTP/1.1\r\nHost: {url}\r\n".encode()

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def step(self, sequence_id: int, ids: Sequence[int], *, start: bool = False, end: bool = False,
             k: Optional[int] = None, precision: Optional[str] = None, logits: bool = False):
        if logits:
            raise InfMoEError("StepClient answers NEXT_TOKEN only: use FrontClient for the logits")
        data = np.asarray(list(ids), dtype=np.int64).tobytes()
        parameters = {"sequence_id": sequence_id, "sequence_start": start, "sequence_end": end}
        parameters.update({name: value for name, value in (("k", k), ("precision", precision)) if value is not None})
        header = json.dumps({"inputs": [{"name": "INPUT_IDS", "shape": [1, len(data) // 8], "datatype": "INT64",
                                         "parameters": {"binary_data_size": len(data)}}],
                             "outputs": [{"name": "NEXT_TOKEN", "parameters": {"binary_data": True}}],
                             "parameters": parameters}).encode()
        request = self.path + (f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: "
                               f"{len(header)}\r\nContent-Length: {len(header) + len(data)}\r\n\r\n").encode()
        try:
            if self.sock is None:
                self.sock = socket.create_connection(self.address, timeout=self.timeout)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.sendall(request + header + data)
            status, headers, body = self._reply()
        except (OSError, ValueError, KeyError, IndexError) as error:  # refused, reset, timed out, a broken reply
            self.close()
            raise ServingError(f"{type(error).__name__}: {error}") from None
        if status != 200:
            try:
                message = json.loads(body)["error"]
            except (ValueError, KeyError, TypeError):
                message = body[:200].decode(errors="replace")
            raise ServingError(message, str(status))
        size = int(headers.get(b"inference-header-content-length", len(body)))
        if len(body) != size + 8:
            raise ServingError(f"the reply holds {len(body) - size} bytes of NEXT_TOKEN, not 8")
        return int(np.frombuffer(body, np.int64, 1, size)[0]), None

    def _reply(self):
        """(status, lower-case headers, body) of one HTTP reply with a Content-Length."""
        while b"\r\n\r\n" not in self.pending:
            self._receive()
        head, _, rest = self.pending.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = {name.strip().lower(): value.strip()
                   for name, _, value in (line.partition(b":") for line in lines[1:])}
        length = int(headers[b"content-length"])
        self.pending = rest
        while len(self.pending) < length:
            self._receive()
        body, self.pending = self.pending[:length], self.pending[length:]
        return status, headers, body

    def _receive(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ValueError("the server closed the connection")
        self.pending += chunk


class GenerateClient:
    """The generate model over one gRPC stream (tritonclient.grpc; url: the server's gRPC
    endpoint): generate() sends one request and returns its streamed tokens; one generation at a
    time per client. timeout bounds the wait for each token (seconds)."""

    def __init__(self, url: str, timeout: float = 30.0):
        try:
            import tritonclient.grpc as module
        except ImportError:
            raise InfMoEError("the client needs tritonclient: pip install 'infmoe-export[serve]'") from None
        self.module, self.timeout = module, timeout
        self.client = module.InferenceServerClient(url)
        self._start()

    def _start(self):
        """A new stream: replies of an earlier one (a generation given up on) never reach it."""
        replies: "queue.Queue" = queue.Queue()
        self.replies = replies
        self.client.start_stream(callback=lambda result, error: replies.put((result, error)))

    def close(self):
        self.client.stop_stream()
        self.client.close()

    def generate(self, prompt_ids: Sequence[int], k: int, max_new_tokens: int, *, precision: Optional[str] = None,
                 on_token=None) -> List[int]:
        """Greedy tokens after the prompt, as `infmoe-export run` prints them (fewer when the
        context fills up); on_token(token) as each arrives; precision: the server's default when None."""
        array = np.asarray(list(prompt_ids), dtype=np.int64)
        tensor = self.module.InferInput("INPUT_IDS", list(array.shape), "INT64")
        tensor.set_data_from_numpy(array)
        parameters = {"k": k, "max_tokens": max_new_tokens, **({"precision": precision} if precision else {})}
        tokens: List[int] = []
        request_id = str(new_sequence_id())
        try:
            self.client.async_stream_infer(GENERATE_MODEL, [tensor], request_id=request_id, parameters=parameters,
                                           enable_empty_final_response=True)
            while True:
                result, error = self.replies.get(timeout=self.timeout)
                if error is not None:
                    raise ServingError(error.message(), error.status())
                if result.get_response().id != request_id:
                    continue
                token = result.as_numpy("NEXT_TOKEN")
                if token is not None and token.size:
                    tokens.append(int(token.reshape(-1)[0]))
                    if on_token is not None:
                        on_token(tokens[-1])
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return tokens
        except queue.Empty:
            self.client.stop_stream()
            self._start()
            raise ServingError(f"no reply within {self.timeout:g} s") from None
        except self.module.InferenceServerException as error:
            raise ServingError(error.message(), error.status()) from None
