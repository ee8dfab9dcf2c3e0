"""Live table settings: a running table's rate limiter and priority exponents changed by an
admin, at once, for good (across a restart), and refused whole when a value is bad."""

import threading

import numpy as np
import pytest

from millpond import ReplayClient, TableConfig
from millpond.cli import main
from millpond.errors import InvalidConfigError, PermissionDeniedError
from millpond.service.server import ServerConfig, create_server
from millpond.testing import constant_segment


def _write(client, table: str, episodes: range, length: int = 8) -> None:
    with client.writer(table, f"w-{table}-{episodes.start}") as writer:
        for episode in episodes:
            writer.write_segment(*constant_segment(episode, length=length), episode_id=episode)


def test_prefill_without_a_ratio_then_switch_it_on_and_keep_it(tmp_path):
    shard_dir = str(tmp_path / "shard")
    running, port = create_server(ServerConfig(dir=shard_dir))
    address = f"127.0.0.1:{port}"
    ratio = TableConfig.uniform("replay", 400, min_size=8, samples_per_insert=2.0, error_buffer=4.0)
    try:
        with ReplayClient([address], colocated=False) as client:
            client.create_table(ratio)
            _write(client, "replay", range(1))  # 8 steps: 16 samples allowed, about
            client.sample("replay", 16)
            held: list = []
            waiter = threading.Thread(
                target=lambda: held.append(client.sample("replay", 64, timeout_s=20))
            )
            waiter.start()
            waiter.join(0.5)
            assert waiter.is_alive()  # held back by the ratio
            config = client.configure_table("replay", samples_per_insert=None)
            waiter.join(10)
            assert not waiter.is_alive() and held  # woken under the new bounds at once
            assert config.samples_per_insert is None and config.error_buffer is None
            _write(client, "replay", range(1, 20))  # a prefill, no ratio to wait for
            config = client.configure_table("replay", samples_per_insert=4.0, error_buffer=8.0)
            assert (config.samples_per_insert, config.error_buffer) == (4.0, 8.0)
            assert config.min_size == 8  # what was not given is kept
    finally:
        running.stop(grace=1)
    # Restarted on the same directory, with the tables file's original config: the live
    # settings are kept, and creating the table again returns them.
    running, port = create_server(ServerConfig(dir=shard_dir, tables=(ratio,)))
    try:
        with ReplayClient([f"127.0.0.1:{port}"], colocated=False) as client:
            stored = client.create_table(ratio)
            assert (stored.samples_per_insert, stored.error_buffer) == (4.0, 8.0)
            info = client.info("replay")["shards"][0]
            assert info["config"].samples_per_insert == 4.0
            assert info["inserts"] == 160  # the counts carried over, under the new ratio
    finally:
        running.stop(grace=1)


def test_bad_values_are_refused_whole(tmp_path):
    running, port = create_server(ServerConfig(dir=str(tmp_path / "shard")))
    try:
        with ReplayClient([f"127.0.0.1:{port}"], colocated=False) as client:
            client.create_table(TableConfig.uniform("u", 100, min_size=4))
            with pytest.raises(InvalidConfigError, match="min_size"):
                client.configure_table("u", min_size=-1, samples_per_insert=2.0)
            with pytest.raises(InvalidConfigError, match="prioritized"):
                client.configure_table("u", alpha=0.5)
            with pytest.raises(InvalidConfigError, match="capacity"):
                client.configure_table("u", capacity=10)
            with pytest.raises(InvalidConfigError, match="must be a number"):
                client.configure_table("u", min_size="many")
            config = client.info("u")["shards"][0]["config"]
            assert (config.min_size, config.samples_per_insert) == (4, None)  # unchanged
    finally:
        running.stop(grace=1)


def test_alpha_and_beta_of_a_prioritized_table(tmp_path):
    running, port = create_server(ServerConfig(dir=str(tmp_path / "shard")))
    try:
        with ReplayClient([f"127.0.0.1:{port}"], colocated=False) as client:
            client.create_table(TableConfig.prioritized("p", 100, alpha=1.0, beta=0.5, seed=1))
            _write(client, "p", range(2))
            batch = client.sample("p", 16)
            client.update_priorities("p", batch["index"], np.linspace(1.0, 100.0, 16))
            skewed = client.sample("p", 64)["weight"].numpy()
            assert not np.allclose(skewed, 1.0)  # alpha 1: unequal probabilities
            config = client.configure_table("p", alpha=0.0, beta=1.0)
            assert (config.alpha, config.beta) == (0.0, 1.0)
            weights = client.sample("p", 64)["weight"].numpy()
            assert np.allclose(weights, 1.0)  # alpha 0: every step alike, every weight 1
    finally:
        running.stop(grace=1)


def test_only_an_admin_token_configures(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("learner learner-token-1\nadmin admin-token-123\n")
    running, port = create_server(ServerConfig(dir=str(tmp_path / "shard"), token_file=str(tokens)))
    address = f"127.0.0.1:{port}"
    try:
        with ReplayClient([address], token="admin-token-123") as admin:
            admin.create_table(TableConfig.uniform("t", 100))
        learner = ReplayClient([address], token="learner-token-1")
        with learner, pytest.raises(PermissionDeniedError):
            learner.configure_table("t", min_size=10)
        argv = ["table", "configure", address, "t", "--min-size", "10"]
        assert main([*argv, "--token", "admin-token-123"]) == 0
        with ReplayClient([address], token="admin-token-123") as admin:
            assert admin.info("t")["shards"][0]["config"].min_size == 10
    finally:
        running.stop(grace=1)
