"""feeder: keep ONNX Runtime busy while Python loads and prepares data.

A threaded producer/consumer feeder descended from Caffe2's ``data_workers``::

    import feeder

    def fetch(worker_id, batch_size):            # runs in fetcher threads
        x, y = load_some_rows()                  # any number of rows
        return [x, y]                            # or {"x": x, "y": y}; raise StopIteration at the end

    coord = feeder.init_data_input_workers(session, ["x", "y"], fetch, batch_size=64,
                                           num_worker_threads=4, input_source_name="train")
    with coord:                                  # start() ... stop()
        feed = coord.feed("train")
        for _ in range(1000):
            outputs = feed.run()                 # next batch, bound through IOBinding, run

A global coordinator owns named bounded queues (one per source: "train", "test", ...);
fetcher threads call ``fetch_fun``; an enqueuer thread per feed rebatches chunks to exactly
``batch_size`` rows and prepares OrtValues; consumers wait with timeouts. Throughput is
logged to the ``"feeder"`` logger and handed to external loggers. The public contract is the
documentation's page "The contract" (``docs/reference/contract.md``).
"""
from .api import init_data_input_workers
from .chunkqueue import ChunkQueue
from .coordinator import GlobalCoordinator, global_coordinator
from .errors import FeederError, FeedStopped, FeedTimeout, FetchError, InputValidationError, RemoteError
from .feed import Feed
from .prometheus import PrometheusLogger  # imports prometheus_client only when one is created
from .ragged import Ragged
from .runtime import OrtTrainingModule, StatefulSession
from .scoring.predictor import PredictResult, predict  # imports pyarrow only when predict() runs

__all__ = [
    "init_data_input_workers", "predict", "PredictResult",
    "GlobalCoordinator", "global_coordinator", "Feed", "ChunkQueue",
    "StatefulSession", "OrtTrainingModule", "PrometheusLogger", "Ragged",
    "FeederError", "FeedStopped", "FeedTimeout", "FetchError", "InputValidationError", "RemoteError",
]
__version__ = "0.1.0"
