"""A client of the front model with tritonclient (HTTP or gRPC): one request per step of a
sequence (Triton's sequence_id / sequence_start / sequence_end), the expert budget as the
request parameter `k`. Used by the tests, the load test and docs/guide/serving.md."""

import itertools
import os
import threading
from typing import List, Optional, Sequence

import numpy as np

from ..errors import InfMoEError
from .config import FRONT_MODEL

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
        except self.module.InferenceServerException as error:
            raise ServingError(error.message(), error.status()) from None
        except Exception as error:  # connection reset, timeout: the request failed, said so
            raise ServingError(f"{type(error).__name__}: {error}") from None
        return int(result.as_numpy("NEXT_TOKEN").reshape(-1)[0]), result.as_numpy("LOGITS")[0] if logits else None

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
