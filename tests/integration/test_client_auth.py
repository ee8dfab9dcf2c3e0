"""Bearer-token roles end to end: ``millpond serve --token-file`` and ReplayClient(token=...).

Roles: a writer inserts and reads weights; a learner samples, updates priorities and
publishes weights; an admin does everything. No token or a wrong one is refused outright.
"""

import pytest
import torch

from millpond import (
    AuthenticationError,
    PermissionDeniedError,
    ReplayClient,
    TableConfig,
)

TOKENS = {"writer": "writer-secret-1", "learner": "learner-secret-1", "admin": "admin-secret-12"}


@pytest.fixture(scope="module")
def auth_server(module_server, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("auth") / "tokens"
    token_file.write_text(
        "# role token\n" + "".join(f"{role} {token}\n" for role, token in TOKENS.items())
    )
    return module_server("--token-file", str(token_file))


@pytest.fixture
def clients(auth_server):
    made = {role: ReplayClient(auth_server.address, token=tok) for role, tok in TOKENS.items()}
    made["none"] = ReplayClient(auth_server.address)
    made["wrong"] = ReplayClient(auth_server.address, token="not-a-real-token")
    yield made
    for client in made.values():
        client.close()


def write_some(client, table, exp, writer_id):
    with client.writer(table, writer_id=writer_id) as w:
        for seg, _ in exp.segments[0]:
            w.write_segment(seg.steps, seg.tail, seg.episode_id, seg.first_step)
        w.flush(timeout_s=30)


def test_roles(clients, table_name, make_experience, envs, rng):
    admin, writer, learner = clients["admin"], clients["writer"], clients["learner"]
    exp = make_experience()
    exp.add_rollout(envs["dict"](), 60, seed=0, episode_offset=0, rng=rng)
    config = TableConfig.prioritized(table_name, capacity=1_000)

    # Neither writers nor learners create tables.
    for role in ("writer", "learner"):
        with pytest.raises(PermissionDeniedError, match=role):
            clients[role].create_table(config)
    admin.create_table(config)

    # The writer writes and reads weights, but does not sample, publish or reset.
    write_some(writer, table_name, exp, "auth-writer")
    assert writer.info(table_name)["size"] == exp.num_steps
    with pytest.raises(PermissionDeniedError):
        writer.sample(table_name, 4)
    with pytest.raises(PermissionDeniedError):
        writer.publish_weights({"w": torch.ones(2)}, version=1)
    with pytest.raises(PermissionDeniedError):
        writer.reset(table_name)

    # The learner samples, updates priorities, publishes weights; it cannot insert.
    batch = learner.sample(table_name, 32)
    exp.check(batch, weights=True)
    assert learner.update_priorities(table_name, batch["index"], torch.ones(32)) == 32
    _, version = admin.get_weights()
    assert learner.publish_weights({"w": torch.arange(4.0)}, version=version + 1) == version + 1
    weights, got = writer.get_weights()
    assert got == version + 1 and torch.equal(weights["w"], torch.arange(4.0))
    w = learner.writer(table_name, writer_id="auth-learner-writer")
    seg = exp.segments[0][0][0]
    w.write_segment(seg.steps, seg.tail, 10**6, 0)
    with pytest.raises(PermissionDeniedError):
        w.flush(timeout_s=10)
    with pytest.raises(PermissionDeniedError):  # the refused writer keeps its error
        w.close()
    with pytest.raises(PermissionDeniedError):
        learner.checkpoint()

    # The admin does it all.
    exp.check(admin.sample(table_name, 16), weights=True)
    assert len(admin.checkpoint()) == 1
    assert admin.info(table_name)["size"] == exp.num_steps
    admin.reset(table_name)
    assert admin.info(table_name)["size"] == 0
    write_some(admin, table_name, exp, "auth-admin-writer")
    assert admin.info(table_name)["size"] == exp.num_steps


@pytest.mark.parametrize("who", ["none", "wrong"])
def test_no_or_wrong_token_is_refused(clients, table_name, make_experience, envs, rng, who):
    clients["admin"].create_table(TableConfig.uniform(table_name, capacity=1_000))
    client = clients[who]
    with pytest.raises(AuthenticationError):
        client.info(table_name)
    with pytest.raises(AuthenticationError):
        client.sample(table_name, 4)
    with pytest.raises(AuthenticationError):
        client.create_table(TableConfig.uniform(f"{table_name}-x", capacity=100))
    with pytest.raises(AuthenticationError):
        client.get_weights()
    exp = make_experience()
    exp.add_rollout(envs["cartpole"](), 10, seed=0, episode_offset=0, rng=rng)
    w = client.writer(table_name, writer_id=f"auth-{who}")
    seg = exp.segments[0][0][0]
    w.write_segment(seg.steps, seg.tail, seg.episode_id, seg.first_step)
    with pytest.raises(AuthenticationError):
        w.flush(timeout_s=10)
    with pytest.raises(AuthenticationError):
        w.close()
    assert clients["admin"].info(table_name)["size"] == 0
