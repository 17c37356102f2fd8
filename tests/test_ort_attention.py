"""`infmoe::DecoderAttention` (the onnxruntime target's attention, docs/reference/ops/DecoderAttention.md)
against a float64 reference of its definition: the compiled kernel (decode and prefill paths, a
shared past/present buffer and separate ones, a float32 and a float16 cache), and the fallback
function (onnxruntime's GroupQueryAttention) that runs without it.

Data is fresh every run (the seed comes from os.urandom and is printed in every failure;
INFMOE_TEST_SEED=<n> replays a run).
"""

import os

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto

from infmoe_export.export.function import attention_model
from infmoe_export.export.ort_target import decoder_attention
from test_ort_kernel import relative_error
from conftest import with_attributes
from test_ort_qkernel import session

SEED = int(os.environ.get("INFMOE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
MASKED = np.finfo(np.float32).min


def make_feeds(rng, batch, sequence, past, heads, dim, shorter=0, bias_rows=None):
    """Random qkv, qkv_bias, cache and bias (about one key in ten masked, as left padding is); row
    b's cache holds past - (shorter if b is odd) positions (rows of different lengths)."""
    total = past + sequence
    lengths = [past - (shorter if b % 2 else 0) + sequence for b in range(batch)]
    bias = rng.standard_normal((bias_rows or batch, 1, sequence, total)) * 0.5
    bias[rng.random(bias.shape) < 0.1] = MASKED
    return {"qkv": rng.standard_normal((batch, sequence, 3 * heads * dim)).astype(np.float32),
            "past_key": rng.standard_normal((batch, heads, past, dim)).astype(np.float32),
            "past_value": rng.standard_normal((batch, heads, past, dim)).astype(np.float32),
            "seqlens_k": np.array(lengths, np.int32) - 1,
            "total_sequence_length": np.array([total], np.int32),
            "attention_bias": bias.astype(np.float32),
            "qkv_bias": rng.standard_normal(3 * heads * dim).astype(np.float32)}


def reference(feeds, heads):
    return decoder_attention(feeds["qkv"], feeds.get("past_key"), feeds.get("past_value"), feeds["seqlens_k"],
                             feeds["total_sequence_length"], feeds["attention_bias"], heads, feeds.get("qkv_bias"))


def model(heads, past=True, attributes=None, qkv_bias=True):
    return with_attributes(attention_model(heads, past=past, qkv_bias=qkv_bias), attributes).SerializeToString()


def half_feeds(feeds):
    """The feeds with the past in float16."""
    return {n: v.astype(np.float16) if n.startswith("past_") else v for n, v in feeds.items()}


def run_in_place(sess, feeds, buffers):
    """y of one run with the past and present of each of key and value bound to one buffer
    (SharedCache's binding): the new keys and values are written into buffers."""
    binding = sess.io_binding()
    binding.bind_output("y")  # get_outputs() lists y first
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    for name, buffer in zip(("key", "value"), buffers):
        value = ort.OrtValue.ortvalue_from_numpy(buffer)
        binding.bind_ortvalue_input(f"past_{name}", value)
        binding.bind_ortvalue_output(f"present_{name}", value)
    sess.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy()


def assert_matches(outputs, expected, tolerance=1e-5):
    y, key, value = outputs
    assert y.shape == expected[0].shape and key.shape == expected[1].shape
    assert relative_error(y, expected[0]) <= tolerance, f"seed {SEED}"
    assert np.array_equal(key, expected[1]) and np.array_equal(value, expected[2]), f"seed {SEED}"


# (batch, sequence, past, heads, head_dim, shorter): head_dim odd, below one register and not a
# multiple of one, or dividing one (1, 2, 4, 8: keys packed side by side at decode, with tails);
# up to 3 new tokens decode, more prefill (blocks of 64 queries: 70 and 150 cross them); no past,
# a long one, rows of different cache lengths (shorter: odd rows' past).
CASES = [
    (1, 1, 0, 3, 8, 0),
    (1, 1, 130, 12, 8, 0),
    (2, 2, 61, 3, 4, 9),
    (2, 1, 40, 2, 2, 5),
    (1, 3, 47, 2, 1, 0),
    (2, 1, 200, 5, 13, 7),
    (2, 3, 5, 2, 24, 2),
    (1, 2, 9, 1, 1, 0),
    (2, 70, 0, 3, 16, 0),
    (1, 150, 40, 2, 5, 0),
    (2, 65, 70, 1, 64, 30),
    (3, 1, 1023, 4, 64, 100),
]


@pytest.mark.parametrize("qkv_bias", [True, False])
@pytest.mark.parametrize("batch, sequence, past, heads, dim, shorter", CASES)
def test_attention_matches_the_reference(library, batch, sequence, past, heads, dim, shorter, qkv_bias):
    rng = np.random.default_rng([SEED, batch, sequence, past, dim])
    feeds = make_feeds(rng, batch, sequence, past, heads, dim, shorter)
    # the optional inputs absent: past (no past), qkv_bias (models exported before it)
    feeds = {n: v for n, v in feeds.items() if (past or not n.startswith("past")) and (qkv_bias or n != "qkv_bias")}
    assert_matches(session(model(heads, past=past > 0, qkv_bias=qkv_bias)).run(None, feeds), reference(feeds, heads))


@pytest.mark.parametrize("batch, sequence, past, heads, dim, shorter", CASES)
def test_attention_float16_cache_matches_the_reference(library, batch, sequence, past, heads, dim, shorter):
    """A float16 cache: its own kernel (chosen by the cache's type), the same computation in float32
    over the cache's values; present in float16, the new keys and values rounded to nearest even.
    The past is always given (of 0 positions in a first step): without it the cache's type is
    unknown and the float32 kernel runs."""
    rng = np.random.default_rng([SEED, 17, batch, sequence, past, dim])
    feeds = half_feeds(make_feeds(rng, batch, sequence, past, heads, dim, shorter))
    outputs = session(attention_model(heads, kv_cache="float16").SerializeToString()).run(None, feeds)
    assert outputs[0].dtype == np.float32 and outputs[1].dtype == outputs[2].dtype == np.float16
    assert_matches(outputs, reference(feeds, heads))


@pytest.mark.parametrize("sequence", [1, 100])
def test_attention_bias_broadcast_over_rows(library, sequence):
    feeds = make_feeds(np.random.default_rng([SEED, 9, sequence]), 3, sequence, 20, 2, 8, bias_rows=1)
    assert_matches(session(model(2)).run(None, feeds), reference(feeds, 2))


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("sequence, threads", [(1, 1), (1, 2), (80, 2)])
def test_attention_in_place_on_a_shared_buffer(library, sequence, threads, half):
    """past and present bound to one buffer of 100 positions (SharedCache's, genai's
    past_present_share_buffer), float32 or float16: the new keys and values are written into it,
    nothing else moves."""
    heads, dim, past = 3, 16, 100
    rng = np.random.default_rng([SEED, 11, sequence])
    feeds = make_feeds(rng, 2, sequence, past, heads, dim)
    if half:
        feeds = half_feeds(feeds)
    lengths = np.array([10, 17]) + sequence  # rows' caches: 10 and 17 positions, then the new tokens
    feeds["seqlens_k"] = (lengths - 1).astype(np.int32)
    feeds["total_sequence_length"] = np.array([lengths.max()], np.int32)
    feeds["attention_bias"] = feeds["attention_bias"][..., :lengths.max()].copy()
    expected = reference(feeds, heads)
    buffers = [feeds.pop("past_key"), feeds.pop("past_value")]
    before = [b.copy() for b in buffers]
    sess = session(attention_model(heads, kv_cache="float16").SerializeToString() if half else model(heads), threads)
    assert relative_error(run_in_place(sess, feeds, buffers), expected[0]) <= 1e-5, f"seed {SEED}"
    for b, length in enumerate(lengths):  # written: the new positions; everything else as it was
        for buffer, old, new in zip(buffers, before, expected[1:]):
            assert np.array_equal(buffer[b, :, :length], new[b, :, :length]), f"seed {SEED}"
            assert np.array_equal(buffer[b, :, length:], old[b, :, length:]), f"seed {SEED}"


@pytest.mark.parametrize("batch, sequence, past", [(1, 1, 130), (1, 70, 40), (2, 1, 0)])
@pytest.mark.parametrize("half", [False, True])
def test_attention_function_matches_the_reference(batch, sequence, past, half):
    """Without the kernel onnxruntime runs the function: its own GroupQueryAttention (which takes
    head_dim a multiple of 8 and, with a past, several new tokens for one row only); over a float16
    cache, with its casts (the past always given)."""
    feeds = make_feeds(np.random.default_rng([SEED, 13, sequence]), batch, sequence, past, 3, 16)
    if half:
        feeds = half_feeds(feeds)
    elif past == 0:
        feeds = {n: v for n, v in feeds.items() if not n.startswith("past")}
    proto = attention_model(3, with_function=True, past=half or past > 0, kv_cache="float16" if half else "float32")
    fallback = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    assert_matches(fallback.run(None, feeds), reference(feeds, 3))


@pytest.mark.parametrize("sequence, past, dim", [(1, 700, 32), (1, 700, 8), (3, 50, 32), (300, 20, 32)])
def test_attention_bitwise_identical_across_threads(library, sequence, past, dim):
    feeds = make_feeds(np.random.default_rng([SEED, 15, sequence]), 2, sequence, past, 6, dim, shorter=9)
    outputs = [session(model(6), threads).run(None, feeds) for threads in (1, 2, 4, 1)]
    for other in outputs[1:]:
        for a, b in zip(outputs[0], other):
            assert np.array_equal(a, b), f"seed {SEED}"


def _feeds():
    return make_feeds(np.random.default_rng([SEED, 17]), 2, 1, 6, 2, 8)


@pytest.mark.parametrize("attributes, message", [
    (dict(num_heads=None), "attribute 'num_heads'"),
    (dict(num_heads=0), "num_heads must be >= 1, got 0"),
])
def test_attention_bad_attributes_are_errors(library, attributes, message):
    with pytest.raises(Exception, match="DecoderAttention: .*" + message):
        session(model(2, attributes=attributes))


@pytest.mark.parametrize("change, message", [
    (lambda f: f.update(qkv=f["qkv"][..., :47].copy()),
     r"qkv \[2, 1, 47\] must be \[batch, sequence, 3 num_heads head_dim\] with num_heads = 2"),
    (lambda f: f.update(past_key=f["past_key"][:, :, :5].copy()), r"past_value \[2, 2, 6, 8\] must be past_key's shape"),
    (lambda f: f.update(past_key=f["past_key"][0]), r"past_key \[2, 6, 8\] must be \[batch, num_heads, past, head_dim\]"),
    (lambda f: f.update(past_key=f["past_key"][:, :1].copy()), r"past_key \[2, 1, 6, 8\] must be"),
    (lambda f: f.update(seqlens_k=f["seqlens_k"][:1].copy()), r"seqlens_k \[1\] must be \[batch\]"),
    (lambda f: f.update(seqlens_k=np.array([6, 7], np.int32)), r"seqlens_k\[1\] = 7 must be in \[0, 6\]"),
    (lambda f: f.update(seqlens_k=np.array([-1, 6], np.int32)), r"seqlens_k\[0\] = -1 must be in \[0, 6\]"),
    (lambda f: f.update(total_sequence_length=np.array([0], np.int32)),
     r"total_sequence_length must be in \[1, past \+ sequence\] = \[1, 7\], got 0"),
    (lambda f: f.update(total_sequence_length=np.array([2 ** 31 - 1], np.int32)),
     r"total_sequence_length must be in \[1, past \+ sequence\] = \[1, 7\], got 2147483647"),
    (lambda f: f.update(total_sequence_length=np.array([7, 7], np.int32)), r"total_sequence_length \[2\] must hold one"),
    (lambda f: f.update(attention_bias=f["attention_bias"][..., :6].copy()),
     r"attention_bias \[2, 1, 1, 6\] must be \[1 or batch, 1, sequence, total_sequence_length\] = \[1 or 2, 1, 1, 7\]"),
    (lambda f: f.update(qkv_bias=f["qkv_bias"][:47].copy()), r"qkv_bias \[47\] must be \[3 num_heads head_dim\] = \[48\]"),
])
def test_attention_bad_inputs_are_errors(library, change, message):
    feeds = _feeds()
    change(feeds)
    with pytest.raises(Exception, match="DecoderAttention: " + message):
        session(model(2)).run(None, feeds)


def test_attention_past_key_without_past_value_is_an_error(library):
    proto = attention_model(2)
    proto.graph.node[0].input[2] = ""
    del proto.graph.input[2]
    feeds = {n: v for n, v in _feeds().items() if n != "past_value"}
    with pytest.raises(Exception, match="DecoderAttention: past_key and past_value must be given both or neither"):
        session(proto.SerializeToString()).run(None, feeds)


@pytest.mark.parametrize("name, dtype, elem, message", [
    ("seqlens_k", np.int64, TensorProto.INT64, "DecoderAttention: seqlens_k must be int32, got int64"),
    ("attention_bias", np.int32, TensorProto.INT32, "DecoderAttention: attention_bias must be float32, got int32"),
    ("qkv_bias", np.float64, TensorProto.DOUBLE, "DecoderAttention: qkv_bias must be float32, got float64"),
    # the cache's type chooses the kernel: onnxruntime refuses a type that none takes, by name, and
    # a float16 value beside a float32 key
    ("past_key", np.float64, TensorProto.DOUBLE, r"tensor\(double\)' of input parameter \(past_key\)"),
    ("past_value", np.float16, TensorProto.FLOAT16, "no kernel def matches node inputs for Op: DecoderAttention"),
])
def test_attention_wrong_element_types_are_errors(library, name, dtype, elem, message):
    feeds = _feeds()
    feeds[name] = np.ones(feeds[name].shape, dtype)  # the type is refused before any value is read
    proto = attention_model(2)
    next(v for v in proto.graph.input if v.name == name).type.tensor_type.elem_type = elem
    with pytest.raises(Exception, match=message):
        session(proto.SerializeToString()).run(None, feeds)
