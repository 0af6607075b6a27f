// Device checksum of whole KV blocks: a 64-bit sum a GPU computes in parallel, for blocks that
// live in a GPU memory pool (xxh3, used for host copies, is sequential and unfit for a GPU).
//
// Definition (reference.py holds the same one; the two must agree bit for bit). A block is m
// little-endian 64-bit words w_0 .. w_{m-1}. Each word becomes mix64(w_i ^ i * kWordKey), so a
// word's position counts (swapping two words changes the sum) and one flipped bit changes the
// term completely. The terms are added mod 2^64: addition is associative and commutative, so the
// threads reduce in any order and the result is still deterministic. The launcher finishes each
// block on the host: mix64(sum ^ nbytes * kLenKey), so blocks of zeros of different lengths
// differ. mix64 is the splitmix64 finalizer.
//
// Grid (chunks, n'): CTA (c, y) sums words c * blockDim.x + t, grid-stride over the block's
// words, for blocks y, y + n', ... (n' = min(n, 65535), the grid's y limit). Each CTA reduces in
// registers (warp shuffles), then across warps in shared memory, then adds its total into
// partials[block] with one atomicAdd; the launcher zeroes partials first. Block b is at
// block_ptrs[b] when block_ptrs is not null (separate per-block buffers), else at base + b *
// stride. Every address is 8-byte aligned (the launcher checks), so words load as one 8-byte
// access each.

typedef unsigned long long u64;
typedef long long i64;

#define KVSTORE_CHECKSUM_WORD_KEY 0x9E3779B97F4A7C15ULL

__device__ __forceinline__ u64 mix64(u64 x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x;
}

__device__ __forceinline__ u64 word_term(u64 w, i64 i) {
  return mix64(w ^ ((u64)i * KVSTORE_CHECKSUM_WORD_KEY));
}

// Sum over the lanes of a full warp; lane 0 holds the total.
__device__ __forceinline__ u64 warp_sum(u64 v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

// blockDim.x must be a multiple of 32 and at most 1024 (the launcher uses 256).
extern "C" __global__ void block_checksum_partial(const u64* __restrict__ block_ptrs, u64 base,
                                                  i64 stride, i64 n, i64 words,
                                                  u64* __restrict__ partials) {
  __shared__ u64 warp_sums[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const i64 step = (i64)gridDim.x * blockDim.x;
  // b depends on blockIdx only, so every thread of the CTA runs the same iterations and the
  // __syncthreads below are reached by all of them.
  for (i64 b = blockIdx.y; b < n; b += gridDim.y) {
    const u64* w = (const u64*)(block_ptrs != 0 ? block_ptrs[b] : base + (u64)(b * stride));
    u64 acc = 0;
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    // Four loads in flight per thread before the arithmetic: a 2 MiB block is bandwidth-bound,
    // so memory-level parallelism, not instruction count, sets the speed.
    for (; i + 3 * step < words; i += 4 * step) {
      const u64 a = w[i];
      const u64 c = w[i + step];
      const u64 d = w[i + 2 * step];
      const u64 e = w[i + 3 * step];
      acc += word_term(a, i) + word_term(c, i + step) + word_term(d, i + 2 * step) +
             word_term(e, i + 3 * step);
    }
    for (; i < words; i += step) acc += word_term(w[i], i);

    acc = warp_sum(acc);
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    if (warp == 0) {
      const int num_warps = (int)(blockDim.x >> 5);
      acc = warp_sum(lane < num_warps ? warp_sums[lane] : 0ULL);
      if (lane == 0) atomicAdd(&partials[b], acc);
    }
    // warp_sums is rewritten by the next block's iteration.
    __syncthreads();
  }
}
