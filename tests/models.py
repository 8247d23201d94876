"""Tiny ONNX models built with onnx.helper for the tests (nothing is downloaded).

onnx 1.23 stamps IR 14 / opset 28 by default, which onnxruntime 1.31 rejects, so every
model sets its IR version and opset explicitly.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

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


def session(model: bytes, threads: int = 1):
    """An InferenceSession on the CPU with one intra-op thread (on 2 cores, spinning pool
    threads starve the Python fetchers)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
