"""Sessions of a conventional MoE's export (export/moe.py), whose experts are onnxruntime's own
com.microsoft MoE / QMoE: the kind of activations its QMoE experts take, and the graph a runtime
without those ops runs (their fallback functions), for the ort-fallback backend. Kept apart from
export/ so that making a session does not import the exporter.
"""

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Optional

import onnx
from onnx import inliner

from ..contract import MS_DOMAIN, moe_op_types
from ..errors import InfMoEError

# Read by onnxruntime's QMoE when a session is made (its prepacking): "fp32" keeps float
# activations (int8 experts then take the dequantize path), "int8" gives int4 and int8 experts
# int8 activations whatever the node's accuracy_level.
QMOE_ACTIVATIONS_ENV = "ORT_QMOE_CPU_QNBIT_GEMM"


@contextlib.contextmanager
def qmoe_activations(activations: str):
    """While a session is made: onnxruntime's QMoE experts take float32 activations
    (activations "float", SPEC §6 level 1) or int8 ones ("int8", judged at level 2), as our
    kernels' infmoe.activations entry says for ours (runtimes/ort_kernel.py). onnxruntime reads
    the setting from the environment when it prepacks the weights, so it is set only around the
    session's creation."""
    previous = os.environ.get(QMOE_ACTIVATIONS_ENV)
    os.environ[QMOE_ACTIVATIONS_ENV] = "int8" if activations == "int8" else "fp32"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[QMOE_ACTIVATIONS_ENV]
        else:
            os.environ[QMOE_ACTIVATIONS_ENV] = previous


def fallback_copy(path: Path) -> Optional[Path]:
    """For a model with MoE / QMoE nodes: a sibling copy (so external data still resolves) with
    every local function inlined, the graph a runtime without onnxruntime's MoE ops runs (their
    fallback functions; an infmoe op's inlined too, as onnxruntime inlines it without our kernel).
    None for other models. The caller removes the copy."""
    model = onnx.load(str(path), load_external_data=False)
    if not moe_op_types(model.graph.node):
        return None
    if not {(f.domain, f.name) for f in model.functions} >= {(MS_DOMAIN, t) for t in moe_op_types(model.graph.node)}:
        raise InfMoEError(f"{path} has onnxruntime's MoE ops without their fallback functions (exported with "
                          "--no-function): it runs only where onnxruntime's own MoE kernels do")
    inlined = inliner.inline_local_functions(model)
    fd, copy = tempfile.mkstemp(prefix=f".{path.name}.fallback.", suffix=".onnx", dir=path.parent)
    os.close(fd)
    onnx.save(inlined, copy)
    return Path(copy)
