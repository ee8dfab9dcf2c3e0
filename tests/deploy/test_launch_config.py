"""`millpond launch` configs: the shipped files load, and every mistake is named in one line."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from millpond.actors import ApexPriorities, Collector, GaussianNoise, OrnsteinUhlenbeckNoise
from millpond.deploy.config_files import apply_override
from millpond.deploy.config_mapping import to_mapping
from millpond.deploy.env_fleet import actor_config, fleet_options
from millpond.deploy.launch_config import LaunchConfig, load_config
from millpond.errors import InvalidConfigError
from millpond.learner import DQNConfig, PPOConfig

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"


def write(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("name", "sampler"),
    [
        ("cartpole-ppo.yaml", "queue"),
        ("cartpole-dqn.yaml", "uniform"),
        ("cartpole-rainbow.yaml", "prioritized_slices"),
        ("pendulum-sac.yaml", "uniform"),
        ("pendulum-td3.yaml", "uniform"),
    ],
)
def test_shipped_configs_load(name, sampler):
    config = load_config(CONFIGS / name)
    assert isinstance(config, LaunchConfig)
    assert isinstance(config.learner.ppo, PPOConfig) and isinstance(config.learner.dqn, DQNConfig)
    table = config.replay.table_config()
    assert table.sampler == sampler


def test_rainbow_config_is_prioritized_n_step_double_dueling():
    config = load_config(CONFIGS / "cartpole-rainbow.yaml")
    dqn, table = config.learner.dqn, config.replay.table_config()
    assert dqn.prioritized and dqn.n_step == 3 and dqn.double_dqn and config.learner.dueling
    assert table.has_priorities and table.slice_len >= dqn.n_step and not table.strict_length


def test_env_actors_reset_same_step_unless_the_env_registers_its_own_vector_env():
    """Lanes gymnasium vectorises reset in the same step; a registered vector env (CartPole's,
    NEXT_STEP) keeps its own mode, and the actor's collector builds it."""
    config = load_config(CONFIGS / "cartpole-dqn.yaml")
    assert actor_config(config, "replay", "mlp").autoreset_mode == "same_step"
    config = load_config(
        CONFIGS / "cartpole-dqn.yaml", ["env.vectorization_mode=vector_entry_point"]
    )
    actor = actor_config(config, "replay", "mlp")
    assert (actor.vectorization_mode, actor.autoreset_mode) == ("vector_entry_point", None)
    collector = Collector(
        actor.env,
        None,
        num_envs=2,
        chunk_len=4,
        vectorization_mode=actor.vectorization_mode,
        autoreset_mode=actor.autoreset_mode,
    )
    assert type(collector.env.unwrapped).__name__ == "CartPoleVectorEnv"
    assert collector.autoreset_mode.name == "NEXT_STEP"
    collector.close()


def test_dueling_is_for_dqn_mlp_q_networks(tmp_path):
    with pytest.raises(InvalidConfigError, match=r"learner.dueling"):
        load_config(write(tmp_path, "learner: {algorithm: ppo, dueling: true}\n"))
    with pytest.raises(InvalidConfigError, match=r"learner.dueling"):
        load_config(CONFIGS / "cartpole-rainbow.yaml", ["learner.network=nature_cnn"])


def test_ppo_file_values_reach_the_dataclasses():
    config = load_config(CONFIGS / "cartpole-ppo.yaml")
    assert config.learner.algorithm == "ppo"
    assert config.learner.ppo.batch_size == 1024 and config.learner.ppo.lr == pytest.approx(1e-3)
    assert config.env.id == "CartPole-v1" and config.actors.num_actors == 1


def test_defaults_round_trip(tmp_path):
    config = load_config(write(tmp_path, ""))
    assert config == LaunchConfig()
    again = load_config(write(tmp_path, __import__("yaml").safe_dump(to_mapping(config))))
    assert again == config


def test_overrides_apply_before_checking(tmp_path):
    path = CONFIGS / "cartpole-ppo.yaml"
    config = load_config(
        path, ["learner.ppo.lr=3e-4", "run.frames=5000", "learner.hidden_sizes=[32]"]
    )
    assert config.learner.ppo.lr == pytest.approx(3e-4)
    assert config.run.frames == 5000 and config.learner.hidden_sizes == [32]
    assert load_config(path, ["ray.address=auto"]).ray.address == "auto"


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("bogus: 1\n", [], "bogus: unknown key"),
        ("actors: {lanes: 4}\n", [], "actors.lanes: unknown key"),
        ("learner: {ppo: {learning_rate: 1}}\n", [], "learner.ppo.learning_rate: unknown key"),
        ("learner: {ppo: {lr: fast}}\n", [], "learner.ppo.lr: expected a number, got 'fast'"),
        ("actors: {num_envs: 2.5}\n", [], "actors.num_envs: expected an integer"),
        ("actors: {num_envs: 0}\n", [], "actors.num_envs: 0 must be >= 1"),
        ("actors: {deterministic: 'yes'}\n", [], "actors.deterministic: expected true or false"),
        ("learner: {hidden_sizes: 64}\n", [], "learner.hidden_sizes: expected a list"),
        ("learner: {hidden_sizes: [64, x]}\n", [], "learner.hidden_sizes[1]: expected an integer"),
        ("learner: {ppo: {gamma: 2}}\n", [], "learner.ppo.gamma"),
        (
            "learner: {algorithm: a2c}\n",
            [],
            "learner.algorithm: 'a2c' is not one of ppo, dqn, sac, td3",
        ),
        ("env: [1, 2]\n", [], "env: expected a mapping"),
        ("replay: {table: {name: t, capacity: 10, colour: red}}\n", [], "replay.table: unknown"),
        ("", ["run.frames=lots"], "run.frames: expected an integer, got 'lots'"),
        ("", ["actors.lanes=4"], "actors.lanes: unknown key"),
        ("", ["run.frames"], "expected KEY=VALUE"),
        ("", ["run.frames.x=1"], "run.frames: expected an integer"),
        ("run: {frames: 5}\n", ["run.frames.x=1"], "run.frames is not a section"),
        (
            "env: {vectorization_mode: threads}\n",
            [],
            "env.vectorization_mode: 'threads' is not one of sync, async, vector_entry_point",
        ),
        (
            "env: {id: Acrobot-v1, vectorization_mode: vector_entry_point}\n",
            [],
            "env.vectorization_mode 'vector_entry_point': env 'Acrobot-v1' registers no vector",
        ),
        (
            "env: {vectorization_mode: vector_entry_point, wrappers: "
            "[{path: 'gymnasium.wrappers:ClipReward', kwargs: {min_reward: 0}}]}\n",
            [],
            "env.vectorization_mode 'vector_entry_point': env wrappers apply to each lane's",
        ),
    ],
)
def test_mistakes_name_the_key(tmp_path, text, overrides, message):
    with pytest.raises(InvalidConfigError) as info:
        load_config(write(tmp_path, text), overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_table_must_fit_the_algorithm(tmp_path):
    ppo_on_uniform = "replay: {table: {name: t, sampler: uniform, capacity: 100}}\n"
    with pytest.raises(InvalidConfigError, match=r"replay.table.sampler: ppo needs a queue"):
        load_config(write(tmp_path, ppo_on_uniform))
    dqn_on_queue = "learner: {algorithm: dqn}\n"  # the default table is a queue
    with pytest.raises(InvalidConfigError, match=r"dqn needs a uniform or prioritized"):
        load_config(write(tmp_path, dqn_on_queue))
    unflagged = "learner: {algorithm: dqn}\nreplay: {table: {name: t, sampler: prioritized, capacity: 100}}\n"
    with pytest.raises(InvalidConfigError, match=r"learner.dqn.prioritized"):
        load_config(write(tmp_path, unflagged))
    n_step = "learner: {algorithm: dqn, dqn: {n_step: 3}}\n"
    strict = n_step + "replay: {table: {name: t, sampler: slices, capacity: 100, slice_len: 3}}\n"
    with pytest.raises(InvalidConfigError, match=r"replay.table.strict_length: n-step DQN"):
        load_config(write(tmp_path, strict))
    loose = strict.replace("slice_len: 3", "slice_len: 3, strict_length: false")
    assert load_config(write(tmp_path, loose)).replay.table_config().strict_length is False
    prioritized = loose.replace("sampler: slices", "sampler: prioritized_slices")
    with pytest.raises(InvalidConfigError, match=r"'prioritized_slices'"):
        load_config(write(tmp_path, prioritized))  # learner.dqn.prioritized is false
    flagged = prioritized.replace("n_step: 3", "n_step: 3, prioritized: true")
    assert load_config(write(tmp_path, flagged)).learner.dqn.prioritized


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(InvalidConfigError, match=r"config file .*nope.yaml not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(InvalidConfigError, match=r"is not valid YAML"):
        load_config(write(tmp_path, "env: {id: [\n"))
    with pytest.raises(InvalidConfigError, match=r"expected a mapping of sections"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_override_values_are_yaml():
    doc = {}
    apply_override(doc, "a.b=[1, 2]")
    apply_override(doc, "a.c=null")
    apply_override(doc, "d=text with spaces")
    assert doc == {"a": {"b": [1, 2], "c": None}, "d": "text with spaces"}


def test_cli_reports_one_line_and_exit_code_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "millpond.cli", "launch", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("millpond: error: config file")
    bad = write(tmp_path, "learner: {ppo: {lr: fast}}\n")
    result = subprocess.run(
        [sys.executable, "-m", "millpond.cli", "launch", str(bad), "--set", "run.frames=10"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "learner.ppo.lr: expected a number" in result.stderr


def test_unknown_env_is_a_config_error_before_anything_starts(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "millpond.cli",
            "launch",
            str(CONFIGS / "cartpole-ppo.yaml"),
            "--set",
            "env.id=NoSuchEnv-v9",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "env: cannot make 'NoSuchEnv-v9'" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


def test_token_file_gives_the_driver_admin_and_the_actors_writer(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(
        "# roles\nlearner learner-token-1\nwriter writer-token-1\nadmin admin-token-1\n"
    )
    config = load_config(write(tmp_path, f"replay: {{token_file: {tokens}}}\n"))
    assert config.replay.tokens() == ("admin-token-1", "writer-token-1")
    tokens.write_text("admin admin-token-1\n")  # no writer token: the actors share the admin one
    assert config.replay.tokens() == ("admin-token-1", "admin-token-1")
    assert load_config(write(tmp_path, "")).replay.tokens() == (None, None)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "replay.token_file: cannot read token file"),
        ("writer writer-token-1\n", "replay.token_file: .* has no 'admin' token"),
        ("root admin-token-1\n", "replay.token_file: .*expected 'ROLE TOKEN'"),
    ],
)
def test_token_file_mistakes_name_the_key(tmp_path, content, message):
    tokens = tmp_path / "tokens"
    if content is not None:
        tokens.write_text(content)
    config = load_config(write(tmp_path, ""), [f"replay.token_file={tokens}"])
    with pytest.raises(InvalidConfigError, match=message):
        config.replay.tokens()


def test_tls_is_true_false_or_a_certificate_file(tmp_path):
    cert = tmp_path / "ca.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    assert load_config(write(tmp_path, ""), ["replay.tls=true"]).replay.tls is True
    assert load_config(write(tmp_path, ""), ["replay.tls=false"]).replay.tls is None
    assert load_config(write(tmp_path, ""), [f"replay.tls={cert}"]).replay.tls == str(cert)
    with pytest.raises(InvalidConfigError, match="replay.tls: .*is not a file"):
        load_config(write(tmp_path, ""), [f"replay.tls={tmp_path / 'missing.pem'}"])


def test_learner_and_placement_options(tmp_path):
    config = load_config(
        write(tmp_path, ""),
        [
            "learner.num_learners=2",
            "learner.num_gpus=1",
            "learner.device=cuda",
            "learner.resources={learner_node: 1}",
            "actors.label_selector={ray.io/node-group: cpu}",
            "replay.resources={replay_node: 0.5}",
        ],
    )
    assert config.learner.num_learners == 2 and config.learner.device == "cuda"
    assert config.learner.resources == {"learner_node": 1}
    assert config.actors.label_selector == {"ray.io/node-group": "cpu"}
    assert config.replay.resources == {"replay_node": 0.5}
    assert LaunchConfig().learner.num_learners == 1 and LaunchConfig().learner.device == "auto"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("learner.num_learners=0", "learner.num_learners: 0 must be >= 1"),
        ("learner.device=gpu", "learner.device: 'gpu' is not one of auto, cpu, cuda"),
        ("learner.device=cuda", "learner.device: 'cuda' needs learner.num_gpus > 0"),
        ("learner.num_cpus=-1", "learner.num_cpus: -1.0 must be >= 0"),
        ("learner.resources={GPU: 1}", "learner.resources.GPU: set learner.num_cpus"),
        ("actors.resources={env_node: many}", "actors.resources.env_node: expected a number"),
        ("replay.label_selector={zone: 1}", "replay.label_selector.zone: expected a string"),
    ],
)
def test_learner_and_placement_mistakes_name_the_field(tmp_path, override, message):
    with pytest.raises(InvalidConfigError) as e:
        load_config(write(tmp_path, ""), [override])
    assert str(e.value).startswith(message), str(e.value)


def test_rainbow_actors_and_learner_build_the_same_dueling_network():
    import gymnasium as gym

    from millpond.actors import make_policy
    from millpond.deploy.env_fleet import actor_config
    from millpond.deploy.learner_actor import make_learner
    from millpond.learner.networks import DuelingQ

    config = load_config(CONFIGS / "cartpole-rainbow.yaml")
    actor = actor_config(config, "replay", "mlp")
    assert actor.policy == "millpond.learner.networks:mlp_q"
    assert actor.policy_kwargs == {"hidden": (120, 84), "dueling": True}
    env = gym.make("CartPole-v1")
    spaces = env.observation_space, env.action_space
    env.close()
    learner = make_learner(config, None, "replay", *spaces, version=-1)
    assert isinstance(learner.q_network, DuelingQ)
    policy = make_policy(actor.policy, *spaces, 1, policy_kwargs=actor.policy_kwargs)
    policy.module.load_state_dict(learner.q_network.state_dict())  # the same parameters


@pytest.mark.parametrize("dueling", [False, True])
def test_a_relu_q_network_is_built_alike_for_actors_and_learner(dueling):
    import gymnasium as gym
    from torch import nn

    from millpond.actors import make_policy
    from millpond.deploy.env_fleet import actor_config
    from millpond.deploy.learner_actor import make_learner

    overrides = ["learner.activation=relu", f"learner.dueling={str(dueling).lower()}"]
    config = load_config(CONFIGS / "cartpole-dqn.yaml", overrides)
    actor = actor_config(config, "replay", "mlp")
    env = gym.make("CartPole-v1")
    spaces = env.observation_space, env.action_space
    env.close()
    learner = make_learner(config, None, "replay", *spaces, version=-1)
    policy = make_policy(actor.policy, *spaces, 1, policy_kwargs=actor.policy_kwargs)
    for net in (learner.q_network, policy.module):
        kinds = {type(m) for m in net.modules()}
        assert nn.ReLU in kinds and nn.Tanh not in kinds
    policy.module.load_state_dict(learner.q_network.state_dict())  # the same parameters
    obs = torch.randn(5, 4)
    assert torch.equal(policy.module(obs), learner.q_network(obs))


def test_activation_is_for_dqn_mlp_q_networks(tmp_path):
    with pytest.raises(InvalidConfigError, match=r"learner.activation: 'gelu' is not one of"):
        load_config(CONFIGS / "cartpole-dqn.yaml", ["learner.activation=gelu"])
    with pytest.raises(InvalidConfigError, match=r"learner.activation: it sets DQN's"):
        load_config(CONFIGS / "cartpole-ppo.yaml", ["learner.activation=relu"])
    with pytest.raises(InvalidConfigError, match=r"learner.activation: it sets DQN's"):
        load_config(
            CONFIGS / "cartpole-dqn.yaml", ["learner.activation=relu", "learner.network=nature_cnn"]
        )


def test_init_is_for_dqn_mlp_q_networks_and_reaches_the_learners_network():
    import gymnasium as gym
    from torch import nn

    from millpond.deploy.learner_actor import make_learner

    with pytest.raises(InvalidConfigError, match=r"learner.init: 'xavier' is not one of"):
        load_config(CONFIGS / "cartpole-dqn.yaml", ["learner.init=xavier"])
    with pytest.raises(InvalidConfigError, match=r"learner.init: it sets DQN's"):
        load_config(CONFIGS / "cartpole-ppo.yaml", ["learner.init=torch"])
    with pytest.raises(InvalidConfigError, match=r"learner.init: it sets DQN's"):
        overrides = ["learner.init=torch", "learner.activation=tanh", "learner.network=nature_cnn"]
        load_config(CONFIGS / "cartpole-dqn.yaml", overrides)
    env = gym.make("CartPole-v1")
    spaces = env.observation_space, env.action_space
    env.close()
    for init, zero_biases in (("orthogonal", True), ("torch", False)):
        config = load_config(CONFIGS / "cartpole-dqn.yaml", [f"learner.init={init}"])
        q = make_learner(config, None, "replay", *spaces, version=-1).q_network
        biases = [m.bias for m in q.modules() if isinstance(m, nn.Linear)]
        assert all(not b.any() for b in biases) == zero_biases


def test_apex_priorities_are_for_dqn_on_a_prioritized_table(tmp_path):
    uniform = (
        "learner: {algorithm: dqn}\nreplay: {table: {name: t, sampler: uniform, capacity: 100}}\n"
    )
    with pytest.raises(InvalidConfigError, match=r"actors.apex_priorities: .* dqn on a 'uniform'"):
        load_config(write(tmp_path, uniform + "actors: {apex_priorities: true}\n"))
    job = (
        "learner: {algorithm: dqn, dqn: {prioritized: true, gamma: 0.9, priority_eps: 0.01}}\n"
        "replay: {table: {name: t, sampler: prioritized, capacity: 100}}\n"
        "actors: {apex_priorities: true}\n"
    )
    config = load_config(write(tmp_path, job))
    assert actor_config(config, "t", "mlp").priorities == ApexPriorities(0.9, 1, 0.01)
    assert actor_config(LaunchConfig(), "t", "mlp").priorities is None


def test_sac_takes_a_uniform_table_and_mlp_networks(tmp_path):
    sac = "learner: {algorithm: sac}\n"  # the default table is a queue
    with pytest.raises(InvalidConfigError, match=r"replay.table.sampler: sac needs a uniform"):
        load_config(write(tmp_path, sac))
    uniform = sac + "replay: {table: {name: t, sampler: uniform, capacity: 100}}\n"
    assert load_config(write(tmp_path, uniform)).learner.sac.batch_size == 256
    with pytest.raises(InvalidConfigError, match=r"learner.network: sac's networks are MLPs"):
        load_config(write(tmp_path, uniform), ["learner.network=nature_cnn"])
    with pytest.raises(InvalidConfigError, match=r"learner.sac.tau \(0.0\) must be > 0"):
        load_config(write(tmp_path, uniform), ["learner.sac.tau=0.0"])


def test_pendulum_sac_actors_run_the_learners_policy_network():
    """The actors build SAC's squashed Gaussian policy with the learner's widths, and
    sample it (not its mode) while they collect."""
    config = load_config(CONFIGS / "pendulum-sac.yaml")
    actor = actor_config(config, "replay", "mlp")
    assert actor.policy == "millpond.learner.box_networks:mlp_sac_actor"
    assert actor.policy_kwargs == {"hidden": (256, 256)}
    assert actor.deterministic is False and actor.epsilon is None


def test_pendulum_td3_actors_act_the_policy_with_gaussian_noise(tmp_path):
    config = load_config(CONFIGS / "pendulum-td3.yaml")
    actor = actor_config(config, "replay", "mlp")
    assert actor.policy == "millpond.learner.box_networks:mlp_td3_actor"
    assert actor.deterministic is True and actor.noise == GaussianNoise(0.1)
    assert config.learner.td3.policy_delay == 2
    with pytest.raises(InvalidConfigError, match=r"actors.exploration_noise: .*td3.* \(here sac\)"):
        load_config(CONFIGS / "pendulum-sac.yaml", ["actors.exploration_noise=0.1"])
    with pytest.raises(InvalidConfigError, match=r"actors.exploration_noise: -0.1 must be >= 0"):
        load_config(CONFIGS / "pendulum-td3.yaml", ["actors.exploration_noise=-0.1"])


def test_td3_actors_take_ornstein_uhlenbeck_noise():
    td3 = CONFIGS / "pendulum-td3.yaml"
    actor = actor_config(load_config(td3, ["actors.noise_type=ou"]), "replay", "mlp")
    assert actor.noise == OrnsteinUhlenbeckNoise(0.1, 0.15, 0.01)  # exploration_noise: sigma
    tuned = load_config(td3, ["actors.noise_type=ou", "actors.ou_theta=0.3", "actors.ou_dt=0.05"])
    assert tuned.actors.action_noise() == OrnsteinUhlenbeckNoise(0.1, 0.3, 0.05)


@pytest.mark.parametrize(
    ("config", "overrides", "message"),
    [
        ("pendulum-sac.yaml", ["actors.noise_type=ou"], r"actors.noise_type: 'ou' needs actors.exploration_noise"),
        ("pendulum-sac.yaml", ["actors.noise_type=ou", "actors.exploration_noise=0.2"], r"actors.exploration_noise: .*\(here sac\)"),
        ("pendulum-td3.yaml", ["actors.noise_type=pink"], r"actors.noise_type: 'pink' is not one of gaussian, ou"),
        ("pendulum-td3.yaml", ["actors.ou_theta=0.3"], r"actors.ou_theta: for Ornstein-Uhlenbeck noise"),
        ("pendulum-td3.yaml", ["actors.noise_type=ou", "actors.ou_dt=0"], r"actors.ou_dt: 0.0 must be > 0"),
        ("pendulum-sac.yaml", ["replay.table.sampler=prioritized"], r"learner.sac.prioritized must be true"),
        ("pendulum-td3.yaml", ["learner.td3.prioritized=true"], r"learner.td3.prioritized must be true .*'uniform'"),
        ("cartpole-dqn.yaml", ["learner.ppo.normalize_observations=true"], r"learner.ppo.normalize_observations: .* for ppo \(here dqn\)"),
        ("pendulum-sac.yaml", ["learner.ppo.normalize_observations=true"], r"learner.ppo.normalize_observations: .*\(here sac\)"),
    ],
)  # fmt: skip
def test_keys_of_another_algorithm_are_refused_by_name(config, overrides, message):
    with pytest.raises(InvalidConfigError, match=message):
        load_config(CONFIGS / config, overrides)


def test_prioritized_sac_and_td3_and_normalised_ppo_load():
    for name in ("pendulum-sac.yaml", "pendulum-td3.yaml"):
        algo = name.split("-")[1].split(".")[0]
        config = load_config(
            CONFIGS / name, ["replay.table.sampler=prioritized", f"learner.{algo}.prioritized=true"]
        )
        assert config.replay.table_config().has_priorities
    ppo = load_config(CONFIGS / "pendulum-ppo.yaml", ["learner.ppo.normalize_observations=true"])
    actor = actor_config(ppo, "rollouts", "mlp")
    assert actor.policy_kwargs == {"hidden": (64, 64), "normalize_observations": True}


def test_observation_normalisation_is_refused_before_ray_for_discrete_observations(tmp_path):
    from millpond.deploy.preflight import check_job

    job = "env: {id: FrozenLake-v1}\nlearner: {ppo: {normalize_observations: true}}\n"
    with pytest.raises(InvalidConfigError, match=r"learner.ppo.normalize_observations: .*Discrete"):
        check_job(load_config(write(tmp_path, job)))


def test_the_fleets_mean_return_averages_run_return_window_episodes():
    """``run.return_window`` is the window of the fleet's mean return (the progress line's
    return and ``run.stop_at_return``'s test), not the fleet's default of 100 episodes."""
    config = load_config(CONFIGS / "pendulum-sac.yaml")
    assert config.run.return_window == 10
    assert fleet_options(config)["window"] == 10
    assert fleet_options(load_config(CONFIGS / "cartpole-ppo.yaml"))["window"] == 100


def test_a_resumed_job_keeps_observation_normalisation(tmp_path):
    """The checkpoint's policy holds the statistics (or not): a resumed job cannot switch."""
    import yaml

    from millpond.deploy.launch_config import resume_config

    ppo = load_config(CONFIGS / "pendulum-ppo.yaml")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_mapping(ppo), sort_keys=False))
    with pytest.raises(InvalidConfigError, match=r"learner.ppo.normalize_observations: False"):
        resume_config(tmp_path, overrides=["learner.ppo.normalize_observations=true"])
    config, changes = resume_config(tmp_path, overrides=["run.frames=300000"])
    assert config.run.frames == 300000
    assert changes == ["run.frames: 200000 -> 300000"]
