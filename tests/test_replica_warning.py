"""Registering a source name a coordinator already has adds a replica (the contract) and says so
in a WARNING the first time, with how to replace the first registration instead; replica=True
says it is meant (issue 35, item 6: a notebook cell run again made two replicas silently)."""
from __future__ import annotations

import logging

import numpy as np
import pytest

import feeder


def fetch(worker_id, batch_size):
    return [np.ones((4, 2), np.float32)]


def replica_warnings(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING and "adds a replica" in r.getMessage()]


def test_the_second_registration_of_a_name_warns_once_and_adds_a_replica(coord, caplog):
    with caplog.at_level(logging.WARNING, logger="feeder"):
        feeder.init_data_input_workers(None, ["x"], fetch, 4, coordinator=coord)
        assert not replica_warnings(caplog)
        feeder.init_data_input_workers(None, ["x"], fetch, 4, coordinator=coord)  # the cell, run again
        feeder.init_data_input_workers(None, ["x"], fetch, 4, coordinator=coord)
        feeder.init_data_input_workers(None, ["x"], fetch, 4, coordinator=coord, input_source_name="other")
    (warning,) = replica_warnings(caplog)
    message = warning.getMessage()
    assert "'train'" in message and "stop_coordinator('train')" in message and "replica=True" in message, message
    assert len(coord.feeds("train")) == 3  # the contract holds: each registration is a replica
    with pytest.raises(ValueError, match="3 feeds"):
        coord.feed("train")


def test_replica_true_registers_replicas_without_a_warning(coord, caplog):
    with caplog.at_level(logging.WARNING, logger="feeder"):
        for _ in range(3):
            feeder.init_data_input_workers(None, ["x"], fetch, 4, coordinator=coord, replica=True)
    assert not replica_warnings(caplog) and len(coord.feeds("train")) == 3
    with pytest.raises(TypeError, match="replica"):
        feeder.init_data_input_workers(None, ["x"], fetch, 4, coordinator=coord, replica="yes")


def test_stop_coordinator_then_registering_again_replaces_the_first(coord, caplog):
    with caplog.at_level(logging.WARNING, logger="feeder"):
        feeder.init_data_input_workers(None, ["x"], fetch, 4, coordinator=coord)
        coord.stop_coordinator("train")
        feeder.init_data_input_workers(None, ["x"], fetch, 4, coordinator=coord)
        with coord:
            assert len(coord.feed("train").next_batch()["x"]) == 4
        # after a stop, a name warns again the next time it is registered twice
        feeder.init_data_input_workers(None, ["x"], fetch, 4, coordinator=coord)
        feeder.init_data_input_workers(None, ["x"], fetch, 4, coordinator=coord)
    assert len(replica_warnings(caplog)) == 1
