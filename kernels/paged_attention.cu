// Decode paged attention for one layer: one query token per sequence attends to the sequence's
// K/V, which sit in fixed-size physical blocks named by the sequence's block table.
//
// query [num_seqs, num_heads, head_dim] (contiguous), cache [2, num_blocks, block_size,
// num_kv_heads, head_dim] with element strides kv_stride (dim 0) and block_stride (dim 1) and
// each block's [block_size, H, D] contiguous; block_tables [num_seqs, max_blocks] int32;
// seq_lens [num_seqs] int32; out like query. Query head h reads KV head
// h / (num_heads / num_kv_heads) (GQA). Sums and softmax in float32.
//
// Grid (num_heads, num_seqs), kWarps warps per block. Each warp runs an online softmax over the
// tokens warp, warp + kWarps, ...; lane j holds query dims j, j + 32, ... (head_dim <= 256),
// so each load of a K or V row reads 32 consecutive elements. The warps' partial results are
// merged through shared memory at the end. A sequence of length 0 gets zeros.

typedef long long i64;

#define KVSTORE_ATTENTION_WARPS 8
#define KVSTORE_ATTENTION_MAX_PER_LANE 8  // head_dim <= 32 * 8

// Element types: storage type and conversions to and from float. No cuda_fp16.h, so the
// source compiles under NVRTC with no include paths.
struct F32 {
  typedef float T;
  static __device__ __forceinline__ float load(T x) { return x; }
  static __device__ __forceinline__ T store(float x) { return x; }
};

struct F16 {
  typedef unsigned short T;
  static __device__ __forceinline__ float load(T h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
  }
  static __device__ __forceinline__ T store(float f) {
    T h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  }
};

struct BF16 {
  typedef unsigned short T;
  static __device__ __forceinline__ float load(T b) { return __uint_as_float((unsigned)b << 16); }
  // Round to nearest even, as torch does; any NaN becomes torch's canonical 0x7fc0.
  static __device__ __forceinline__ T store(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (T)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (T)(u >> 16);
  }
};

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

template <typename E>
__device__ __forceinline__ void attention_impl(typename E::T* __restrict__ out,
                                               const typename E::T* __restrict__ query,
                                               const typename E::T* __restrict__ cache,
                                               const int* __restrict__ block_tables,
                                               const int* __restrict__ seq_lens, int num_heads,
                                               int num_kv_heads, int head_dim, int block_size,
                                               int max_blocks, i64 kv_stride, i64 block_stride,
                                               float scale) {
  typedef typename E::T T;
  const int kWarps = KVSTORE_ATTENTION_WARPS;
  const int kPerLane = KVSTORE_ATTENTION_MAX_PER_LANE;
  const float neg_inf = __int_as_float(0xff800000);

  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int len = seq_lens[seq];
  const int* table = block_tables + (i64)seq * max_blocks;
  const T* q_ptr = query + ((i64)seq * num_heads + head) * head_dim;

  float q[kPerLane];
  float acc[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int d = lane + 32 * j;
    q[j] = d < head_dim ? E::load(q_ptr[d]) * scale : 0.f;
    acc[j] = 0.f;
  }

  float m = neg_inf;  // running max of this warp's scores
  float l = 0.f;      // running sum of exp(score - m)
  for (int t = warp; t < len; t += kWarps) {
    const i64 block = table[t / block_size];
    const T* k = cache + block * block_stride +
                 ((i64)(t % block_size) * num_kv_heads + kv_head) * head_dim;
    const T* v = k + kv_stride;
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int d = lane + 32 * j;
      if (d < head_dim) s += q[j] * E::load(k[d]);
    }
    s = warp_sum(s);
    const float m_new = fmaxf(m, s);
    const float correction = expf(m - m_new);  // 0 on the warp's first token, where m = -inf
    const float p = expf(s - m_new);
    l = l * correction + p;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int d = lane + 32 * j;
      if (d < head_dim) acc[j] = acc[j] * correction + p * E::load(v[d]);
    }
    m = m_new;
  }

  __shared__ float warp_m[KVSTORE_ATTENTION_WARPS];
  __shared__ float warp_l[KVSTORE_ATTENTION_WARPS];
  __shared__ float warp_acc[KVSTORE_ATTENTION_WARPS][32 * KVSTORE_ATTENTION_MAX_PER_LANE];
  if (lane == 0) {
    warp_m[warp] = m;
    warp_l[warp] = l;
  }
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int d = lane + 32 * j;
    if (d < head_dim) warp_acc[warp][d] = acc[j];
  }
  __syncthreads();

  T* o_ptr = out + ((i64)seq * num_heads + head) * head_dim;
  if (len == 0) {
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) o_ptr[d] = E::store(0.f);
    return;
  }
  float m_all = neg_inf;
  for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, warp_m[w]);
  float weight[KVSTORE_ATTENTION_WARPS];
  float l_all = 0.f;
  for (int w = 0; w < kWarps; ++w) {
    weight[w] = expf(warp_m[w] - m_all);  // 0 for a warp that saw no token (m = -inf)
    l_all += warp_l[w] * weight[w];
  }
  const float inv = 1.f / l_all;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.f;
    for (int w = 0; w < kWarps; ++w) o += warp_acc[w][d] * weight[w];
    o_ptr[d] = E::store(o * inv);
  }
}

#define KVSTORE_ATTENTION_ENTRY(NAME, E)                                                       \
  extern "C" __global__ void __launch_bounds__(KVSTORE_ATTENTION_WARPS * 32)                  \
      NAME(E::T* out, const E::T* query, const E::T* cache, const int* block_tables,           \
           const int* seq_lens, int num_heads, int num_kv_heads, int head_dim, int block_size, \
           int max_blocks, i64 kv_stride, i64 block_stride, float scale) {                     \
    attention_impl<E>(out, query, cache, block_tables, seq_lens, num_heads, num_kv_heads,      \
                      head_dim, block_size, max_blocks, kv_stride, block_stride, scale);       \
  }

KVSTORE_ATTENTION_ENTRY(paged_attention_f32, F32)
KVSTORE_ATTENTION_ENTRY(paged_attention_f16, F16)
KVSTORE_ATTENTION_ENTRY(paged_attention_bf16, BF16)
