"""A fetch function that raises in a worker process: the consumer's FetchError's cause prints
with the worker's frames, the user's file, line and source text, not `File "<dynamic-code>"`
and not a bare `ValueError: ...` (issue 35, item 7)."""
from __future__ import annotations

import inspect
import traceback

import numpy as np
import pytest

import feeder
from feeder.processes.remotetb import attach, frames_of


def fails_by_name(worker_id, batch_size):
    rows = np.ones((2, 2), np.float32)
    raise ValueError(f"bad record {len(rows)} (by name)")  # the failing line of fails_by_name


def make_closure():
    # A closure travels by value (cloudpickle), which named its code "<dynamic-code>".
    def fails_by_value(worker_id, batch_size):
        raise ValueError("bad record (by value)")  # the failing line of fails_by_value
    return fails_by_value


def failing_line(fun):
    lines, first = inspect.getsourcelines(fun)
    (k,) = [i for i, text in enumerate(lines) if "the failing line of" in text]
    return first + k, lines[k].strip()


def consumer_traceback(coord, fetch, method):
    feeder.init_data_input_workers(None, ["x"], fetch, 4, coordinator=coord, num_worker_processes=1,
                                   mp_context=method, timeout=60)
    coord.start()
    with pytest.raises(feeder.FetchError) as raised:
        coord.feed("train").next_batch()
    return raised.value, "".join(traceback.format_exception(raised.value))


@pytest.mark.parametrize("method, which", [("forkserver", "by name"), ("forkserver", "by value"),
                                           ("spawn", "by value")])
def test_the_cause_prints_with_the_users_file_line_and_source(coord, method, which):
    fetch = fails_by_name if which == "by name" else make_closure()
    error, text = consumer_traceback(coord, fetch, method)
    cause = error.__cause__
    assert type(cause) is ValueError and cause.__traceback__ is not None  # not a bare "ValueError: ..."
    lineno, source = failing_line(fetch)
    where = f'File "{__file__}", line {lineno}, in {fetch.__name__}'
    assert where in text and source in text, text
    # the frames print above the cause's own line, as a local exception's would
    cause_part = text.split("The above exception was the direct cause")[0]
    assert where in cause_part and source in cause_part and "<dynamic-code>" not in text, text
    assert cause_part.rstrip().endswith(f"ValueError: {cause}")


def test_attach_rebuilds_frames_without_underlining_part_of_a_line():
    def inner():
        value = {"ключ": 1}  # a line with non-ASCII text
        return value["missing"]

    try:
        inner()
    except KeyError as e:
        frames = frames_of(e)
        local = "".join(traceback.format_exception(e))
    rebuilt = KeyError("missing")
    assert attach(rebuilt, frames)
    text = "".join(traceback.format_exception(rebuilt))
    lineno = inspect.getsourcelines(inner)[1] + 2
    assert f'File "{__file__}", line {lineno}, in inner' in text and 'return value["missing"]' in text
    assert "^" not in text and "~" not in text, text  # the whole line: nothing underlined
    assert text.count("File ") == local.count("File ")
    # frames of a file that is not there (a notebook cell elsewhere) still say where
    gone = ValueError("x")
    assert attach(gone, [("/no/such/file.py", 7, "cell"), ("<string>", 1, "<module>")])
    text = "".join(traceback.format_exception(gone))
    assert 'File "/no/such/file.py", line 7, in cell' in text and 'File "<string>", line 1, in <module>' in text
    assert not attach(ValueError("y"), [])


def test_a_function_of_a_notebook_cell_shows_its_source_in_the_workers_traceback(coord):
    # IPython compiles a cell under a name like this one and registers its lines with linecache;
    # the worker process has no such file: the lines travel with the function.
    import linecache

    cell = "<ipython-input-7-feeder-test>"
    source = "def from_a_cell(worker_id, batch_size):\n    raise ValueError('bad cell record')  # in the cell\n"
    linecache.cache[cell] = (len(source), None, source.splitlines(True), cell)
    scope = {}
    exec(compile(source, cell, "exec"), scope)
    try:
        error, text = consumer_traceback(coord, scope["from_a_cell"], "forkserver")
    finally:
        linecache.cache.pop(cell, None)
    line = "raise ValueError('bad cell record')  # in the cell"
    assert f'File "{cell}", line 2, in from_a_cell' in str(error) and line in str(error)  # the child's text
    assert f'File "{cell}", line 2, in from_a_cell' in text
