"""The configuration of ``millpond launch``: YAML files parsed into frozen dataclasses.

A config file has one section per part of the job (``env``, ``replay``, ``actors``,
``learner``, ``run``, ``ray``), each a mapping of the fields of the dataclass below of
the same name; every field has a default, so a file names only what it changes. The
learner's hyperparameters are the fields of :class:`~millpond.learner.PPOConfig`,
:class:`~millpond.learner.DQNConfig`, :class:`~millpond.learner.SACConfig` or
:class:`~millpond.learner.TD3Config` (``learner.ppo`` / ``dqn`` / ``sac`` / ``td3``) and the
table is a
:class:`~millpond.TableConfig` mapping (``replay.table``), as in ``millpond serve
--tables``.

Unknown keys, wrong types and bad values raise :class:`~millpond.errors.InvalidConfigError`
with one line that names the key, e.g. ``learner.ppo.lr: expected a number, got 'fast'``.
``--set key=value`` overrides (``--set learner.ppo.lr=1e-3``) are applied to the parsed
YAML before it is checked, so they get the same errors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from millpond.actors.action_noise import GaussianNoise, OrnsteinUhlenbeckNoise
from millpond.actors.envs import (
    VECTORIZATION_MODES,
    WrapperSpec,
    check_vector_entry_point,
    check_wrappers,
)
from millpond.actors.processor_specs import ProcessorSpec, check_processors
from millpond.config import TableConfig
from millpond.deploy.algorithms import ALGORITHMS, check_sections
from millpond.deploy.config_files import read_config_doc
from millpond.deploy.config_mapping import from_mapping, to_mapping, value_kind
from millpond.errors import InvalidConfigError
from millpond.learner.dqn import DQNConfig
from millpond.learner.networks import INITS, NETWORKS
from millpond.learner.ppo import PPOConfig
from millpond.learner.sac import SACConfig
from millpond.learner.td3 import TD3Config
from millpond.service.auth import load_tokens

__all__ = [
    "FIXED_ON_RESUME",
    "ActorsSection",
    "EnvSection",
    "LaunchConfig",
    "LearnerSection",
    "RaySection",
    "ReplaySection",
    "RunSection",
    "load_config",
    "resume_config",
]


@dataclass(frozen=True)
class EnvSection:
    """The environment every actor steps.

    Attributes:
        id: a registered gymnasium id (``ALE/...`` ids need ``pip install 'millpond[atari]'``).
        kwargs: keyword arguments of ``gymnasium.make_vec`` (e.g. ``max_episode_steps``,
            ``frameskip``), passed to every lane's ``gymnasium.make``.
        vectorization_mode: ``"sync"``, ``"async"`` (one subprocess per lane) or
            ``"vector_entry_point"`` (the vector env the id registers, which steps its lanes
            in one call, e.g. CartPole-v1's; no wrappers).
        wrappers: gymnasium wrappers applied in order to every lane's env, each a mapping of
            ``path`` (``"package.module:Name"`` of a wrapper class, or of a callable taking
            the env first) and ``kwargs`` (its other keyword arguments), e.g.
            ``gymnasium.wrappers:AtariPreprocessing`` then
            ``gymnasium.wrappers:FrameStackObservation``. Each path is imported and its
            keyword arguments checked against its signature here; every actor builds its own.
    """

    id: str = "CartPole-v1"
    kwargs: dict[str, Any] = field(default_factory=dict)
    vectorization_mode: str = "sync"
    wrappers: list[WrapperSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        _choice("env.vectorization_mode", self.vectorization_mode, VECTORIZATION_MODES)
        check_wrappers(self.wrappers, "env.wrappers")  # bad specs fail before Ray
        if self.vectorization_mode == "vector_entry_point":
            try:
                check_vector_entry_point(self.id, None, self.wrappers)
            except InvalidConfigError as e:
                raise InvalidConfigError(f"env.{e}") from None


@dataclass(frozen=True)
class ReplaySection:
    """The replay service: shards started as Ray actors, and the table the job uses.

    Attributes:
        shards: shard servers to start (ignored with ``--replay``, which names running ones).
        table: a :class:`~millpond.TableConfig` mapping (``name``, ``sampler``, ``capacity``...).
        num_cpus: CPUs Ray reserves for each shard actor.
        max_message_mb: largest gRPC message a shard accepts or sends, in MiB.
        start_timeout_s: how long to wait for the shard actors to be placed and serving
            (on a cluster without the free CPUs Ray would otherwise wait forever).
        token_file: a file of ``ROLE TOKEN`` lines, as ``millpond serve --token-file``
            reads. The launching process (table, learner, checkpoints) uses its ``admin``
            token, the env actors its ``writer`` token (else the admin one). Shards the job
            starts require these tokens too (then the file must be readable at the same
            path on every node that hosts a shard).
        tls: for a ``--replay`` service that serves TLS: ``true`` (the system's root
            certificates) or a PEM root certificate file. Shards the job starts serve
            plaintext.
        resources: Ray custom resources each shard actor reserves, e.g. ``{replay_node: 1}``
            to keep the shards on the nodes started with ``--resources '{"replay_node": 4}'``.
        label_selector: Ray node labels a shard's node must have, e.g.
            ``{"ray.io/node-group": "replay"}``.
        max_restarts: how often Ray restarts a shard whose process died, on its own node
            and directory (it reopens its tables there). A shard whose restarts are spent,
            or whose node is gone, is lost: the job goes on with the other shards.
        metrics_port: each shard serves Prometheus metrics over HTTP (see
            ``millpond serve --metrics-port``): ``0`` on a free port, ``P`` on port
            ``P + i`` for shard ``i``; ``None`` (default): not at all. ``summary.json``'s
            ``shards`` records each shard's metrics address.
    """

    shards: int = 1
    table: dict[str, Any] = field(
        default_factory=lambda: {"name": "rollouts", "sampler": "queue", "capacity": 8192}
    )
    num_cpus: float = 0.25
    max_message_mb: int = 256
    start_timeout_s: float = 300.0
    token_file: str | None = None
    tls: bool | str | None = None
    resources: dict[str, float] = field(default_factory=dict)
    label_selector: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 3
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        _placement("replay", self.resources, self.label_selector)
        _at_least("replay.shards", self.shards, 1)
        _at_least("replay.max_restarts", self.max_restarts, 0)
        if self.metrics_port is not None and not (
            self.metrics_port >= 0 and self.metrics_port + self.shards <= 65536
        ):
            raise InvalidConfigError(
                f"replay.metrics_port: {self.metrics_port!r} must be 0 (free ports) or a base "
                f"port P with P + replay.shards <= 65536"
            )
        _at_least("replay.num_cpus", self.num_cpus, 0)
        _at_least("replay.start_timeout_s", self.start_timeout_s, 1)
        if self.tls is False:
            object.__setattr__(self, "tls", None)  # plaintext, as with no setting
        if self.tls is not None and self.tls is not True and not Path(self.tls).is_file():
            raise InvalidConfigError(
                f"replay.tls: {self.tls!r} is not a file (true, or a PEM root certificate)"
            )

    def tokens(self) -> tuple[str | None, str | None]:
        """``(admin token, writer token)`` from :attr:`token_file`; ``(None, None)`` without."""
        if self.token_file is None:
            return None, None
        try:
            tokens = load_tokens(self.token_file)
        except InvalidConfigError as e:
            raise InvalidConfigError(f"replay.token_file: {e}") from None
        by_role: dict[str, str] = {}
        for role, token in tokens:
            by_role.setdefault(role, token)
        if "admin" not in by_role:
            raise InvalidConfigError(
                f"replay.token_file: {self.token_file} has no 'admin' token (the launching "
                "process creates the table and checkpoints the shards)"
            )
        return by_role["admin"], by_role.get("writer", by_role["admin"])

    def table_config(self) -> TableConfig:
        """The table as a :class:`~millpond.TableConfig` (checked)."""
        try:
            return TableConfig.from_json(self.table)
        except InvalidConfigError as e:
            raise InvalidConfigError(f"replay.table: {e}") from None


@dataclass(frozen=True)
class ActorsSection:
    """The env actors (Ray actors around :class:`~millpond.actors.Collector`).

    Attributes:
        num_actors: actors to start.
        num_envs: env lanes per actor.
        chunk_len: steps per lane per chunk (a segment is at most this long).
        num_cpus: CPUs Ray reserves for each actor (fractions share a core).
        weight_sync_every: env steps between checks for newer policy weights.
        deterministic: act with the policy's mode (``argmax``) instead of sampling.
        epsilon_start: epsilon-greedy exploration at frame 0; ``None`` for none.
        epsilon_end: epsilon after ``epsilon_decay_frames`` frames (per actor).
        epsilon_decay_frames: frames over which epsilon decays linearly.
        exploration_noise: exploration noise for ``Box`` actions (TD3): its ``sigma`` in
            ``[-1, 1]`` units of each action element (the Gaussian's standard deviation,
            :class:`~millpond.actors.GaussianNoise`, or the Ornstein-Uhlenbeck process's
            diffusion scale); ``None`` for none.
        noise_type: ``"gaussian"`` (fresh draws every step) or ``"ou"``: an
            Ornstein-Uhlenbeck process per env lane, reset when its lane begins an episode
            (:class:`~millpond.actors.OrnsteinUhlenbeckNoise`, DDPG's exploration).
        ou_theta: the Ornstein-Uhlenbeck process's mean reversion; ``None``: 0.15.
        ou_dt: the Ornstein-Uhlenbeck process's time step; ``None``: 0.01.
        max_restarts: how often Ray restarts a crashed actor.
        max_in_flight: unacknowledged segments a writer allows before it blocks.
        apex_priorities: Ape-X (DQN on a prioritized table): each actor gives the steps it
            writes their initial priority, its own Q-network's absolute n-step TD error with
            the learner's ``gamma``, ``n_step`` and ``priority_eps``
            (:mod:`millpond.actors.apex`), instead of the largest priority so far.
        processors: experience processors every actor runs, in order, each a mapping of
            ``path`` (``"package.module:Name"`` of an
            :class:`~millpond.actors.ExperienceProcessor` class or a factory returning one)
            and ``kwargs``; a kwargs value ``{path: ..., kwargs: ...}`` is a callable (see
            :class:`~millpond.actors.processor_specs.ProcessorSpec`). Each is built once here to
            check it, and anew in every actor. Empty: every segment is stored as cut.
        resources: Ray custom resources each actor reserves (e.g. ``{env_node: 1}``).
        label_selector: Ray node labels an actor's node must have.
    """

    num_actors: int = 2
    num_envs: int = 8
    chunk_len: int = 32
    num_cpus: float = 0.5
    weight_sync_every: int = 32
    deterministic: bool = False
    epsilon_start: float | None = None
    epsilon_end: float = 0.05
    epsilon_decay_frames: int = 10_000
    exploration_noise: float | None = None
    noise_type: str = "gaussian"
    ou_theta: float | None = None
    ou_dt: float | None = None
    max_restarts: int = 3
    max_in_flight: int = 64
    apex_priorities: bool = False
    processors: list[ProcessorSpec] = field(default_factory=list)
    resources: dict[str, float] = field(default_factory=dict)
    label_selector: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _placement("actors", self.resources, self.label_selector)
        check_processors(self.processors, "actors.processors")  # bad specs fail before Ray
        for name in ("num_actors", "num_envs", "chunk_len", "weight_sync_every", "max_in_flight"):
            _at_least(f"actors.{name}", getattr(self, name), 1)
        for name in ("num_cpus", "max_restarts", "epsilon_decay_frames"):
            _at_least(f"actors.{name}", getattr(self, name), 0)
        for name in ("epsilon_start", "epsilon_end"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise InvalidConfigError(f"actors.{name}: {value!r} must be in [0, 1]")
        if self.exploration_noise is not None:
            _at_least("actors.exploration_noise", self.exploration_noise, 0)
        _choice("actors.noise_type", self.noise_type, ("gaussian", "ou"))
        if self.noise_type == "ou" and self.exploration_noise is None:
            raise InvalidConfigError(
                "actors.noise_type: 'ou' needs actors.exploration_noise (the process's sigma)"
            )
        for name in ("ou_theta", "ou_dt"):
            value = getattr(self, name)
            if value is not None and self.noise_type != "ou":
                raise InvalidConfigError(
                    f"actors.{name}: for Ornstein-Uhlenbeck noise (actors.noise_type: ou), "
                    f"here {self.noise_type!r}"
                )
        if self.ou_theta is not None:
            _at_least("actors.ou_theta", self.ou_theta, 0)
        if self.ou_dt is not None and not self.ou_dt > 0:
            raise InvalidConfigError(f"actors.ou_dt: {self.ou_dt!r} must be > 0")

    def action_noise(self) -> GaussianNoise | OrnsteinUhlenbeckNoise | None:
        """The exploration noise these settings name (``None``: none)."""
        if self.exploration_noise is None:
            return None
        if self.noise_type == "gaussian":
            return GaussianNoise(self.exploration_noise)
        defaults = OrnsteinUhlenbeckNoise()
        return OrnsteinUhlenbeckNoise(
            self.exploration_noise,
            defaults.theta if self.ou_theta is None else self.ou_theta,
            defaults.dt if self.ou_dt is None else self.ou_dt,
        )


@dataclass(frozen=True)
class LearnerSection:
    """The learner: ``num_learners`` Ray actors (one process each), data-parallel when more
    than one (a ``torch.distributed`` group: gloo on CPU, NCCL on GPU).

    Attributes:
        algorithm: ``"ppo"`` (queue table; ``Discrete`` or float ``Box`` actions) or
            ``"dqn"`` (uniform, prioritized or slices; ``Discrete`` actions); ``"sac"`` or
            ``"td3"`` (uniform or prioritized table) for ``Box`` actions.
            An env whose action space the algorithm cannot act in is refused before
            anything starts (:mod:`millpond.deploy.algorithms`).
        network: ``"mlp"``, ``"nature_cnn"`` (the Nature-DQN CNN on ``[C, H, W]`` frames;
            for PPO one torso shared by the policy and the critic) or ``"auto"`` (the
            default): the CNN for 3-D ``uint8`` observations (stacked Atari frames), the MLP
            otherwise (see :func:`millpond.learner.networks.network_for`).
        hidden_sizes: hidden layer widths of the MLPs (policy, critic or Q-network; SAC's
            and TD3's policy and each of their two Q-networks, with ReLU); the Nature CNN's
            fully connected layer is 512 wide.
        dueling: DQN's MLP Q-network with a dueling head
            (:class:`~millpond.learner.networks.DuelingQ`), for learner and actors alike.
        activation: between the layers of DQN's MLP Q-network: ``"tanh"`` (the default) or
            ``"relu"`` (CleanRL's DQN); the other algorithms' MLPs keep theirs.
        init: the initial weights of DQN's MLP Q-network: ``"orthogonal"`` (the default,
            CleanRL's PPO) or ``"torch"`` (``nn.Linear``'s own, CleanRL's DQN); see
            :class:`~millpond.learner.networks.MLP`.
        ppo: :class:`~millpond.learner.PPOConfig` fields.
        dqn: :class:`~millpond.learner.DQNConfig` fields.
        sac: :class:`~millpond.learner.SACConfig` fields.
        td3: :class:`~millpond.learner.TD3Config` fields.
        threads: torch intra-op threads of each learner (small machines: 1).
        pin_cores: ``"auto"`` (the default), ``true`` or ``false``: on a local Ray instance
            the job starts, each learner process runs on ``threads`` cores of its own (the
            machine's last ones) and every other process of the job (the driver, Ray's, the
            env actors', the shards') on the rest, so that none preempts a learner's update
            (:mod:`millpond.deploy.learner_cores`). ``"auto"`` does so where the machine has
            more cores than the learners take, and shares them on a cluster; ``true``
            refuses a job it cannot pin.
        checkpoint_every_s: seconds between learner checkpoints in the run directory.
        num_learners: learner processes; each samples its own batches, their gradients
            are averaged, rank 0 publishes the weights and writes the checkpoint.
        num_cpus: CPUs Ray reserves for each learner.
        num_gpus: GPUs Ray reserves for each learner (fractions share one).
        device: ``"auto"`` (CUDA when the learner got a GPU, else CPU), ``"cpu"`` or
            ``"cuda"`` (needs ``num_gpus`` > 0).
        start_timeout_s: how long to wait for the learners to be placed and ready.
        max_restarts: how often a lost learner (its process or node) is replaced: the driver
            starts the whole group anew from the last ``checkpoint.pt``; then the job stops.
        resources: Ray custom resources each learner reserves (e.g. ``{learner_node: 1}``).
        label_selector: Ray node labels a learner's node must have.
    """

    algorithm: str = "ppo"
    network: str = "auto"
    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    dueling: bool = False
    activation: str = "tanh"
    init: str = "orthogonal"
    ppo: PPOConfig = field(default_factory=PPOConfig)
    dqn: DQNConfig = field(default_factory=DQNConfig)
    sac: SACConfig = field(default_factory=SACConfig)
    td3: TD3Config = field(default_factory=TD3Config)
    threads: int = 1
    pin_cores: bool | str = "auto"
    checkpoint_every_s: float = 60.0
    num_learners: int = 1
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    device: str = "auto"
    start_timeout_s: float = 300.0
    max_restarts: int = 1
    resources: dict[str, float] = field(default_factory=dict)
    label_selector: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _placement("learner", self.resources, self.label_selector)
        _at_least("learner.max_restarts", self.max_restarts, 0)
        _at_least("learner.num_learners", self.num_learners, 1)
        _at_least("learner.num_cpus", self.num_cpus, 0)
        _at_least("learner.num_gpus", self.num_gpus, 0)
        _at_least("learner.start_timeout_s", self.start_timeout_s, 1)
        _choice("learner.device", self.device, ("auto", "cpu", "cuda"))
        if self.device == "cuda" and self.num_gpus <= 0:
            raise InvalidConfigError(
                "learner.device: 'cuda' needs learner.num_gpus > 0 (Ray hides the GPUs from "
                "a learner that reserves none)"
            )
        _choice("learner.algorithm", self.algorithm, tuple(ALGORITHMS))
        _choice("learner.network", self.network, NETWORKS)
        _at_least("learner.threads", self.threads, 1)
        if self.pin_cores not in (True, False, "auto"):
            raise InvalidConfigError(
                f"learner.pin_cores: {self.pin_cores!r} must be 'auto', true or false"
            )
        _at_least("learner.checkpoint_every_s", self.checkpoint_every_s, 1)
        for i, width in enumerate(self.hidden_sizes):
            _at_least(f"learner.hidden_sizes[{i}]", width, 1)
        if self.algorithm in ("sac", "td3") and self.network == "nature_cnn":
            raise InvalidConfigError(
                f"learner.network: {self.algorithm}'s networks are MLPs; 'nature_cnn' is for "
                "ppo and dqn"
            )
        # activation and init set DQN's MLP Q-network; the first choice is the default
        dqn_mlp = self.algorithm == "dqn" and self.network != "nature_cnn"
        for key, value, choices in (
            ("activation", self.activation, ("tanh", "relu")),
            ("init", self.init, INITS),
        ):
            _choice(f"learner.{key}", value, choices)
            if value != choices[0] and not dqn_mlp:
                raise InvalidConfigError(
                    f"learner.{key}: it sets DQN's MLP Q-network, not {self.algorithm} with "
                    f"network {self.network!r}"
                )
        if self.dueling and not dqn_mlp:
            raise InvalidConfigError(
                "learner.dueling: the dueling head is for DQN's MLP Q-network, not "
                f"{self.algorithm} with network {self.network!r}"
            )


@dataclass(frozen=True)
class RunSection:
    """The run: its budget, where it writes, how it reports.

    Attributes:
        frames: env steps (all actors together) to collect before stopping.
        dir: parent of the run directories; each run writes a new ``DIR/NAME-TIMESTAMP-XXXX``.
        status_every_s: seconds between progress lines (and metrics rows).
        return_window: episodes the reported mean return averages over.
        stop_at_return: stop early once the mean return reaches it; ``None``: never.
        seed: base seed of the actors and the learner.
        timeout_s: wall-clock limit of the run; ``None``: none.
        tensorboard: TensorBoard event files of the metrics rows in ``RUN_DIR/tensorboard``:
            ``"auto"`` (when the ``tensorboard`` package is installed), ``"on"`` (or an
            error naming the extra) or ``"off"``. ``metrics.csv`` is written either way.
        eval_episodes: episodes of each evaluation of the trained policy, played greedily
            in the driver process (:mod:`millpond.deploy.run_eval`); ``0`` (the default):
            none. With episodes, the run ends (its frames, return or time reached) by
            evaluating ``checkpoint.pt``, as ``millpond eval RUN_DIR`` does.
        eval_every_frames: also evaluate the latest published weights each time this many
            more frames were collected, beside the training; ``None``: only at the end.
    """

    frames: int = 200_000
    dir: str = "runs"
    status_every_s: float = 2.0
    return_window: int = 100
    stop_at_return: float | None = None
    seed: int = 0
    timeout_s: float | None = None
    tensorboard: str = "auto"
    eval_episodes: int = 0
    eval_every_frames: int | None = None

    def __post_init__(self) -> None:
        _choice("run.tensorboard", self.tensorboard, ("auto", "on", "off"))
        _at_least("run.eval_episodes", self.eval_episodes, 0)
        if self.eval_every_frames is not None:
            _at_least("run.eval_every_frames", self.eval_every_frames, 1)
            if self.eval_episodes == 0:
                raise InvalidConfigError(
                    "run.eval_every_frames: evaluating needs run.eval_episodes >= 1"
                )
        _at_least("run.frames", self.frames, 1)
        _at_least("run.return_window", self.return_window, 1)
        if self.status_every_s <= 0:
            raise InvalidConfigError(f"run.status_every_s: {self.status_every_s!r} must be > 0")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise InvalidConfigError(f"run.timeout_s: {self.timeout_s!r} must be > 0")


@dataclass(frozen=True)
class RaySection:
    """Where the job runs.

    Attributes:
        address: ``None`` starts a local Ray instance of the job's own, even when another
            Ray cluster runs on this machine (``RAY_ADDRESS`` and ``ray start`` are not
            followed); ``"auto"`` or ``"ray://host:port"`` joins a cluster.
        num_cpus: CPUs of the local instance; ``None``: all of this machine's.
    """

    address: str | None = None
    num_cpus: int | None = None

    def __post_init__(self) -> None:
        if self.num_cpus is not None:
            _at_least("ray.num_cpus", self.num_cpus, 1)


@dataclass(frozen=True)
class LaunchConfig:
    """A whole ``millpond launch`` job (see the module docstring)."""

    name: str = "run"
    env: EnvSection = field(default_factory=EnvSection)
    replay: ReplaySection = field(default_factory=ReplaySection)
    actors: ActorsSection = field(default_factory=ActorsSection)
    learner: LearnerSection = field(default_factory=LearnerSection)
    run: RunSection = field(default_factory=RunSection)
    ray: RaySection = field(default_factory=RaySection)

    def __post_init__(self) -> None:
        check_sections(self)  # the table and the other sections' keys fit the algorithm


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> LaunchConfig:
    """Read a YAML config, apply ``key=value`` overrides, and check it all."""
    return from_mapping(LaunchConfig, read_config_doc(path, overrides))


#: What a resumed job (``millpond launch --resume RUN_DIR``) must keep of the run's recorded
#: config: the env (the networks' spaces), the shards and their table (their directories
#: hold that table), and the learner's networks (the checkpoint holds their parameters).
FIXED_ON_RESUME: tuple[str, ...] = (
    "env",
    "replay.shards",
    "replay.table",
    "learner.algorithm",
    "learner.network",
    "learner.hidden_sizes",
    "learner.dueling",
    "learner.activation",
    "learner.ppo.normalize_observations",  # the policy's statistics are in the checkpoint
)


def resume_config(
    run_dir: str | Path, path: str | Path | None = None, overrides: Sequence[str] = ()
) -> tuple[LaunchConfig, list[str]]:
    """The config of a resumed job, and what it changes of the run's recorded config.

    The run directory's ``config.yaml`` with ``overrides`` applied, or (``path``) another
    config file with them, which must then agree with the recorded one on
    :data:`FIXED_ON_RESUME`. Returns the config and one ``"key: old -> new"`` line per
    changed value. Raises :class:`InvalidConfigError` naming the run directory and what
    differs.
    """
    recorded_path = Path(run_dir) / "config.yaml"
    if not recorded_path.is_file():
        raise InvalidConfigError(
            f"--resume {run_dir}: no config.yaml there (not the run directory of a "
            "millpond launch job)"
        )
    recorded = load_config(recorded_path)
    config = load_config(path if path is not None else recorded_path, overrides)
    changes = _differences(to_mapping(recorded), to_mapping(config))
    fixed = [
        (key, old, new)
        for key, old, new in changes
        if any(key == f or key.startswith(f"{f}.") for f in FIXED_ON_RESUME)
    ]
    if fixed:
        listed = "; ".join(f"{k}: {old!r} in the run, {new!r} now" for k, old, new in fixed)
        raise InvalidConfigError(
            f"--resume {run_dir}: the config differs from the run's config.yaml where a "
            f"resumed job must keep it ({listed}); keep {', '.join(FIXED_ON_RESUME)}"
        )
    return config, [f"{key}: {old!r} -> {new!r}" for key, old, new in changes]


def _differences(old: Any, new: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted key, old, new)`` of every value that differs between two mappings."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        out: list[tuple[str, Any, Any]] = []
        for key in list(old) + [k for k in new if k not in old]:
            where = f"{path}.{key}" if path else str(key)
            out += _differences(old.get(key), new.get(key), where)
        return out
    return [] if old == new else [(path, old, new)]


def _choice(path: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        raise InvalidConfigError(f"{path}: {value!r} is not one of {', '.join(options)}")


def _placement(section: str, resources: Mapping[str, Any], labels: Mapping[str, Any]) -> None:
    for name, amount in resources.items():
        if name in ("CPU", "GPU", "memory"):
            raise InvalidConfigError(
                f"{section}.resources.{name}: set {section}.num_cpus / num_gpus instead"
            )
        if isinstance(amount, bool) or not isinstance(amount, int | float) or amount < 0:
            raise InvalidConfigError(
                f"{section}.resources.{name}: expected a number >= 0, got {value_kind(amount)}"
            )
    for name, value in labels.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise InvalidConfigError(
                f"{section}.label_selector.{name}: expected a string, got {value_kind(value)}"
            )


def _at_least(path: str, value: Any, low: float) -> None:
    if value < low:
        raise InvalidConfigError(f"{path}: {value!r} must be >= {low}")
