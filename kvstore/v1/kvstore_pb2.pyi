from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Layout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "tp_rank", "tp_size", "hash_version", "scale_format")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_VERSION_FIELD_NUMBER: _ClassVar[int]
    SCALE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    tp_rank: int
    tp_size: int
    hash_version: int
    scale_format: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., hash_version: _Optional[int] = ..., scale_format: _Optional[str] = ...) -> None: ...

class OpenNamespaceRequest(_message.Message):
    __slots__ = ("model", "revision", "tenant", "layout", "priority")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    tenant: str
    layout: Layout
    priority: int
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., tenant: _Optional[str] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., priority: _Optional[int] = ...) -> None: ...

class OpenNamespaceResponse(_message.Message):
    __slots__ = ("handle", "seed", "block_bytes", "arena", "fingerprint", "max_keys_per_request", "max_chunk_bytes", "gpu")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    seed: bytes
    block_bytes: int
    arena: ArenaInfo
    fingerprint: bytes
    max_keys_per_request: int
    max_chunk_bytes: int
    gpu: DevicePoolInfo
    def __init__(self, handle: _Optional[bytes] = ..., seed: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., arena: _Optional[_Union[ArenaInfo, _Mapping]] = ..., fingerprint: _Optional[bytes] = ..., max_keys_per_request: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., gpu: _Optional[_Union[DevicePoolInfo, _Mapping]] = ...) -> None: ...

class DevicePoolInfo(_message.Message):
    __slots__ = ("device_uuid", "ipc_handle", "size_bytes", "token")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    device_uuid: bytes
    ipc_handle: bytes
    size_bytes: int
    token: bytes
    def __init__(self, device_uuid: _Optional[bytes] = ..., ipc_handle: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class ArenaInfo(_message.Message):
    __slots__ = ("path", "size_bytes", "token")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    token: bytes
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("handle", "keys", "table_keys", "table_found", "table_in_cpu", "release_leases")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TABLE_KEYS_FIELD_NUMBER: _ClassVar[int]
    TABLE_FOUND_FIELD_NUMBER: _ClassVar[int]
    TABLE_IN_CPU_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASES_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    keys: bytes
    table_keys: int
    table_found: int
    table_in_cpu: int
    release_leases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., table_keys: _Optional[int] = ..., table_found: _Optional[int] = ..., table_in_cpu: _Optional[int] = ..., release_leases: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: int
    def __init__(self, found: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("handle", "keys", "priority", "gpu", "table_reads", "release_leases")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    TABLE_READS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASES_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    keys: bytes
    priority: int
    gpu: bool
    table_reads: bytes
    release_leases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., priority: _Optional[int] = ..., gpu: _Optional[bool] = ..., table_reads: _Optional[bytes] = ..., release_leases: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "offsets", "expires_in_s", "gpu", "pending", "codec", "payload_bytes")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    expires_in_s: float
    gpu: bool
    pending: int
    codec: int
    payload_bytes: int
    def __init__(self, reservation_id: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., expires_in_s: _Optional[float] = ..., gpu: _Optional[bool] = ..., pending: _Optional[int] = ..., codec: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation_id", "handle", "checksums", "device_checksums", "codec", "payload_bytes", "payload_checksums", "spare_wanted", "spare_ahead", "release_leases")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    SPARE_WANTED_FIELD_NUMBER: _ClassVar[int]
    SPARE_AHEAD_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASES_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    handle: bytes
    checksums: _containers.RepeatedScalarFieldContainer[int]
    device_checksums: _containers.RepeatedScalarFieldContainer[int]
    codec: int
    payload_bytes: int
    payload_checksums: _containers.RepeatedScalarFieldContainer[int]
    spare_wanted: int
    spare_ahead: int
    release_leases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reservation_id: _Optional[int] = ..., handle: _Optional[bytes] = ..., checksums: _Optional[_Iterable[int]] = ..., device_checksums: _Optional[_Iterable[int]] = ..., codec: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., payload_checksums: _Optional[_Iterable[int]] = ..., spare_wanted: _Optional[int] = ..., spare_ahead: _Optional[int] = ..., release_leases: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed", "spare", "spare_fresh_s")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    SPARE_FRESH_S_FIELD_NUMBER: _ClassVar[int]
    committed: int
    spare: _containers.RepeatedScalarFieldContainer[int]
    spare_fresh_s: float
    def __init__(self, committed: _Optional[int] = ..., spare: _Optional[_Iterable[int]] = ..., spare_fresh_s: _Optional[float] = ...) -> None: ...

class BindRequest(_message.Message):
    __slots__ = ("handle", "keys", "slots", "checksums", "priority", "spare_wanted", "table_reads", "spare_ahead", "release_leases")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SPARE_WANTED_FIELD_NUMBER: _ClassVar[int]
    TABLE_READS_FIELD_NUMBER: _ClassVar[int]
    SPARE_AHEAD_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASES_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    keys: bytes
    slots: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    spare_wanted: int
    table_reads: bytes
    spare_ahead: int
    release_leases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., slots: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., spare_wanted: _Optional[int] = ..., table_reads: _Optional[bytes] = ..., spare_ahead: _Optional[int] = ..., release_leases: _Optional[_Iterable[int]] = ...) -> None: ...

class BindResponse(_message.Message):
    __slots__ = ("committed", "pending", "spare", "spare_fresh_s")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    SPARE_FRESH_S_FIELD_NUMBER: _ClassVar[int]
    committed: int
    pending: int
    spare: _containers.RepeatedScalarFieldContainer[int]
    spare_fresh_s: float
    def __init__(self, committed: _Optional[int] = ..., pending: _Optional[int] = ..., spare: _Optional[_Iterable[int]] = ..., spare_fresh_s: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("reservation_id", "handle")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    handle: bytes
    def __init__(self, reservation_id: _Optional[int] = ..., handle: _Optional[bytes] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("handle", "keys", "gpu", "lookup", "prefetch", "table_reads", "release_leases")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    TABLE_READS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASES_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    keys: bytes
    gpu: bool
    lookup: bool
    prefetch: bool
    table_reads: bytes
    release_leases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., gpu: _Optional[bool] = ..., lookup: _Optional[bool] = ..., prefetch: _Optional[bool] = ..., table_reads: _Optional[bytes] = ..., release_leases: _Optional[_Iterable[int]] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "offsets", "checksums", "expires_in_s", "on_gpu", "pending", "found", "codecs", "payload_checksums", "payload_bytes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    ON_GPU_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    expires_in_s: float
    on_gpu: _containers.RepeatedScalarFieldContainer[bool]
    pending: bool
    found: int
    codecs: _containers.RepeatedScalarFieldContainer[int]
    payload_checksums: _containers.RepeatedScalarFieldContainer[int]
    payload_bytes: int
    def __init__(self, lease_id: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., expires_in_s: _Optional[float] = ..., on_gpu: _Optional[_Iterable[bool]] = ..., pending: _Optional[bool] = ..., found: _Optional[int] = ..., codecs: _Optional[_Iterable[int]] = ..., payload_checksums: _Optional[_Iterable[int]] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "handle", "release_leases")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASES_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    handle: bytes
    release_leases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[int] = ..., handle: _Optional[bytes] = ..., release_leases: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("handle", "key", "data", "priority", "checksum")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    key: bytes
    data: bytes
    priority: int
    checksum: int
    def __init__(self, handle: _Optional[bytes] = ..., key: _Optional[bytes] = ..., data: _Optional[bytes] = ..., priority: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("stored", "received")
    STORED_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    received: int
    def __init__(self, stored: _Optional[int] = ..., received: _Optional[int] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("handle", "keys")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    keys: bytes
    def __init__(self, handle: _Optional[bytes] = ..., keys: _Optional[bytes] = ...) -> None: ...

class BlockData(_message.Message):
    __slots__ = ("key", "data", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    data: bytes
    checksum: int
    def __init__(self, key: _Optional[bytes] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("handle", "keys", "gpu", "release_leases")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASES_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    keys: bytes
    gpu: bool
    release_leases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., gpu: _Optional[bool] = ..., release_leases: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("queued",)
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    queued: int
    def __init__(self, queued: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("handle", "keys", "all_blocks", "release_leases")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASES_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    keys: bytes
    all_blocks: bool
    release_leases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., all_blocks: _Optional[bool] = ..., release_leases: _Optional[_Iterable[int]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted", "more")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    more: bool
    def __init__(self, deleted: _Optional[int] = ..., more: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "blocks", "hits", "misses", "evictions", "promotions", "demotions", "checksum_failures", "up", "extra", "logical_bytes", "stored_bytes")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hits: int
    misses: int
    evictions: int
    promotions: int
    demotions: int
    checksum_failures: int
    up: bool
    extra: _containers.ScalarMap[str, float]
    logical_bytes: int
    stored_bytes: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., promotions: _Optional[int] = ..., demotions: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., up: _Optional[bool] = ..., extra: _Optional[_Mapping[str, float]] = ..., logical_bytes: _Optional[int] = ..., stored_bytes: _Optional[int] = ...) -> None: ...

class NamespaceTierBytes(_message.Message):
    __slots__ = ("tier", "blocks", "logical_bytes", "stored_bytes", "codec")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    tier: str
    blocks: int
    logical_bytes: int
    stored_bytes: int
    codec: str
    def __init__(self, tier: _Optional[str] = ..., blocks: _Optional[int] = ..., logical_bytes: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., codec: _Optional[str] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("name", "blocks", "used_bytes", "hits", "misses", "block_bytes", "tiers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    blocks: int
    used_bytes: int
    hits: int
    misses: int
    block_bytes: int
    tiers: _containers.RepeatedCompositeFieldContainer[NamespaceTierBytes]
    def __init__(self, name: _Optional[str] = ..., blocks: _Optional[int] = ..., used_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., block_bytes: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[NamespaceTierBytes, _Mapping]]] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("name", "cpu_bytes", "nvme_bytes", "pinned_bytes", "leases", "reservations", "quota_cpu_bytes", "quota_nvme_bytes", "guaranteed_cpu_bytes", "guaranteed_nvme_bytes", "max_pinned_bytes", "keys_per_s", "refused_keys")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CPU_BYTES_FIELD_NUMBER: _ClassVar[int]
    NVME_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    QUOTA_CPU_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_NVME_BYTES_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_CPU_BYTES_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_NVME_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEYS_PER_S_FIELD_NUMBER: _ClassVar[int]
    REFUSED_KEYS_FIELD_NUMBER: _ClassVar[int]
    name: str
    cpu_bytes: int
    nvme_bytes: int
    pinned_bytes: int
    leases: int
    reservations: int
    quota_cpu_bytes: int
    quota_nvme_bytes: int
    guaranteed_cpu_bytes: int
    guaranteed_nvme_bytes: int
    max_pinned_bytes: int
    keys_per_s: float
    refused_keys: int
    def __init__(self, name: _Optional[str] = ..., cpu_bytes: _Optional[int] = ..., nvme_bytes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., leases: _Optional[int] = ..., reservations: _Optional[int] = ..., quota_cpu_bytes: _Optional[int] = ..., quota_nvme_bytes: _Optional[int] = ..., guaranteed_cpu_bytes: _Optional[int] = ..., guaranteed_nvme_bytes: _Optional[int] = ..., max_pinned_bytes: _Optional[int] = ..., keys_per_s: _Optional[float] = ..., refused_keys: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "namespaces", "version", "uptime_s", "active_leases", "active_reservations", "open_handles", "namespaces_omitted", "tenants")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    OPEN_HANDLES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_OMITTED_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    version: str
    uptime_s: float
    active_leases: int
    active_reservations: int
    open_handles: int
    namespaces_omitted: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., active_leases: _Optional[int] = ..., active_reservations: _Optional[int] = ..., open_handles: _Optional[int] = ..., namespaces_omitted: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ...) -> None: ...

class WatchBlocksRequest(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    def __init__(self, handle: _Optional[bytes] = ...) -> None: ...

class BlockEventBatch(_message.Message):
    __slots__ = ("reset", "snapshot_end", "keys", "tiers", "resets")
    RESET_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_END_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    RESETS_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    snapshot_end: bool
    keys: bytes
    tiers: bytes
    resets: int
    def __init__(self, reset: _Optional[bool] = ..., snapshot_end: _Optional[bool] = ..., keys: _Optional[bytes] = ..., tiers: _Optional[bytes] = ..., resets: _Optional[int] = ...) -> None: ...
