"""Value estimators over what :meth:`ReplayClient.sample` returns: GAE, TD(λ), n-step TD.

They read the segment layout directly. A queue batch is flat ``[N]``: whole segments in
order, each a run of one episode's consecutive steps that ends at a termination, a
truncation or a chunk cut (marked ``("next", "truncated")`` in the batch);
:func:`trajectory_ends` finds where each run stops. A slices
batch is ``[B, K]``: every row one episode's consecutive steps. Single transitions
(uniform and prioritized tables) are ``[N]`` rows that stand alone.

Bootstrapping follows the TED flags. A terminated step has no future:
``V(s_{t+1}) = 0``. A truncated step, or the last step before a cut, bootstraps from
``V(s_{t+1})`` of its real next observation, ``("next", obs)`` (the segment's tail), which
is what the caller passes as ``next_value``. Names and recursions are those of the papers
(GAE: Schulman et al. 2016, eq. 16; TD(λ): Sutton & Barto, ch. 12) and of CleanRL's loop.

The recursions run as a log-depth scan: ``y_t = x_t + c_t y_{t+1}`` is solved in
about ``log2 L`` vectorised doubling steps, ``L`` the longest trajectory of the batch;
``O(N log L)`` work and ``O(N)`` memory, no padding, on any device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import NestedKey, TensorDictBase

__all__ = ["gae", "gae_from_batch", "n_step_return", "td_lambda_return", "trajectory_ends"]

_FLAGS = ("reward", "done", "terminated", "truncated")


def trajectory_ends(batch: TensorDictBase) -> torch.Tensor:
    """Where each row's trajectory stops: bool, shaped like ``batch`` (time = last dim).

    Row ``t`` ends where ``("next", "done")`` is set: its episode ended, or the batch's
    trajectory stops there (a sampled batch sets ``("next", "truncated")`` at each queue
    segment's last step, each slice's last step and every single transition, as TorchRL's
    estimators need); or when row ``t + 1`` is not the next step of the same episode
    (another ``"episode_id"``, or ``"step"`` not ``step + 1``), for batches built by hand;
    the last row always ends. So these estimators and TorchRL's agree on every batch the
    service returns.
    """
    done = batch.get(("next", "done"), None)
    if done is None:
        done = batch["next", "terminated"] | batch["next", "truncated"]
    shape = batch.shape
    done = done.reshape(shape)
    episode, step = batch["episode_id"], batch["step"]
    continues = (episode[..., 1:] == episode[..., :-1]) & (step[..., 1:] == step[..., :-1] + 1)
    last = torch.ones(*shape[:-1], 1, dtype=torch.bool, device=done.device)
    return done | torch.cat([~continues, last], dim=-1)


def gae(
    reward: torch.Tensor,
    value: torch.Tensor,
    next_value: torch.Tensor,
    terminated: torch.Tensor,
    ends: torch.Tensor,
    gamma: float,
    lmbda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation: ``(advantage, value_target)``, shaped like ``value``.

    Rows are read in time order (flattened, so ``[N]``, ``[N, 1]`` and ``[B, K]`` with
    ``ends`` set at each row's last column all work); ``value = V(s_t)``,
    ``next_value = V(s_{t+1})`` of the real next observation::

        delta_t = r_t + gamma * V(s_{t+1}) * (1 - terminated_t) - V(s_t)
        A_t     = delta_t + gamma * lmbda * (1 - end_t) * A_{t+1}

    ``end_t`` is ``ends`` (see :func:`trajectory_ends`), a termination, or the last row.
    ``value_target = A_t + V(s_t)``.
    """
    r, v, v_next, term, end = _flat(reward, value, next_value, terminated, ends)
    end = _stops(end.bool() | term.bool())
    not_terminal = 1.0 - term.to(v.dtype)
    delta = r + gamma * v_next * not_terminal - v
    advantage = _reverse_scan(delta, gamma * lmbda * (1.0 - end.to(v.dtype)))
    advantage = advantage.reshape(value.shape)
    return advantage, advantage + value


def td_lambda_return(
    reward: torch.Tensor,
    next_value: torch.Tensor,
    terminated: torch.Tensor,
    ends: torch.Tensor,
    gamma: float,
    lmbda: float,
) -> torch.Tensor:
    """The TD(λ) return ``G^λ_t``, shaped like ``next_value`` (rows in time order, as :func:`gae`)::

        G_t = r_t + gamma * (1 - terminated_t) * ((1 - lmbda) * V(s_{t+1}) + lmbda * G_{t+1})

    with ``G_{t+1}`` replaced by ``V(s_{t+1})`` where the trajectory ends (``ends``, a
    termination, the last row). Equals ``gae(...)[1]`` when ``next_value[t] == value[t + 1]``
    inside trajectories.
    """
    r, v_next, term, end = _flat(reward, next_value, terminated, ends)
    not_terminal = 1.0 - term.to(v_next.dtype)
    end = _stops(end.bool() | term.bool()).to(v_next.dtype)
    # G_t = x_t + c_t G_{t+1}: the bootstrap terms go in x_t, the recursion in c_t.
    x = r + gamma * not_terminal * ((1.0 - lmbda) + lmbda * end) * v_next
    c = gamma * lmbda * not_terminal * (1.0 - end)
    return _reverse_scan(x, c).reshape(next_value.shape)


def n_step_return(
    reward: torch.Tensor,
    next_value: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    gamma: float,
    n: int,
    ends: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """n-step TD return and its bootstrap discount: ``(G_t, gamma**m * (1 - terminated))``::

        G_t = sum_{k<m} gamma^k r_{t+k} + gamma^m (1 - terminated_{t+m-1}) V(s_{t+m})

    ``m <= n`` rewards are summed, stopping after an episode end (terminated or truncated)
    and at the end of the trajectory; ``V(s_{t+m})`` is ``next_value[t + m - 1]``, the
    value of the real next observation of the last step summed. ``next_value`` may come
    from any network (a target network, a double-DQN choice): the discount returned lets
    a learner rebuild the target with other values,
    ``G_t - discount * next_value[t + m - 1]`` being the summed rewards.

    Layouts (a trailing dim of 1 is accepted, outputs are shaped like ``reward``):

    - ``ends=None``: ``[B, K]`` slices, time along the last dim, each row one
      trajectory; ``[N]`` is ``N`` single transitions (``m = 1``).
    - ``ends`` given (e.g. :func:`trajectory_ends` of a queue batch): the rows are read
      flattened in time order and trajectories stop after every True.

    Vectorised over all rows, ``n`` steps of ``O(N)`` work.
    """
    if n < 1:
        raise ValueError(f"n ({n}) must be >= 1")
    shape = reward.shape
    if ends is None:
        base = shape[:-1] if len(shape) > 1 and shape[-1] == 1 else shape
        ends = torch.zeros(base, dtype=torch.bool, device=reward.device)
        if len(base) <= 1:
            ends[...] = True  # single transitions
        else:
            ends[..., -1] = True
    r, v_next, term, trunc, end = _flat(reward, next_value, terminated, truncated, ends)
    end = _stops(end.bool() | term.bool() | trunc.bool())
    t = torch.arange(len(r), device=r.device)
    # The first end at or after t, by a reverse running minimum of the end positions.
    end_pos = torch.where(end, t, len(r) - 1)
    next_end = end_pos.flip(0).cummin(0).values.flip(0)
    m = torch.clamp(next_end - t + 1, max=n)
    G = torch.zeros_like(r)
    for k in range(n):
        used = k < m
        G = G + torch.where(used, gamma**k * r[torch.clamp(t + k, max=len(r) - 1)], 0.0)
    last = t + m - 1
    discount = gamma ** m.to(r.dtype) * (1.0 - term[last].to(r.dtype))
    G = G + discount * v_next[last]
    return G.reshape(shape), discount.reshape(shape)


def gae_from_batch(
    batch: TensorDictBase,
    critic: Callable,
    gamma: float,
    lmbda: float,
    *,
    obs_key: NestedKey | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over a sampled batch: runs ``critic``, returns ``(advantage, value_target)``.

    ``critic`` maps observations to values ``[..., 1]``: it receives the observation
    entries as a TensorDict (and may return one holding ``"state_value"``, as a TorchRL
    ``ValueOperator`` does), or ``batch[obs_key]`` when ``obs_key`` is given. It runs once,
    under ``torch.no_grad()``, on every row's observation and on the real next observation
    of the rows where a trajectory ends (inside a trajectory ``s_{t+1}`` is the next row's
    observation). Writes ``"state_value"``, ``"advantage"`` and ``"value_target"`` into
    ``batch``, the keys TorchRL's ``ClipPPOLoss`` reads.
    """
    ends = trajectory_ends(batch)
    with torch.no_grad():
        value, next_value = _values(batch, critic, ends.reshape(-1), obs_key)
    advantage, value_target = gae(
        batch["next", "reward"].reshape(value.shape),
        value,
        next_value,
        batch["next", "terminated"],
        ends,
        gamma,
        lmbda,
    )
    batch.set("state_value", value)
    batch.set("advantage", advantage)
    batch.set("value_target", value_target)
    return advantage, value_target


def _values(
    batch: TensorDictBase, critic: Callable, ends: torch.Tensor, obs_key: NestedKey | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``V(s_t)`` for every row and ``V(s_{t+1})``, shaped ``[*batch.shape, ...]``."""
    flat = batch.reshape(-1)
    n = flat.shape[0]
    tails = ends.nonzero().squeeze(-1)
    if obs_key is not None:
        key = (obs_key,) if isinstance(obs_key, str) else tuple(obs_key)
        obs = torch.cat([flat.get(key), flat.get(("next", *key))[tails]])
    else:
        root = set(flat.keys(include_nested=True, leaves_only=True))
        keys = [
            k
            for k in flat["next"].keys(include_nested=True, leaves_only=True)
            if k not in _FLAGS and k in root
        ]
        obs = torch.cat([flat.select(*keys), flat["next"].select(*keys)[tails]])
    out = critic(obs)
    if isinstance(out, TensorDictBase):
        out = out["state_value"]
    value = out[:n]
    next_value = value.roll(-1, 0)  # inside a trajectory, V(s_{t+1}) is the next row's V
    next_value[tails] = out[n:]
    feature = tuple(out.shape[1:])
    return value.reshape(*batch.shape, *feature), next_value.reshape(*batch.shape, *feature)


def _flat(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Flatten to ``[N]`` (time order), checking that every input has ``N`` elements."""
    n = tensors[0].numel()
    for x in tensors:
        if x.numel() != n:
            shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
            raise ValueError(f"estimator inputs differ in size: {shapes}")
    return [x.reshape(-1) for x in tensors]


def _stops(end: torch.Tensor) -> torch.Tensor:
    """``end`` with the last row set: it has no successor in the batch."""
    return torch.cat([end[:-1], end.new_ones(min(1, len(end)))])


def _reverse_scan(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Solve ``y_t = x_t + c_t y_{t+1}`` (``y_N = 0``) over ``[N]`` by recursive doubling.

    After the step of span ``k``, ``y_t`` sums ``x`` over ``[t, t + 2k)`` and ``a_t`` is the
    product of ``c`` there; it stops once every ``a_t`` is zero (all trajectories covered).
    Coefficients below ``sqrt(tiny)`` (about ``1e-19`` in float32) are flushed to zero, so
    that no product of two of them is subnormal: subnormal arithmetic is about a hundred
    times slower on CPUs, and what is dropped weighs less than ``1e-19`` of ``y_{t+k}``.
    """
    floor = torch.finfo(c.dtype).tiny ** 0.5 if c.is_floating_point() else 0
    y, a = x, c.masked_fill(c.abs() < floor, 0)
    k = 1
    while k < len(x) and bool(a.any()):
        y = y + a * _shift(y, k)
        a = a * _shift(a, k)
        a = a.masked_fill(a.abs() < floor, 0)
        k *= 2
    return y


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x[t + k]``, zero past the end."""
    return torch.cat([x[k:], x.new_zeros(min(k, len(x)))])
