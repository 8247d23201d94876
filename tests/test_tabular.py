"""Tabular models as users meet them: scikit-learn models converted with skl2onnx, Parquet written
by pandas (float64 columns), fed through ParquetSource and `feeder predict` (issue 29, item 2)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import feeder
from feeder.scoring import cli as predictcli
from feeder.sources import ParquetSource

pd = pytest.importorskip("pandas")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
sklearn = pytest.importorskip("sklearn")
pytest.importorskip("skl2onnx")

from skl2onnx import convert_sklearn, to_onnx  # noqa: E402
from skl2onnx.common.data_types import FloatTensorType  # noqa: E402
from sklearn.compose import ColumnTransformer  # noqa: E402
from sklearn.datasets import load_diabetes, load_digits  # noqa: E402
from sklearn.linear_model import LinearRegression, LogisticRegression, Ridge  # noqa: E402
from sklearn.pipeline import Pipeline  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    return env


def read(output, by="id"):
    table = pq.read_table(str(output))
    order = np.argsort(table[by].to_numpy())
    out = {}
    for name in table.column_names:
        col = table[name].combine_chunks()
        if pa.types.is_fixed_size_list(col.type):
            out[name] = col.flatten().to_numpy().reshape(len(col), col.type.list_size)[order]
        else:
            out[name] = col.to_numpy()[order]
    return out


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The digits set as pandas writes it (64 float64 columns f0..f63 and an id) and a
    LogisticRegression on it, converted with and without ZipMap."""
    d = tmp_path_factory.mktemp("digits")
    X, y = load_digits(return_X_y=True)
    df = pd.DataFrame(X, columns=[f"f{i}" for i in range(64)])
    df["id"] = np.arange(len(df))
    df.to_parquet(d / "digits.parquet", row_group_size=300)
    assert pq.read_schema(d / "digits.parquet").field("f0").type == pa.float64()
    model = LogisticRegression(max_iter=300).fit(X, y)
    (d / "zipmap.onnx").write_bytes(to_onnx(model, X[:1].astype(np.float32)).SerializeToString())
    (d / "probs.onnx").write_bytes(to_onnx(model, X[:1].astype(np.float32),
                                           options={"zipmap": False}).SerializeToString())
    return d, X, model


def test_a_classifier_on_pandas_float64_columns_through_the_command_line(digits, tmp_path):
    d, X, model = digits
    cmd = [sys.executable, "-m", "feeder", "predict", str(d / "probs.onnx"), str(d / "digits.parquet"),
           str(tmp_path / "out"), "--cast", "--columns", "X=f*", "--keep", "id", "--order", "--replicas", "2",
           "--rows-per-file", "500"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{len(X)} rows written, {len(X)} computed")
    table = pq.read_table(str(tmp_path / "out"))  # the parts in order: the rows in the file's order
    np.testing.assert_array_equal(table["id"].to_numpy(), np.arange(len(X)))
    probs = table["probabilities"].combine_chunks().flatten().to_numpy().reshape(len(X), 10)
    np.testing.assert_allclose(probs, model.predict_proba(X), atol=1e-5)
    np.testing.assert_array_equal(table["label"].to_numpy(), model.predict(X))
    # the same columns listed one by one, from the API
    src = ParquetSource(d / "digits.parquet", columns={"X": [f"f{i}" for i in range(64)], "id": "id"})
    result = feeder.predict(str(d / "probs.onnx"), src, tmp_path / "api", keep=["id"], cast=True, progress=False)
    assert result.rows == len(X)
    np.testing.assert_allclose(read(tmp_path / "api")["probabilities"], model.predict_proba(X), atol=1e-5)


def test_the_default_zipmap_conversion_is_refused_before_anything_saying_what_to_do(digits, tmp_path, capsys):
    d, _, _ = digits
    status = predictcli.main([str(d / "zipmap.onnx"), str(d / "digits.parquet"), str(tmp_path / "out"), "--cast",
                              "--columns", "X=f*"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert "model output 'output_probability' is a seq(map(int64,tensor(float)))" in err
    assert "zipmap=False" in err and "--outputs output_label" in err
    assert not (tmp_path / "out").exists()
    # without --cast, float64 columns are refused naming the remedy (the source stacks them as float64)
    status = predictcli.main([str(d / "probs.onnx"), str(d / "digits.parquet"), str(tmp_path / "out2"), "--columns",
                              "X=f*", "--outputs", "label"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "dtype float32, got dtype float64 (--cast converts safe casts)" in err, err


def test_a_regressor_output_squeezed_to_a_plain_column(tmp_path):
    X, y = load_diabetes(return_X_y=True)
    df = pd.DataFrame(X, columns=[f"c{i}" for i in range(10)])
    df.to_parquet(tmp_path / "diabetes.parquet")
    model = LinearRegression().fit(X, y)
    (tmp_path / "m.onnx").write_bytes(to_onnx(model, X[:1].astype(np.float32)).SerializeToString())
    status = predictcli.main([str(tmp_path / "m.onnx"), str(tmp_path / "diabetes.parquet"), str(tmp_path / "out"),
                              "--cast", "--columns", "X=" + ",".join(f"c{i}" for i in range(10)), "--squeeze",
                              "--order", "--no-progress"])
    assert status == 0
    table = pq.read_table(str(tmp_path / "out"))
    assert table.schema.field("variable").type == pa.float32()
    np.testing.assert_allclose(table["variable"].to_numpy(), model.predict(X), rtol=1e-4, atol=1e-3)


def test_a_dataframe_pipeline_with_one_n_by_1_input_per_column(tmp_path):
    """skl2onnx converts a ColumnTransformer pipeline with one [N, 1] input per column: scalar
    Parquet columns of those names feed them, reshaped (and cast from float64)."""
    X, y = load_diabetes(return_X_y=True, as_frame=True)
    cols = list(X.columns)
    pipe = Pipeline([("ct", ColumnTransformer([("s", StandardScaler(), cols)])), ("r", Ridge())]).fit(X, y)
    onx = convert_sklearn(pipe, initial_types=[(c, FloatTensorType([None, 1])) for c in cols])
    (tmp_path / "pipe.onnx").write_bytes(onx.SerializeToString())
    frame = X.copy()
    frame["id"] = np.arange(len(frame))
    frame.to_parquet(tmp_path / "d.parquet")
    status = predictcli.main([str(tmp_path / "pipe.onnx"), str(tmp_path / "d.parquet"), str(tmp_path / "out"),
                              "--cast", "--keep", "id", "--squeeze", "--no-progress"])
    assert status == 0
    got = read(tmp_path / "out")
    np.testing.assert_allclose(got["variable"], pipe.predict(X), rtol=1e-4, atol=1e-2)


def test_columns_option_refusals_are_one_line(digits, tmp_path, capsys):
    d, _, _ = digits
    for args, what in ((["--columns", "X"], "--columns takes INPUT=COLUMN"),
                       (["--columns", "Z=f1"], "--columns names ['Z'], which are neither inputs of the model"),
                       (["--columns", "X=h*"], "the pattern 'h*' (input 'X') matches no column")):
        status = predictcli.main([str(d / "probs.onnx"), str(d / "digits.parquet"), str(tmp_path / "out")] + args)
        err = capsys.readouterr().err.strip()
        assert status == 2 and len(err.splitlines()) == 1 and what in err, err
