"""Tiny ONNX models built with onnx.helper for the tests (nothing is downloaded).

onnx 1.23 stamps IR 14 / opset 28 by default, which onnxruntime 1.31 rejects, so every
model sets its IR version and opset explicitly.
"""
from __future__ import annotations

from typing import Union

import numpy as np

IR_VERSION = 10
OPSET = 17

Dim = Union[int, str, None]


def _model(graph):
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model.SerializeToString()


def linear_model(in_dim: int = 4, out_dim: int = 3, batch: Dim = "N", seed: int = 0) -> bytes:
    """y = relu(x @ W + b), plus s = sum(x, axis=1) as a second output; x float32 [batch, in_dim]."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((in_dim, out_dim)).astype(np.float32)
    b = rng.standard_normal(out_dim).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["pre"]),
        helper.make_node("Relu", ["pre"], ["y"]),
        helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, in_dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, out_dim]),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, [batch])],
        initializer=[numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b"),
                     numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")])
    return _model(graph)


def two_input_model(dim: int = 4) -> bytes:
    """out = a * 2 + cast(k, float); a float32 [N, dim], k int64 [N, 1]."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("Mul", ["a", "two"], ["a2"]),
        helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["a2", "kf"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes, "two_inputs",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", dim]),
         helper.make_tensor_value_info("k", TensorProto.INT64, ["N", 1])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", dim])],
        initializer=[numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")])
    return _model(graph)


def shapes_model(dim: int = 4) -> bytes:
    """Outputs of several ranks and dtypes from x float32 [N, dim] (dim even): grid float32
    [N, 2, dim // 2] (x * 2, reshaped), label int64 [N] (argmax of x), half float16 [N, dim] (x)."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("Mul", ["x", "two"], ["x2"]),
        helper.make_node("Reshape", ["x2", "grid_shape"], ["grid"]),
        helper.make_node("ArgMax", ["x"], ["label"], axis=1, keepdims=0),
        helper.make_node("Cast", ["x"], ["half"], to=TensorProto.FLOAT16),
    ]
    graph = helper.make_graph(
        nodes, "shapes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", dim])],
        [helper.make_tensor_value_info("grid", TensorProto.FLOAT, ["N", 2, dim // 2]),
         helper.make_tensor_value_info("label", TensorProto.INT64, ["N"]),
         helper.make_tensor_value_info("half", TensorProto.FLOAT16, ["N", dim])],
        initializer=[numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two"),
                     numpy_helper.from_array(np.array([-1, 2, dim // 2], dtype=np.int64), "grid_shape")])
    return _model(graph)


def session(model: bytes, threads: int = 1):
    """An InferenceSession on the CPU with one intra-op thread (on 2 cores, spinning pool
    threads starve the Python fetchers)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def logistic_train_step(dim: int, lr: float = 0.5, momentum: float = 0.9) -> bytes:
    """One SGD-with-momentum step of logistic regression, as an ordinary ONNX graph.

    Inputs: x float32 [N, dim], y float32 [N] (0/1), and the state W [dim], b [], vW [dim], vb [].
    Outputs: loss [] (mean log-loss before the step), W_new, b_new, vW_new, vb_new.
    Gradients are written by hand: dz = sigmoid(z) - y; gW = mean(x * dz); gb = mean(dz);
    v <- momentum * v + g; w <- w - lr * v.
    """
    from onnx import TensorProto, helper, numpy_helper

    f = TensorProto.FLOAT
    consts = [numpy_helper.from_array(np.array(lr, np.float32), "lr"),
              numpy_helper.from_array(np.array(momentum, np.float32), "mu"),
              numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["z"]),
        helper.make_node("Softplus", ["z"], ["sp"]),
        helper.make_node("Mul", ["y", "z"], ["yz"]),
        helper.make_node("Sub", ["sp", "yz"], ["nll"]),
        helper.make_node("ReduceMean", ["nll"], ["loss"], keepdims=0),
        helper.make_node("Sigmoid", ["z"], ["p"]),
        helper.make_node("Sub", ["p", "y"], ["dz"]),
        helper.make_node("Unsqueeze", ["dz", "axis1"], ["dz1"]),
        helper.make_node("Mul", ["x", "dz1"], ["xdz"]),
        helper.make_node("ReduceMean", ["xdz"], ["gW"], axes=[0], keepdims=0),
        helper.make_node("ReduceMean", ["dz"], ["gb"], keepdims=0),
        helper.make_node("Mul", ["mu", "vW"], ["mvW"]),
        helper.make_node("Add", ["mvW", "gW"], ["vW_new"]),
        helper.make_node("Mul", ["mu", "vb"], ["mvb"]),
        helper.make_node("Add", ["mvb", "gb"], ["vb_new"]),
        helper.make_node("Mul", ["lr", "vW_new"], ["stepW"]),
        helper.make_node("Sub", ["W", "stepW"], ["W_new"]),
        helper.make_node("Mul", ["lr", "vb_new"], ["stepb"]),
        helper.make_node("Sub", ["b", "stepb"], ["b_new"]),
    ]
    graph = helper.make_graph(
        nodes, "logistic_train_step",
        [helper.make_tensor_value_info("x", f, ["N", dim]), helper.make_tensor_value_info("y", f, ["N"]),
         helper.make_tensor_value_info("W", f, [dim]), helper.make_tensor_value_info("b", f, []),
         helper.make_tensor_value_info("vW", f, [dim]), helper.make_tensor_value_info("vb", f, [])],
        [helper.make_tensor_value_info("loss", f, []), helper.make_tensor_value_info("W_new", f, [dim]),
         helper.make_tensor_value_info("b_new", f, []), helper.make_tensor_value_info("vW_new", f, [dim]),
         helper.make_tensor_value_info("vb_new", f, [])],
        initializer=consts)
    return _model(graph)


def logistic_eval(dim: int) -> bytes:
    """p = sigmoid(x @ W + b); x float32 [N, dim], W [dim] and b [] as inputs (held as state)."""
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["z"]),
             helper.make_node("Sigmoid", ["z"], ["p"])]
    graph = helper.make_graph(
        nodes, "logistic_eval",
        [helper.make_tensor_value_info("x", f, ["N", dim]), helper.make_tensor_value_info("W", f, [dim]),
         helper.make_tensor_value_info("b", f, [])],
        [helper.make_tensor_value_info("p", f, ["N"])])
    return _model(graph)


LOGISTIC_STATE = {"W_new": "W", "b_new": "b", "vW_new": "vW", "vb_new": "vb"}


def logistic_zero_state(dim: int) -> dict:
    z = np.zeros(dim, np.float32)
    return {"W": z, "b": np.float32(0.0), "vW": z, "vb": np.float32(0.0)}


def batch_mean_model(dim: "int | str" = 4, keepdims: int = 0) -> bytes:
    """m = ReduceMean(x, axes=[0]) (opset 17: axes an attribute): one value per column over the
    whole batch, not per row (what feeder.predict must refuse); x float32 [N, dim], m [dim]
    (keepdims 0) or [1, dim] (1), and y = x * 2 [N, dim] beside it, per row. ``dim`` symbolic
    ("D") leaves m's length unknown to the signature."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[0], keepdims=keepdims),
             helper.make_node("Mul", ["x", "two"], ["y"])]
    m_shape = ([1] if keepdims else []) + [dim]
    graph = helper.make_graph(
        nodes, "batch_mean",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", dim])],
        [helper.make_tensor_value_info("m", TensorProto.FLOAT, m_shape),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", dim])],
        initializer=[numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")])
    return _model(graph)


def save_with_external_data(model: bytes, path, location: str = "weights.bin", size_threshold: int = 44) -> None:
    """Save ``model`` at ``path`` as big models are saved: the bytes of its initializers in the
    file ``location`` beside it (``onnx.save_model(..., save_as_external_data=True)``). onnx
    compares ``sys.getsizeof(raw_data)``, 33 bytes more than the data, with ``size_threshold``: 44
    takes linear_model's W (48 bytes) and b (12) and keeps its 8-byte ``axes`` inline, as onnx's
    default threshold (1 KiB) keeps shape tensors, which shape inference must read."""
    import os

    import onnx

    proto = onnx.load_from_string(model)
    weights = os.path.join(os.path.dirname(str(path)), location)
    if os.path.exists(weights):
        os.remove(weights)  # onnx appends to an existing file (at other offsets): a retrained model replaces it
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=location,
                    size_threshold=size_threshold)


def id_outputs_model(width: int = 2) -> bytes:
    """Three outputs that each tell the row id of x float32 [N, width] (id in column 0, 1.0 in
    column 1): a = x [N, width], b = 2 * x [N, width], c = sum(x, axis=1) = id + 1 + ... [N].
    A consumer can check that every output it got belongs to one batch: the ids agree."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("Identity", ["x"], ["a"]),
        helper.make_node("Mul", ["x", "two"], ["b"]),
        helper.make_node("ReduceSum", ["x", "axes"], ["c"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "id_outputs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", width]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", width]),
         helper.make_tensor_value_info("c", TensorProto.FLOAT, ["N"])],
        initializer=[numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two"),
                     numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")])
    return _model(graph)


def zipmap_classifier_model(in_dim: int = 4, classes: int = 3) -> bytes:
    """What skl2onnx makes of a classifier by default: x float32 [N, in_dim] -> label int64 [N]
    and output_probability, a sequence of {class: probability} maps (ZipMap, domain ai.onnx.ml)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((in_dim, classes)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probabilities"], axis=1),
        helper.make_node("ArgMax", ["probabilities"], ["label"], axis=1, keepdims=0),
        helper.make_node("ZipMap", ["probabilities"], ["output_probability"], domain="ai.onnx.ml",
                         classlabels_int64s=list(range(classes))),
    ]
    seq_of_maps = helper.make_sequence_type_proto(helper.make_map_type_proto(
        TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, [])))
    graph = helper.make_graph(
        nodes, "zipmap_classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, in_dim])],
        [helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
         helper.make_value_info("output_probability", seq_of_maps)],
        initializer=[numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid("ai.onnx.ml", 1)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model.SerializeToString()


def column_inputs_model(names=("a", "b", "c")) -> bytes:
    """One float32 [N, 1] input per column (skl2onnx's DataFrame pipelines): y = concat(...) @ w,
    [N, 1], with w = 1, 2, 3, ..."""
    from onnx import TensorProto, helper, numpy_helper

    k = len(names)
    w = np.arange(1, k + 1, dtype=np.float32).reshape(k, 1)
    nodes = [helper.make_node("Concat", list(names), ["X"], axis=1), helper.make_node("MatMul", ["X", "W"], ["y"])]
    graph = helper.make_graph(
        nodes, "columns",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, 1]) for n in names],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 1])],
        initializer=[numpy_helper.from_array(w, "W")])
    return _model(graph)


def string_identity_model(shape=("N",)) -> bytes:
    """s: tensor(string) of ``shape`` -> out: the same strings (what the runtime read of them)."""
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Identity", ["s"], ["out"])], "strings",
                          [helper.make_tensor_value_info("s", TensorProto.STRING, list(shape))],
                          [helper.make_tensor_value_info("out", TensorProto.STRING, list(shape))])
    return _model(g)
