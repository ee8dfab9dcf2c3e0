"""millpond.actors — the env side: the collection loop, experience processors, Ray actors.

:class:`Collector` steps a gymnasium vector env with a policy (:mod:`.policies`) in chunks
of ``[P, T]`` real steps, cuts them into segments (:mod:`millpond.segmenting`, re-exported
here), passes them through experience processors (:mod:`.processors`) and writes what they
return to a sink (a :class:`millpond.Writer`, or an in-process
:class:`millpond.service.TableSink`). The loop imports no Ray; the Ray actor
(:mod:`.ray_actor`) and the fleet (:mod:`.fleet`) wrap it and reach shards only through a
:class:`millpond.ReplayClient`.
"""

from millpond.roles import SegmentSink, WeightSource
from millpond.segmenting import cut_batch, ends_episode, from_ted, join, to_ted
from millpond.ted import observation_keys

from .apex import ApexPriorities
from .collector import Collector
from .episode_ids import (
    EPISODES_PER_INCARNATION,
    HINDSIGHT_EPISODE_OFFSET,
    INCARNATIONS_PER_ACTOR,
    MAX_ACTORS,
    episode_id_base,
)
from .episode_stats import ReturnTracker
from .lanes import LaneBuffer
from .policies import (
    ActorPolicy,
    EpsilonGreedy,
    GaussianNoise,
    ModulePolicy,
    OrnsteinUhlenbeckNoise,
    PolicySpec,
    RandomPolicy,
    load_factory,
    make_policy,
)
from .processors import (
    EpisodeAnnotator,
    EpisodeFilter,
    EpisodeProcessor,
    ExperienceProcessor,
    HindsightRelabeler,
    PassThrough,
    ProcessorChain,
    StepFilter,
)

__all__ = [
    "EPISODES_PER_INCARNATION",
    "HINDSIGHT_EPISODE_OFFSET",
    "INCARNATIONS_PER_ACTOR",
    "MAX_ACTORS",
    "ActorConfig",
    "ActorFleet",
    "ActorPolicy",
    "ApexPriorities",
    "Collector",
    "EnvActor",
    "EpisodeAnnotator",
    "EpisodeFilter",
    "EpisodeProcessor",
    "EpsilonGreedy",
    "ExperienceProcessor",
    "FleetStatus",
    "GaussianNoise",
    "HindsightRelabeler",
    "LaneBuffer",
    "ModulePolicy",
    "OrnsteinUhlenbeckNoise",
    "PassThrough",
    "PolicySpec",
    "ProcessorChain",
    "RandomPolicy",
    "ReturnTracker",
    "SegmentSink",
    "StepFilter",
    "WeightSource",
    "cut_batch",
    "ends_episode",
    "episode_id_base",
    "from_ted",
    "join",
    "load_factory",
    "make_policy",
    "observation_keys",
    "to_ted",
]

# The Ray layer is imported on first use, so that the loop itself never loads Ray.
_RAY_NAMES = {
    "ActorConfig": "ray_actor",
    "EnvActor": "ray_actor",
    "ActorFleet": "fleet",
    "FleetStatus": "fleet",
}


def __getattr__(name: str):
    if name in _RAY_NAMES:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_RAY_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
