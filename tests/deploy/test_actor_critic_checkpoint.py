"""A SAC or TD3 learner of ``millpond launch`` writes every network it trains into
``checkpoint.pt`` (the policy, the twin critic, their targets, SAC's temperature, the
optimizer), and a learner started from that checkpoint goes on from the same state."""

from __future__ import annotations

import io

import gymnasium as gym
import pytest
import torch

from millpond import ReplayClient, TableConfig
from millpond.actors import Collector
from millpond.deploy.launch_config import load_config
from millpond.deploy.learner_actor import LearnerActor
from millpond.service.server import ServerConfig, create_server
from tests.deploy.test_launch_config import CONFIGS
from tests.learner._helpers import write_chunk


@pytest.mark.parametrize(
    ("name", "modules"),
    [
        ("pendulum-sac.yaml", {"policy", "critic", "target_critic", "temperature"}),
        ("pendulum-td3.yaml", {"policy", "critic", "target_critic", "target_policy"}),
    ],
)
def test_checkpoint_holds_every_network_and_restores_them(tmp_path, name, modules):
    overrides = ["learner.hidden_sizes=[16]", "learner.threads=1"]
    config = load_config(CONFIGS / name, overrides)
    algo = config.learner.algorithm
    server, port = create_server(ServerConfig(dir=str(tmp_path / "s")))
    address = f"127.0.0.1:{port}"
    client = ReplayClient(address, timeout_s=10)
    try:
        client.create_table(TableConfig.uniform("replay", capacity=1024, seed=1))
        with Collector("Pendulum-v1", num_envs=2, chunk_len=64, seed=0) as collector:
            write_chunk(client, "replay", collector.collect())
        env = gym.make("Pendulum-v1")
        spaces = env.observation_space, env.action_space
        env.close()

        first = LearnerActor(config, *spaces)
        first.start(address, "replay")
        first.publish()
        for _ in range(4):
            first.learner.step()
        path = tmp_path / "checkpoint.pt"
        data = first.checkpoint(str(path), return_bytes=True)
        state = torch.load(io.BytesIO(data), weights_only=False)
        assert state["algorithm"] == algo
        assert modules <= set(state) and "optimizer" in state

        second = LearnerActor(config, *spaces)
        second.start(address, "replay", restore=path.read_bytes())
        for module in modules:
            got = getattr(second.learner, module).state_dict()
            want = getattr(first.learner, module).state_dict()
            assert got.keys() == want.keys()
            for key in want:
                assert torch.equal(got[key], want[key]), (module, key)
        got = second.learner.optimizer.state_dict()["state"]
        want = first.learner.optimizer.state_dict()["state"]
        assert got.keys() == want.keys() and len(want) > 0
        for index, moments in want.items():
            for key, value in moments.items():
                assert torch.equal(got[index][key], value), (index, key)
        first.close()
        second.close()
    finally:
        client.close()
        server.stop(grace=0.5)
