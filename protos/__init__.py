"""millpond.protos — the wire contract between shards and clients.

``millpond.proto`` defines the Replay service; ``millpond_pb2*`` are generated from it by
``python protos/generate.py`` (never edited by hand). Around them, one module per concept:
:mod:`.codec` (tensors and TensorDicts to and from messages, never pickled), :mod:`.tables`
(table configs, specs and info), :mod:`.status` (errors to and from gRPC status codes) and
:mod:`.weights` (how a weights blob is chunked). It imports only the ground floor.
"""
