from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_NONE: _ClassVar[Compression]
    COMPRESSION_ZSTD: _ClassVar[Compression]
COMPRESSION_NONE: Compression
COMPRESSION_ZSTD: Compression

class Tensor(_message.Message):
    __slots__ = ("key", "dtype", "shape", "data", "compression")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    key: _containers.RepeatedScalarFieldContainer[str]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    compression: Compression
    def __init__(self, key: _Optional[_Iterable[str]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., compression: _Optional[_Union[Compression, str]] = ...) -> None: ...

class TensorMap(_message.Message):
    __slots__ = ("batch_size", "tensors")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    batch_size: _containers.RepeatedScalarFieldContainer[int]
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, batch_size: _Optional[_Iterable[int]] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...

class FieldSpec(_message.Message):
    __slots__ = ("key", "dtype", "shape", "role")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    key: _containers.RepeatedScalarFieldContainer[str]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    role: str
    def __init__(self, key: _Optional[_Iterable[str]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., role: _Optional[str] = ...) -> None: ...

class TableConfig(_message.Message):
    __slots__ = ("name", "capacity", "sampler", "min_size", "samples_per_insert", "error_buffer", "alpha", "beta", "slice_len", "compression", "spec", "seed", "strict_length", "verify_reads", "frame_stacks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    MIN_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_INSERT_FIELD_NUMBER: _ClassVar[int]
    ERROR_BUFFER_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    SLICE_LEN_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STRICT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VERIFY_READS_FIELD_NUMBER: _ClassVar[int]
    FRAME_STACKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity: int
    sampler: str
    min_size: int
    samples_per_insert: float
    error_buffer: float
    alpha: float
    beta: float
    slice_len: int
    compression: str
    spec: _containers.RepeatedCompositeFieldContainer[FieldSpec]
    seed: int
    strict_length: bool
    verify_reads: bool
    frame_stacks: _containers.RepeatedCompositeFieldContainer[FrameStack]
    def __init__(self, name: _Optional[str] = ..., capacity: _Optional[int] = ..., sampler: _Optional[str] = ..., min_size: _Optional[int] = ..., samples_per_insert: _Optional[float] = ..., error_buffer: _Optional[float] = ..., alpha: _Optional[float] = ..., beta: _Optional[float] = ..., slice_len: _Optional[int] = ..., compression: _Optional[str] = ..., spec: _Optional[_Iterable[_Union[FieldSpec, _Mapping]]] = ..., seed: _Optional[int] = ..., strict_length: _Optional[bool] = ..., verify_reads: _Optional[bool] = ..., frame_stacks: _Optional[_Iterable[_Union[FrameStack, _Mapping]]] = ...) -> None: ...

class FrameStack(_message.Message):
    __slots__ = ("key", "frames")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    key: _containers.RepeatedScalarFieldContainer[str]
    frames: int
    def __init__(self, key: _Optional[_Iterable[str]] = ..., frames: _Optional[int] = ...) -> None: ...

class CreateTableRequest(_message.Message):
    __slots__ = ("config", "exist_ok")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    EXIST_OK_FIELD_NUMBER: _ClassVar[int]
    config: TableConfig
    exist_ok: bool
    def __init__(self, config: _Optional[_Union[TableConfig, _Mapping]] = ..., exist_ok: _Optional[bool] = ...) -> None: ...

class CreateTableResponse(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: TableConfig
    def __init__(self, config: _Optional[_Union[TableConfig, _Mapping]] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("sequence", "episode_id", "first_step", "steps", "tail", "priorities")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    episode_id: int
    first_step: int
    steps: TensorMap
    tail: TensorMap
    priorities: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sequence: _Optional[int] = ..., episode_id: _Optional[int] = ..., first_step: _Optional[int] = ..., steps: _Optional[_Union[TensorMap, _Mapping]] = ..., tail: _Optional[_Union[TensorMap, _Mapping]] = ..., priorities: _Optional[_Iterable[float]] = ...) -> None: ...

class PackedSegments(_message.Message):
    __slots__ = ("sequences", "episode_ids", "first_steps", "lengths", "steps", "tails", "frames", "priorities")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    EPISODE_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEPS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TAILS_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedScalarFieldContainer[int]
    episode_ids: _containers.RepeatedScalarFieldContainer[int]
    first_steps: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    steps: TensorMap
    tails: TensorMap
    frames: TensorMap
    priorities: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sequences: _Optional[_Iterable[int]] = ..., episode_ids: _Optional[_Iterable[int]] = ..., first_steps: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., steps: _Optional[_Union[TensorMap, _Mapping]] = ..., tails: _Optional[_Union[TensorMap, _Mapping]] = ..., frames: _Optional[_Union[TensorMap, _Mapping]] = ..., priorities: _Optional[_Iterable[float]] = ...) -> None: ...

class InsertRequest(_message.Message):
    __slots__ = ("writer_id", "table", "segments", "timeout_ms", "packed")
    WRITER_ID_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    writer_id: str
    table: str
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    timeout_ms: int
    packed: _containers.RepeatedCompositeFieldContainer[PackedSegments]
    def __init__(self, writer_id: _Optional[str] = ..., table: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., timeout_ms: _Optional[int] = ..., packed: _Optional[_Iterable[_Union[PackedSegments, _Mapping]]] = ...) -> None: ...

class InsertResponse(_message.Message):
    __slots__ = ("sequences", "stored_through", "max_message_bytes")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STORED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedScalarFieldContainer[int]
    stored_through: int
    max_message_bytes: int
    def __init__(self, sequences: _Optional[_Iterable[int]] = ..., stored_through: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("table", "batch_size", "num_batches", "timeout_ms", "colocated", "redraw")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    REDRAW_FIELD_NUMBER: _ClassVar[int]
    table: str
    batch_size: int
    num_batches: int
    timeout_ms: int
    colocated: bool
    redraw: bool
    def __init__(self, table: _Optional[str] = ..., batch_size: _Optional[int] = ..., num_batches: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., colocated: _Optional[bool] = ..., redraw: _Optional[bool] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("batch", "next_rows", "next_observations", "mass", "slot_observations", "colocated_rows")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROWS_FIELD_NUMBER: _ClassVar[int]
    NEXT_OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    MASS_FIELD_NUMBER: _ClassVar[int]
    SLOT_OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_ROWS_FIELD_NUMBER: _ClassVar[int]
    batch: TensorMap
    next_rows: _containers.RepeatedScalarFieldContainer[int]
    next_observations: TensorMap
    mass: float
    slot_observations: SlotObservations
    colocated_rows: ColocatedRows
    def __init__(self, batch: _Optional[_Union[TensorMap, _Mapping]] = ..., next_rows: _Optional[_Iterable[int]] = ..., next_observations: _Optional[_Union[TensorMap, _Mapping]] = ..., mass: _Optional[float] = ..., slot_observations: _Optional[_Union[SlotObservations, _Mapping]] = ..., colocated_rows: _Optional[_Union[ColocatedRows, _Mapping]] = ...) -> None: ...

class ColocatedRows(_message.Message):
    __slots__ = ("slots", "generations", "rows", "next_rows", "storage_token")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROWS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    slots: Tensor
    generations: Tensor
    rows: Tensor
    next_rows: Tensor
    storage_token: str
    def __init__(self, slots: _Optional[_Union[Tensor, _Mapping]] = ..., generations: _Optional[_Union[Tensor, _Mapping]] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ..., next_rows: _Optional[_Union[Tensor, _Mapping]] = ..., storage_token: _Optional[str] = ...) -> None: ...

class SlotObservations(_message.Message):
    __slots__ = ("observations", "rows", "next_rows")
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROWS_FIELD_NUMBER: _ClassVar[int]
    observations: TensorMap
    rows: Tensor
    next_rows: Tensor
    def __init__(self, observations: _Optional[_Union[TensorMap, _Mapping]] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ..., next_rows: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ConfigureTableRequest(_message.Message):
    __slots__ = ("table", "min_size", "samples_per_insert", "error_buffer", "alpha", "beta", "no_samples_per_insert")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    MIN_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_INSERT_FIELD_NUMBER: _ClassVar[int]
    ERROR_BUFFER_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    NO_SAMPLES_PER_INSERT_FIELD_NUMBER: _ClassVar[int]
    table: str
    min_size: int
    samples_per_insert: float
    error_buffer: float
    alpha: float
    beta: float
    no_samples_per_insert: bool
    def __init__(self, table: _Optional[str] = ..., min_size: _Optional[int] = ..., samples_per_insert: _Optional[float] = ..., error_buffer: _Optional[float] = ..., alpha: _Optional[float] = ..., beta: _Optional[float] = ..., no_samples_per_insert: _Optional[bool] = ...) -> None: ...

class ConfigureTableResponse(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: TableConfig
    def __init__(self, config: _Optional[_Union[TableConfig, _Mapping]] = ...) -> None: ...

class UpdatePrioritiesRequest(_message.Message):
    __slots__ = ("table", "slots", "generations", "priorities")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    table: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    generations: _containers.RepeatedScalarFieldContainer[int]
    priorities: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, table: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ..., generations: _Optional[_Iterable[int]] = ..., priorities: _Optional[_Iterable[float]] = ...) -> None: ...

class UpdatePrioritiesResponse(_message.Message):
    __slots__ = ("applied",)
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    applied: int
    def __init__(self, applied: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("config", "size", "mass", "inserts", "samples", "rate_limiter_diff", "rate_limiter_min_diff", "rate_limiter_max_diff", "bytes_on_disk", "next_generation", "dropped_segments", "host_id", "storage_dir", "storage_token", "blocked_inserts", "blocked_samples", "writers")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MASS_FIELD_NUMBER: _ClassVar[int]
    INSERTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMITER_DIFF_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMITER_MIN_DIFF_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMITER_MAX_DIFF_FIELD_NUMBER: _ClassVar[int]
    BYTES_ON_DISK_FIELD_NUMBER: _ClassVar[int]
    NEXT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    STORAGE_DIR_FIELD_NUMBER: _ClassVar[int]
    STORAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_INSERTS_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WRITERS_FIELD_NUMBER: _ClassVar[int]
    config: TableConfig
    size: int
    mass: float
    inserts: int
    samples: int
    rate_limiter_diff: float
    rate_limiter_min_diff: float
    rate_limiter_max_diff: float
    bytes_on_disk: int
    next_generation: int
    dropped_segments: int
    host_id: str
    storage_dir: str
    storage_token: str
    blocked_inserts: int
    blocked_samples: int
    writers: int
    def __init__(self, config: _Optional[_Union[TableConfig, _Mapping]] = ..., size: _Optional[int] = ..., mass: _Optional[float] = ..., inserts: _Optional[int] = ..., samples: _Optional[int] = ..., rate_limiter_diff: _Optional[float] = ..., rate_limiter_min_diff: _Optional[float] = ..., rate_limiter_max_diff: _Optional[float] = ..., bytes_on_disk: _Optional[int] = ..., next_generation: _Optional[int] = ..., dropped_segments: _Optional[int] = ..., host_id: _Optional[str] = ..., storage_dir: _Optional[str] = ..., storage_token: _Optional[str] = ..., blocked_inserts: _Optional[int] = ..., blocked_samples: _Optional[int] = ..., writers: _Optional[int] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("tables", "weights_version", "refused_tables")
    class RefusedTablesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TABLES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    REFUSED_TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    weights_version: int
    refused_tables: _containers.ScalarMap[str, str]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ..., weights_version: _Optional[int] = ..., refused_tables: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReadTableRequest(_message.Message):
    __slots__ = ("table", "max_message_bytes")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    table: str
    max_message_bytes: int
    def __init__(self, table: _Optional[str] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class TableSnapshot(_message.Message):
    __slots__ = ("config", "segments", "steps")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    config: TableConfig
    segments: int
    steps: int
    def __init__(self, config: _Optional[_Union[TableConfig, _Mapping]] = ..., segments: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class SnapshotEnd(_message.Message):
    __slots__ = ("segments", "steps", "overwritten_segments", "overwritten_steps", "cut_segments", "cut_steps")
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    OVERWRITTEN_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    OVERWRITTEN_STEPS_FIELD_NUMBER: _ClassVar[int]
    CUT_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    CUT_STEPS_FIELD_NUMBER: _ClassVar[int]
    segments: int
    steps: int
    overwritten_segments: int
    overwritten_steps: int
    cut_segments: int
    cut_steps: int
    def __init__(self, segments: _Optional[int] = ..., steps: _Optional[int] = ..., overwritten_segments: _Optional[int] = ..., overwritten_steps: _Optional[int] = ..., cut_segments: _Optional[int] = ..., cut_steps: _Optional[int] = ...) -> None: ...

class ReadTableResponse(_message.Message):
    __slots__ = ("snapshot", "segments", "end")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    snapshot: TableSnapshot
    segments: PackedSegments
    end: SnapshotEnd
    def __init__(self, snapshot: _Optional[_Union[TableSnapshot, _Mapping]] = ..., segments: _Optional[_Union[PackedSegments, _Mapping]] = ..., end: _Optional[_Union[SnapshotEnd, _Mapping]] = ...) -> None: ...

class PublishWeightsRequest(_message.Message):
    __slots__ = ("version", "total_size", "chunk", "max_lag")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    MAX_LAG_FIELD_NUMBER: _ClassVar[int]
    version: int
    total_size: int
    chunk: bytes
    max_lag: int
    def __init__(self, version: _Optional[int] = ..., total_size: _Optional[int] = ..., chunk: _Optional[bytes] = ..., max_lag: _Optional[int] = ...) -> None: ...

class PublishWeightsResponse(_message.Message):
    __slots__ = ("version", "waited_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    waited_s: float
    def __init__(self, version: _Optional[int] = ..., waited_s: _Optional[float] = ...) -> None: ...

class GetWeightsRequest(_message.Message):
    __slots__ = ("min_version", "timeout_ms", "actor", "acting")
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    ACTING_FIELD_NUMBER: _ClassVar[int]
    min_version: int
    timeout_ms: int
    actor: str
    acting: bool
    def __init__(self, min_version: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., actor: _Optional[str] = ..., acting: _Optional[bool] = ...) -> None: ...

class GetWeightsResponse(_message.Message):
    __slots__ = ("version", "total_size", "chunk")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    version: int
    total_size: int
    chunk: bytes
    def __init__(self, version: _Optional[int] = ..., total_size: _Optional[int] = ..., chunk: _Optional[bytes] = ...) -> None: ...
