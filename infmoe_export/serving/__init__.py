"""Serving on NVIDIA Triton Inference Server: the model repository (`triton-repo`), the Python
backend front model that keeps each sequence's KV cache, the local server (`serve`) on the
tritonserver binary that nvidia-pytriton ships, a client and a load test (docs/guide/serving.md).

Layer: above report/ and below commands/ (tests/test_import_graph.py). tritonclient and
nvidia-pytriton are the optional extra `serve`; nothing here imports them at module level."""
