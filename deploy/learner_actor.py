"""LearnerActor: one learner process of ``millpond launch``, placed by Ray.

The launching process (the driver) starts ``learner.num_learners`` of these Ray actors and
only supervises them: it calls :meth:`LearnerActor.run` over and over (each call trains for
up to a second and reports), and :meth:`LearnerActor.checkpoint` now and then. With more than
one learner, rank 0 reports its node's address and a free port, every rank joins one
``torch.distributed`` group there (:meth:`LearnerActor.start`), and the ranks train data-
parallel (see :mod:`millpond.learner.distributed`): rank 0 publishes the weights and writes
the checkpoint. Every decision to stop a :meth:`~LearnerActor.run` call is taken together,
so the ranks always leave a call after the same number of steps.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import io
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from millpond.deploy.config_mapping import to_mapping
from millpond.deploy.launch_config import LaunchConfig
from millpond.deploy.learner_cores import cores_of_this_process, pin_this_process
from millpond.errors import (
    DeadlineExceededError,
    InvalidConfigError,
    InvalidDataError,
    ShardUnavailableError,
)

__all__ = ["LearnerActor", "make_learner", "where"]

#: Seconds one :meth:`LearnerActor.run` call trains before it reports (the driver's view of
#: the learners is at most this old).
RUN_S = 0.5


def where(_instance: Any = None) -> dict[str, Any]:
    """The Ray node this process runs on: ``node_id`` and ``ip``, and the process's ``pid``
    and the ``cores`` it may run on (for the run summary).

    Takes (and ignores) an actor instance, so that it can run inside any actor through
    ``handle.__ray_call__.remote(where)``.
    """
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "cores": cores_of_this_process(),
    }


def make_learner(
    config: LaunchConfig,
    client: Any,
    table: str,
    obs_space: Any,
    act_space: Any,
    *,
    device: torch.device | str = "cpu",
    data_parallel: bool = False,
    version: int | None = None,
) -> Any:
    """The job's :class:`~millpond.learner.PPOLearner`, :class:`~millpond.learner.DQNLearner`
    or :class:`~millpond.learner.SACLearner`, its networks built for the env's spaces and moved to ``device``; ``version``: the last
    published weight version (``None``: the one the service holds)."""
    from millpond.learner.dqn import DQNLearner
    from millpond.learner.networks import (
        mlp_critic,
        mlp_policy,
        mlp_q,
        nature_cnn_actor_critic,
        nature_cnn_q,
        network_for,
    )
    from millpond.learner.obs_norm import ObservationNormalized
    from millpond.learner.ppo import PPOLearner

    c = config.learner
    hidden = tuple(c.hidden_sizes)
    try:
        network = network_for(obs_space, c.network)
    except InvalidConfigError as e:
        raise InvalidConfigError(f"learner.network: {e}") from None
    cnn = network == "nature_cnn"
    if c.algorithm in ("sac", "td3"):
        return _make_actor_critic(
            config, client, table, obs_space, act_space, cnn, device, data_parallel, version
        )
    # Short sample waits keep each run call close to its time and responsive to the driver.
    if c.algorithm == "ppo":
        cfg = replace(c.ppo, sample_timeout_s=c.ppo.sample_timeout_s or 2.0)
        if cnn and cfg.normalize_observations:
            raise InvalidConfigError(
                "learner.ppo.normalize_observations: for the MLP on Box observations; these "
                "observations take the Nature CNN (learner.network: auto)"
            )
        if cnn:
            policy, critic = nature_cnn_actor_critic(obs_space, act_space)
        else:
            policy = mlp_policy(obs_space, act_space, hidden, cfg.normalize_observations)
            critic = mlp_critic(obs_space, hidden)
            if cfg.normalize_observations:
                critic = ObservationNormalized(critic, policy.normalizer)
        policy, critic = policy.to(device), critic.to(device)
        return PPOLearner(
            client, table, cfg, policy, critic, data_parallel=data_parallel, version=version
        )
    cfg = replace(c.dqn, sample_timeout_s=c.dqn.sample_timeout_s or 2.0)
    if cnn and c.dueling:
        raise InvalidConfigError(
            "learner.dueling: the dueling head is for the MLP Q-network; these observations "
            "take the Nature CNN (learner.network: auto)"
        )
    for key, value, default in (
        ("activation", c.activation, "tanh"),
        ("init", c.init, "orthogonal"),
    ):
        if cnn and value != default:
            raise InvalidConfigError(
                f"learner.{key}: it sets the MLP Q-network; these observations take the "
                "Nature CNN (learner.network: auto)"
            )
    q = (
        nature_cnn_q(obs_space, act_space)
        if cnn
        else mlp_q(obs_space, act_space, hidden, c.dueling, c.activation, c.init)
    )
    return DQNLearner(
        client, table, cfg, q.to(device), data_parallel=data_parallel, version=version
    )


def _make_actor_critic(
    config: LaunchConfig,
    client: Any,
    table: str,
    obs_space: Any,
    act_space: Any,
    cnn: bool,
    device: torch.device | str,
    data_parallel: bool,
    version: int | None,
) -> Any:
    """:func:`make_learner` for ``sac`` (the squashed Gaussian policy) and ``td3`` (the
    deterministic one), each with the twin critic."""
    from millpond.learner.box_networks import TwinQ, mlp_sac_actor, mlp_td3_actor
    from millpond.learner.sac import SACLearner
    from millpond.learner.td3 import TD3Learner

    c = config.learner
    if cnn:
        raise InvalidConfigError(
            f"learner.network: {c.algorithm}'s networks are MLPs; these observations take "
            "the Nature CNN (learner.network: auto)"
        )
    hidden = tuple(c.hidden_sizes)
    make_policy, learner, algo = (
        (mlp_sac_actor, SACLearner, c.sac)
        if c.algorithm == "sac"
        else (mlp_td3_actor, TD3Learner, c.td3)
    )
    cfg = replace(algo, sample_timeout_s=algo.sample_timeout_s or 2.0)
    policy = make_policy(obs_space, act_space, hidden).to(device)
    critic = TwinQ(obs_space, act_space, hidden).to(device)
    return learner(
        client,
        table,
        cfg,
        policy,
        critic,
        act_space,
        data_parallel=data_parallel,
        version=version,
    )


#: The module of each ``learner.algorithm``'s learner.
_LEARNER_MODULES = {
    "ppo": "millpond.learner.ppo",
    "dqn": "millpond.learner.dqn",
    "sac": "millpond.learner.sac",
    "td3": "millpond.learner.td3",
}


def _import_learner(algorithm: str) -> None:
    """Import what building the ``algorithm``'s learner imports: its module, its networks'
    and torch's compiler front end (``torch._dynamo``, ~1.5 s of CPU), which making any
    ``torch.optim`` optimizer imports. The actor's ``__init__`` runs while the shards start
    (:meth:`LearnerActor.start` waits for them), so these leave the job's startup path."""
    for name in ("millpond.learner.networks", _LEARNER_MODULES.get(algorithm)):
        if name is not None:
            importlib.import_module(name)
    if algorithm in ("sac", "td3"):
        importlib.import_module("millpond.learner.box_networks")
    importlib.import_module("torch._dynamo")


class LearnerActor:
    """The body of one learner Ray actor (``ray.remote(LearnerActor)``).

    The actor is made before the replay service is up (its process imports torch and
    builds nothing yet while the shards start); :meth:`start` connects it.

    Args:
        config: the job's config.
        obs_space: the env's (wrapped) observation space.
        act_space: the env's action space.
        rank: this learner's rank, ``0`` to ``world_size - 1``.
        world_size: learners in the job.
        cores: the cores this process runs on (``learner.pin_cores``); ``None``: any.
    """

    def __init__(
        self,
        config: LaunchConfig,
        obs_space: Any,
        act_space: Any,
        *,
        rank: int = 0,
        world_size: int = 1,
        cores: Sequence[int] | None = None,
    ) -> None:
        from millpond.allocator import keep_freed_buffers

        if cores is not None:  # before torch starts its threads: they inherit it
            pin_this_process(cores)
        keep_freed_buffers()  # its batches are message-sized buffers
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = _device(config.learner.device)
        torch.manual_seed(config.run.seed)  # the same initial networks on every rank
        torch.set_num_threads(config.learner.threads)
        self._spaces = (obs_space, act_space)
        self.client: Any = None
        self.steps = 0
        self.learner: Any = None
        self._group = False
        _import_learner(config.learner.algorithm)

    def describe(self) -> dict[str, Any]:
        """Where this learner runs: node id and IP, rank, device, the GPUs Ray gave it."""
        import ray

        return {
            **where(),
            "rank": self.rank,
            "device": str(self.device),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def rendezvous(self) -> tuple[str, int]:
        """An address and a free port of this node for the group to meet at (rank 0)."""
        ip = where()["ip"]
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def start(
        self,
        addresses: str,
        table: str,
        master: tuple[str, int] | None = None,
        restore: bytes | None = None,
        version: int | None = None,
        *,
        token: str | None = None,
        tls: bool | str | None = None,
        resolver: Any = None,
    ) -> None:
        """Connect to the replay service and join the group at ``master`` (all ranks at
        once; none with one learner), then build the learner, every rank starting from rank
        0's parameters, or from the checkpoint ``restore`` (the bytes of a
        ``checkpoint.pt``: networks and optimizer). The weight version goes on from
        ``version``, or (``None``) from the one the service holds.

        Args:
            addresses: the replay service's shard addresses.
            table: the table the learner samples.
            token: the replay service's ``admin`` token, if it requires one.
            tls: the replay service's TLS setting (see ``replay.tls``).
            resolver: where each shard is now (a shard restarted on another port, or lost;
                see :class:`~millpond.deploy.replay_actor.ShardAddresses`).
        """
        from millpond.learner.client import ReplayClient

        self.client = _Counting(ReplayClient(addresses, token=token, tls=tls, resolver=resolver))
        data_parallel = self.world_size > 1
        if data_parallel:
            import torch.distributed as dist

            assert master is not None, "a group of several learners needs rank 0's address"
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend,
                init_method=f"tcp://{master[0]}:{master[1]}",
                rank=self.rank,
                world_size=self.world_size,
            )
            self._group = True
        obs_space, act_space = self._spaces
        self.learner = make_learner(
            self.config,
            self.client,
            table,
            obs_space,
            act_space,
            device=self.device,
            data_parallel=data_parallel,
            version=version,
        )
        if restore is not None:
            state = torch.load(io.BytesIO(restore), map_location=self.device, weights_only=False)
            for name, module in self._modules().items():
                module.load_state_dict(state[name])
            self.learner.optimizer.load_state_dict(state["optimizer"])
        if data_parallel:
            from millpond.learner.distributed import broadcast_parameters

            broadcast_parameters(self._modules().values())

    def publish(self) -> int:
        """Publish the initial weights (every rank counts the version; rank 0 sends)."""
        return self.learner.publish()

    def run(self, seconds: float = RUN_S) -> dict[str, Any]:
        """Train for about ``seconds``; what happened meanwhile.

        Returns ``rank``, ``steps`` (learner steps that trained), ``dropped`` (stale steps,
        PPO), ``sample_s`` / ``update_s``, ``publish_wait_s`` (publications waiting for the
        actors, DQN's ``max_policy_lag``), ``sample_age`` (in versions; PPO's policy lag),
        ``sample_age_steps`` (in gradient steps) and ``loss`` (means over the steps, or
        ``None``), ``version`` (the last published weight version), ``unavailable_shards``
        (the shards its client finds unreachable now) and ``unavailable_s`` (seconds its
        samples and publications waited on an unreachable shard).
        """
        from millpond.learner.distributed import any_true

        deadline = time.monotonic() + seconds
        steps = dropped = 0
        sample_s = update_s = publish_wait_s = 0.0
        # Seconds waiting on an unreachable shard: an iterator's here, the rest counted by
        # the client (_Counting).
        unavailable_s, unavailable_before = 0.0, self.client.unavailable_s
        ages: list[float] = []
        age_steps: list[float] = []
        losses: list[float] = []
        while True:
            stop = time.monotonic() >= deadline
            if self._group:
                stop = any_true(stop, self.device)  # every rank leaves at the same step
            if stop:
                break
            t0 = time.perf_counter()
            try:
                metrics = self.learner.step()
            except DeadlineExceededError:  # not enough new experience yet
                sample_s += time.perf_counter() - t0
                continue
            except ShardUnavailableError:  # every shard down (one restarting): wait for it
                time.sleep(0.2)
                sample_s += time.perf_counter() - t0
                unavailable_s += time.perf_counter() - t0
                continue
            sample_s += metrics["sample_s"]
            update_s += metrics["update_s"]
            steps += 1
            self.steps += 1
            dropped += metrics.get("dropped", 0)
            publish_wait_s += metrics.get("publish_wait_s", 0.0)
            # DQN names the age of its replayed steps; PPO's is the lag it drops steps by
            age = metrics.get("sample_age_mean", metrics.get("policy_lag_mean"))
            if age is not None:
                ages.append(age)
            age_s = metrics.get("sample_age_steps_mean", metrics.get("policy_lag_steps_mean"))
            if age_s is not None:
                age_steps.append(age_s)
            loss = metrics.get("loss", metrics.get("loss_policy"))
            if loss is not None:
                losses.append(float(loss))
        return {
            "rank": self.rank,
            "steps": steps,
            "dropped": dropped,
            "sample_s": sample_s,
            "update_s": update_s,
            "publish_wait_s": publish_wait_s,
            "sample_age": sum(ages) / len(ages) if ages else None,
            "sample_age_steps": sum(age_steps) / len(age_steps) if age_steps else None,
            "loss": sum(losses) / len(losses) if losses else None,
            "version": self.learner.version,
            "unavailable_shards": self.client.unavailable_shards,
            "unavailable_s": unavailable_s + self.client.unavailable_s - unavailable_before,
        }

    def checkpoint(self, path: str, return_bytes: bool = False) -> bytes | None:
        """Write the learner checkpoint to ``path`` (on this node) atomically; with
        ``return_bytes``, also return its bytes, for a driver on another node to keep."""
        learner = self.learner
        if hasattr(learner, "flush"):  # its version stored before the checkpoint names it
            learner.flush()
        state = {
            "algorithm": self.config.learner.algorithm,
            "version": learner.version,
            "optimizer": learner.optimizer.state_dict(),
            "config": to_mapping(self.config),
            "num_learners": self.world_size,
        }
        for name, module in self._modules().items():
            state[name] = module.state_dict()
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".pt.tmp")
        tmp.write_bytes(data)
        tmp.replace(target)
        return data if return_bytes else None

    def report(self) -> dict[str, Any]:
        """This rank's totals for the run summary: ``rank``, ``steps``, ``published`` (weight
        publications it sent), ``version``, ``parameters_sha256`` (a digest of its
        parameters: equal on every rank of a healthy group) and ``colocated_shards`` (the
        shards whose rows it read from their files on its host; queue tables stay on the
        wire)."""
        digest = hashlib.sha256()
        for module in self._modules().values():
            for p in module.parameters():
                digest.update(p.detach().cpu().contiguous().numpy().tobytes())
        return {
            "rank": self.rank,
            "steps": self.steps,
            "published": self.client.published if self.client is not None else 0,
            "version": self.learner.version if self.learner is not None else None,
            "parameters_sha256": digest.hexdigest(),
            "colocated_shards": (
                self.client.colocated_shards(self.learner.table) if self.learner is not None else []
            ),
        }

    def close(self) -> bool:
        """Cancel prefetched samples (and wait for a publication in flight), leave the
        group, close the client; an error of the learner's is raised after."""
        try:
            if self.learner is not None and hasattr(self.learner, "close"):
                self.learner.close()
        finally:
            if self._group:
                import torch.distributed as dist

                dist.destroy_process_group()
                self._group = False
            if self.client is not None:
                self.client.close(timeout_s=5)
        return True

    def _modules(self) -> dict[str, torch.nn.Module]:
        names = (
            "policy",
            "critic",
            "q_network",
            "target_network",
            "target_critic",
            "target_policy",
            "temperature",
        )
        modules = {n: getattr(self.learner, n, None) for n in names}
        return {n: m for n, m in modules.items() if isinstance(m, torch.nn.Module)}


#: How long a publication waits for the weights rendezvous (shard 0, or the lowest-numbered
#: shard not lost for good) while Ray restarts it.
PUBLISH_WAIT_S = 60.0


class _Counting:
    """The learner's client, counting the weight publications it sends, and riding out a
    shard that Ray restarts: a sample that finds every shard down is a sample that timed
    out (in a data-parallel group every rank learns it together), and a publication waits
    for the weights rendezvous to come back (up to :data:`PUBLISH_WAIT_S`), or goes to the
    next shard once the rendezvous is lost for good."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.published = 0
        self.unavailable_s = 0.0  # samples and publications that found no shard to answer

    def sample(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        try:
            return self._client.sample(*args, **kwargs)
        except ShardUnavailableError as e:
            time.sleep(0.2)  # not a busy loop while the shards come back
            self.unavailable_s += time.monotonic() - t0
            raise DeadlineExceededError(f"no shard reachable now: {e}") from e

    def publish_weights(self, state_dict: Any, version: int, **kwargs: Any) -> int:
        return self._riding_out(
            lambda: self._client.publish_weights(state_dict, version, **kwargs), version
        )

    def publish_weights_later(self, state_dict: Any, version: int, **kwargs: Any) -> Any:
        """The call is asked now; its ``result()`` rides out a restarting shard as
        :meth:`publish_weights` does (``state_dict`` must stay as it is until then)."""
        call = self._client.publish_weights_later(state_dict, version, **kwargs)
        again = functools.partial(self._client.publish_weights, state_dict, version, **kwargs)
        return _Answer(lambda: self._riding_out(call.result, version, again))

    def _riding_out(
        self, publish: Callable[[], int], version: int, again: Callable[[], int] | None = None
    ) -> int:
        """``publish()``, asked again (``again()``, else ``publish()``) while the weights
        rendezvous is unavailable, up to :data:`PUBLISH_WAIT_S`."""
        deadline = time.monotonic() + PUBLISH_WAIT_S
        retried = False
        while True:
            t0 = time.monotonic()
            try:
                version = publish()
                break
            except ShardUnavailableError:
                if time.monotonic() > deadline:
                    raise
                retried = True
                publish = again or publish
                time.sleep(0.5)
                self.unavailable_s += time.monotonic() - t0
            except InvalidDataError:
                # The shard stored the publication and died before it answered: the
                # restarted shard serves this version already (its weights are on disk).
                if not retried or self._client.info().get("weights_version") != version:
                    raise
                break
        self.published += 1
        return version

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class _Answer:
    """A publication's answer, waited for once by ``result()`` (what ``get`` returns)."""

    def __init__(self, get: Callable[[], int]) -> None:
        self._get = get

    def result(self) -> int:
        return self._get()


def _device(setting: str) -> torch.device:
    """The learner's device: ``auto`` is CUDA when Ray gave this process a GPU."""
    import ray

    gpus = ray.get_gpu_ids() if ray.is_initialized() else []
    if setting == "cuda" or (setting == "auto" and gpus):
        if not torch.cuda.is_available():
            raise InvalidConfigError(
                f"learner.device: {setting!r} but CUDA is not available to this learner "
                f"(Ray gave it GPUs {gpus}; is torch built with CUDA?)"
            )
        return torch.device("cuda")
    return torch.device("cpu")
