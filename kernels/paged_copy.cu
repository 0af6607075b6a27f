// Paged KV-cache block movement: gather (cache -> contiguous blocks), scatter (contiguous blocks
// -> cache) and block-to-block copy inside every layer (copy-on-write).
//
// Layout. Layer l of the cache is [2, num_blocks, block_size, H, D]; the K or V part of one block
// (block_size * H * D elements, a "chunk") is contiguous. kv_stride and block_stride are the byte
// strides of dims 0 and 1, equal in every layer; layer_ptrs[l] is layer l's base address, so all
// layers move in one launch. A contiguous block is [num_layers, 2, block_size, H, D]: chunk
// (layer, kv) starts at byte (2 * layer + kv) * chunk_bytes.
//
// Bytes only: V is the widest unsigned type that every address, stride and chunk size is a
// multiple of (chosen by the launcher), so any dtype, float8 included, moves bit for bit.
// Addresses are plain device-accessible pointers: a contiguous block may be device memory or
// pinned host memory mapped into the device's address space (zero-copy over PCIe).
//
// Grid: one CUDA block per chunk, grid-stride over n * num_layers * 2 chunks. No dependencies
// between chunks, no shared memory, no synchronisation.

typedef unsigned long long u64;
typedef long long i64;

template <typename V>
__device__ __forceinline__ void copy_chunk(V* __restrict__ dst, const V* __restrict__ src,
                                           i64 count) {
  const i64 step = blockDim.x;
  i64 i = threadIdx.x;
  // Four loads in flight per thread before the stores: chunks are tens of KiB, so
  // memory-level parallelism, not instruction count, bounds the copy (above all over PCIe).
  for (; i + 3 * step < count; i += 4 * step) {
    const V a = src[i];
    const V b = src[i + step];
    const V c = src[i + 2 * step];
    const V d = src[i + 3 * step];
    dst[i] = a;
    dst[i + step] = b;
    dst[i + 2 * step] = c;
    dst[i + 3 * step] = d;
  }
  for (; i < count; i += step) dst[i] = src[i];
}

// Gather (to_cache == false) or scatter (to_cache == true) between the cache and contiguous
// blocks. Block i of the contiguous side is at blocks_ptrs[i] when blocks_ptrs is not null (a
// list of separate per-block buffers), else at blocks_base + i * blocks_stride.
template <typename V>
__device__ __forceinline__ void move_blocks(const u64* __restrict__ layer_ptrs,
                                            const i64* __restrict__ block_ids,
                                            const u64* __restrict__ blocks_ptrs,
                                            u64 blocks_base, i64 blocks_stride, i64 n,
                                            int num_layers, i64 kv_stride, i64 block_stride,
                                            i64 chunk_bytes, bool to_cache) {
  const i64 per_block = 2LL * num_layers;
  const i64 total = n * per_block;
  const i64 count = chunk_bytes / (i64)sizeof(V);
  for (i64 c = blockIdx.x; c < total; c += gridDim.x) {
    const i64 i = c / per_block;
    const int lk = (int)(c - i * per_block);  // 2 * layer + kv
    char* cache_chunk = (char*)layer_ptrs[lk >> 1] + (lk & 1) * kv_stride +
                        block_ids[i] * block_stride;
    char* block = blocks_ptrs != 0 ? (char*)blocks_ptrs[i] : (char*)blocks_base + i * blocks_stride;
    char* block_chunk = block + lk * chunk_bytes;
    if (to_cache) {
      copy_chunk<V>((V*)cache_chunk, (const V*)block_chunk, count);
    } else {
      copy_chunk<V>((V*)block_chunk, (const V*)cache_chunk, count);
    }
  }
}

// cache[l][:, dst_ids[i]] = cache[l][:, src_ids[i]] for every layer l. The launcher guarantees
// destinations are distinct and disjoint from sources, so chunks never race.
template <typename V>
__device__ __forceinline__ void copy_blocks_impl(const u64* __restrict__ layer_ptrs,
                                                 const i64* __restrict__ src_ids,
                                                 const i64* __restrict__ dst_ids, i64 n,
                                                 int num_layers, i64 kv_stride,
                                                 i64 block_stride, i64 chunk_bytes) {
  const i64 per_block = 2LL * num_layers;
  const i64 total = n * per_block;
  const i64 count = chunk_bytes / (i64)sizeof(V);
  for (i64 c = blockIdx.x; c < total; c += gridDim.x) {
    const i64 i = c / per_block;
    const int lk = (int)(c - i * per_block);
    char* base = (char*)layer_ptrs[lk >> 1] + (lk & 1) * kv_stride;
    copy_chunk<V>((V*)(base + dst_ids[i] * block_stride),
                  (const V*)(base + src_ids[i] * block_stride), count);
  }
}

// Entry points, one set per vector width; the launcher picks the suffix (v16 .. v1 bytes).
#define KVSTORE_PAGED_COPY_ENTRIES(SUFFIX, V)                                                  \
  extern "C" __global__ void gather_blocks_##SUFFIX(                                          \
      const u64* layer_ptrs, const i64* block_ids, const u64* out_ptrs, u64 out_base,          \
      i64 out_stride, i64 n, int num_layers, i64 kv_stride, i64 block_stride,                  \
      i64 chunk_bytes) {                                                                       \
    move_blocks<V>(layer_ptrs, block_ids, out_ptrs, out_base, out_stride, n, num_layers,       \
                   kv_stride, block_stride, chunk_bytes, false);                               \
  }                                                                                            \
  extern "C" __global__ void scatter_blocks_##SUFFIX(                                         \
      const u64* layer_ptrs, const i64* block_ids, const u64* in_ptrs, u64 in_base,            \
      i64 in_stride, i64 n, int num_layers, i64 kv_stride, i64 block_stride,                   \
      i64 chunk_bytes) {                                                                       \
    move_blocks<V>(layer_ptrs, block_ids, in_ptrs, in_base, in_stride, n, num_layers,          \
                   kv_stride, block_stride, chunk_bytes, true);                                \
  }                                                                                            \
  extern "C" __global__ void copy_blocks_##SUFFIX(                                            \
      const u64* layer_ptrs, const i64* src_ids, const i64* dst_ids, i64 n, int num_layers,    \
      i64 kv_stride, i64 block_stride, i64 chunk_bytes) {                                      \
    copy_blocks_impl<V>(layer_ptrs, src_ids, dst_ids, n, num_layers, kv_stride, block_stride,  \
                        chunk_bytes);                                                          \
  }

KVSTORE_PAGED_COPY_ENTRIES(v16, uint4)
KVSTORE_PAGED_COPY_ENTRIES(v8, uint2)
KVSTORE_PAGED_COPY_ENTRIES(v4, unsigned int)
KVSTORE_PAGED_COPY_ENTRIES(v2, unsigned short)
KVSTORE_PAGED_COPY_ENTRIES(v1, unsigned char)
