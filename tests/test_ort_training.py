"""onnxruntime-training's Module/Optimizer fed by feeder (issue 6, part 2).

onnxruntime-training 1.19.2 installs into the same ``onnxruntime`` package as onnxruntime 1.31
and breaks it, so these tests run in their own environment, built by .ci/run (see docs/training.md);
the main test command skips them, saying why.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

pytestmark = pytest.mark.ort_training
training = pytest.importorskip(
    "onnxruntime.training",
    reason="onnxruntime-training is not installed here: it needs its own environment, which .ci/run "
           "builds (~/.cache/feeder/venv-ort-training-1.19.2) to run these tests")

from models import IR_VERSION, OPSET  # noqa: E402

import feeder  # noqa: E402

DIM = 6


def logits_model():
    """logits = x @ W + b for two classes, with W [DIM, 2] and b [2] trainable (CrossEntropyLoss:
    its SoftmaxCrossEntropyLoss is stable, where 1.19's BCEWithLogitsLoss turned NaN once logits grew)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["logits"])],
        "logreg",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", DIM])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 2])],
        initializer=[numpy_helper.from_array((rng.standard_normal((DIM, 2)) * 0.01).astype(np.float32), "W"),
                     numpy_helper.from_array(np.zeros(2, np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


@pytest.fixture
def module_and_optimizer(tmp_path):
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    artifacts.generate_artifacts(logits_model(), requires_grad=["W", "b"], frozen_params=[],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=str(tmp_path))
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    optimizer = Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(0.05)
    return module, optimizer, state, str(tmp_path / "training_model.onnx")


def separable(n, seed):
    rng = np.random.default_rng(seed)
    w = np.linspace(-1, 1, DIM).astype(np.float32)
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    return x, (x @ w > 0).astype(np.int64)


def test_feed_runs_train_steps_and_the_loss_falls(module_and_optimizer, coord):
    module, optimizer, state, path = module_and_optimizer
    adapter = feeder.OrtTrainingModule(module, optimizer, train_model_path=path)
    names = [a.name for a in adapter.get_inputs()]
    assert names[0] == "x" and len(names) == 2  # x and the loss's target
    x, y = separable(4000, seed=1)
    lock = threading.Lock()
    rng = np.random.default_rng(0)

    def fetch(worker_id, batch_size):
        with lock:
            idx = rng.integers(0, len(x), 16)
        return {names[0]: x[idx], names[1]: y[idx]}

    feeder.init_data_input_workers(adapter, None, fetch, 64, coordinator=coord, timeout=30)
    coord.start()
    feed = coord.feed("train")
    losses = [float(feed.run()[0]) for _ in range(300)]
    assert adapter.steps == 300
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:5])
    W = state.parameters["W"].data
    b = state.parameters["b"].data
    x_test, y_test = separable(1000, seed=2)
    W, b = W.reshape(DIM, 2), b.reshape(2)
    assert np.mean((x_test @ W + b).argmax(1) == y_test) > 0.95


def test_inputs_are_validated_against_the_training_model(module_and_optimizer, coord):
    module, optimizer, _, path = module_and_optimizer
    adapter = feeder.OrtTrainingModule(module, optimizer, train_model_path=path)
    names = [a.name for a in adapter.get_inputs()]
    feeder.init_data_input_workers(adapter, None, lambda w, b: {names[0]: np.zeros((4, DIM), np.float64),
                                                                names[1]: np.zeros(4, np.int64)},
                                   4, coordinator=coord, timeout=10)
    coord.start()
    with pytest.raises(feeder.InputValidationError, match="float32"):
        coord.feed("train").run()
