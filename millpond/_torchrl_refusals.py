"""What :mod:`millpond.torchrl`'s buffers do not take from TorchRL's API, and what to use
instead: constructor arguments and attributes of TorchRL's replay buffers that a millpond
table answers in its own way, or not at all.

Each refusal names the TorchRL argument or attribute and says what to use: the table is the
storage, its sampler and its writers live in the service, so nothing here can be honoured
by a local stand-in without being silently different.
"""

from __future__ import annotations

from millpond.errors import InvalidConfigError, MillpondError


class TorchRLUnsupportedError(MillpondError, NotImplementedError, AttributeError):
    """A TorchRL replay-buffer argument, attribute or method that a millpond table cannot
    honour; the message says what to use instead.

    It is an ``AttributeError`` too, so that ``getattr(rb, name, default)`` and ``hasattr``
    (which TorchRL's collectors use to probe a buffer's storage) see the attribute as absent.
    """


_TABLE = "the millpond table is the storage: give a TableConfig (its capacity) as `table`"

#: TorchRL constructor arguments and why a millpond buffer refuses them.
CONSTRUCTOR_ADVICE: dict[str, str] = {
    "storage": _TABLE,
    "sampler": (
        "the table samples: TableConfig.uniform(...) for ReplayBuffer, "
        "TableConfig.prioritized(...) for PrioritizedReplayBuffer"
    ),
    "writer": "the service writes: every extend goes through the client's writer for the table",
    "collate_fn": "samples come collated, as TED TensorDicts: use `transform` to change them",
    "pin_memory": "call .pin_memory() on the sampled batch (or in a `transform`)",
    "dim_extend": "extend takes [T], [P, T] and [B, P, T] batches, time on the last axis",
    "generator": "sampling is seeded by the table: TableConfig(..., seed=...)",
    "shared": "every process reaches the table through its own client: no sharing is needed",
    "compilable": "the buffer's calls are remote calls; compile the loss, not the buffer",
    "delayed_init": "a millpond buffer holds nothing to initialise: construct it where it is used",
    "transform_factory": "pass the transform itself as `transform`",
    "consume_after_n_samples": "use a queue table and ReplayClient.sample to consume each step once",
    "sample_unit": "use a slices table (TableConfig.slices) and ReplayClient.sample",
    "storage_device": "move the sampled batch with .to(device) (or in a `transform`)",
    "service_backend": "the millpond service is the backend: pass its address",
    "service_backend_options": "the millpond service is the backend: pass its address",
    "transport": "the client speaks gRPC to the shards",
    "transport_options": "pass client options (token, tls, ...) to a ReplayClient and give it",
    "max_priority_within_buffer": "new steps get the table's largest priority so far",
    "dtype": "priorities are float64 in the table",
    "device": "move the sampled batch with .to(device) (or in a `transform`)",
}

#: TorchRL attributes and methods of a buffer a millpond table does not have, and what to
#: use instead.
ATTRIBUTE_ADVICE: dict[str, str] = {
    "storage": _TABLE + "; read it with rb.client.read_table(rb.table) or rb.dumps(path)",
    "sampler": "the table samples in the service; rb.client.info(rb.table)['config'] says how",
    "_sampler": "the table samples in the service",
    "writer": "the service writes: rb.extend / rb.add, or rb.client.writer(rb.table)",
    "_writer": "the service writes: rb.extend / rb.add",
    "set_storage": _TABLE,
    "set_sampler": "create another table (TableConfig) and a buffer over it",
    "set_writer": "writers belong to the client: rb.client.writer(rb.table)",
    "set_rng": "sampling is seeded by the table: TableConfig(..., seed=...)",
    "share": "every process reaches the table through its own client: no sharing is needed",
    "shared": "every process reaches the table through its own client",
    "update_if_present": "stored steps are immutable; extend new data instead",
    "submit_update_if_present": "stored steps are immutable; extend new data instead",
    "query": "read the table with rb.client.read_table(rb.table)",
    "read_all_in_order": "read the table with rb.client.read_table(rb.table) or rb.dumps(path)",
    "write_all": "extend the data with rb.extend",
    "set_at_": "stored steps are immutable; extend new data instead",
    "set_": "stored steps are immutable; extend new data instead",
    "update_": "stored steps are immutable; extend new data instead",
    "mark_update": "stored steps are immutable; extend new data instead",
    "append_transform": "pass the transform (a Compose) as `transform` when constructing",
    "insert_transform": "pass the transform (a Compose) as `transform` when constructing",
    "register_save_hook": "rb.dumps writes a TED export; transform it after loading",
    "register_load_hook": "rb.loads extends a TED export; transform it before",
    "start": "the service runs on its own: `millpond serve`",
    "shutdown": "close the buffer's client with rb.close(); the service runs on",
    "synchronize": "every call returns once the service answered: nothing to synchronize",
    "can_sample": "a sample waits for the table's rate limiter: see TableConfig.min_size",
    "stats": "rb.client.info(rb.table)",
    "prioritized_sampler": "the table samples in the service; rb.client.info(rb.table)['config']",
    "sample_unit": "use a slices table (TableConfig.slices) and ReplayClient.sample",
}


def check_constructor_kwargs(kwargs: dict[str, object], buffer: str) -> None:
    """Refuse TorchRL constructor arguments a millpond buffer does not take."""
    for name in kwargs:
        advice = CONSTRUCTOR_ADVICE.get(name)
        if advice is not None:
            raise TorchRLUnsupportedError(f"{buffer}({name}=...) is TorchRL's; {advice}")
        raise InvalidConfigError(f"{buffer} takes no argument {name!r}")


def missing_attribute(buffer: str, name: str) -> AttributeError:
    """The error for ``rb.<name>`` where the buffer has no such attribute."""
    advice = ATTRIBUTE_ADVICE.get(name)
    if advice is not None:
        return TorchRLUnsupportedError(f"{buffer}.{name} is TorchRL's; {advice}")
    return AttributeError(f"{buffer!r} object has no attribute {name!r}")
