// Split-KV decode over a paged FP8 (e4m3) KV cache with mma.sync (f16 operands, f32 accumulators), for sm_89+.
//
// Why not Triton: Triton routes FP8 tiles through shared memory into mma operand layouts with narrow loads and
// per-element address arithmetic, and the kernel ends up bound by instruction issue at ~2.9 TB/s on an H200. Here
// every lane loads 16-byte vectors straight into the registers of its own mma fragments, so no layout conversion and
// no barrier is needed:
//   * Q·K^T: the contraction runs over head_dim, whose order is free as long as q and k use the same one. Lane
//     (row r, quad position j) takes the 16-byte pieces at 64h + 16j (h < HEAD_DIM/64) of its token's key row and
//     uses their 4-byte word s as its k-elements of mma step s; q is read with the same permutation.
//   * P·V: P comes straight from the Q·K^T accumulators (the usual register reuse). The output columns are the mma
//     n dimension, whose order is free too: lane (r, j) owns head_dim bytes [VB*r, VB*r + VB) (VB = HEAD_DIM/8) of
//     the four tokens its B fragments need, and one byte permute pairs two tokens for the e4m3x2 -> f16x2 convert.
// A warp copies its tiles into shared memory in whole rows (cp.async, STAGES deep), then each lane reads the bytes of
// its fragments from there; warps never wait for each other. Warps are independent flash-decoding workers; each writes
// its own partial (unnormalised output, running max in log2 units, running sum), merged by the reduce kernel.
// The warps of a block are HEADS_PER_BLOCK KV heads x SLICES token slices: with all KV heads of a page read by one
// block at about the same time, DRAM sees the page's contiguous bytes together instead of 128-byte rows of one head
// spread over time (a block per KV head copied at ~2.9 TB/s on an H200, like FA3).
// Accumulation is two-level: each tile's P·V partial starts from zero and is added to the fp32 output on the CUDA
// cores (out = out * alpha + partial), as FA3 does for FP8.
//
// Which sequence and split a block runs: with DEVICE_PLAN 0, blockIdx (split, KV-head block, sequence), every sequence
// cut into gridDim.x splits of tokens_per_split tokens (planned on the host from the longest length); with DEVICE_PLAN
// 1, planned by the block itself from seq_lens (plan_work): no host sync, and a long sequence among short ones gets
// splits in proportion to its length. The two are separate builds because the second costs ~17% of streaming rate on
// an H200 (the main loop, compiled with block-varying rather than uniform split bounds, schedules worse; BENCHMARKS.md).
//
// Compile-time constants (-D): HEAD_DIM (128 or 256), PAGE_SIZE (multiple of 16), TILE (tokens per step, multiple of
// 16), STAGES (>= 2), HEADS_PER_BLOCK, SLICES, ROWS16 (1 when the GQA group has more than 8 query heads per KV head),
// DEVICE_PLAN (0 or 1), FUSED_MERGE (0 or 1: the merge of the splits in this kernel, behind a grid-wide barrier; a host
// plan of at most one wave only), OUT_KIND (with FUSED_MERGE: the output's type, 0 float32, 1 bfloat16, 2 float16),
// (no L2 options: bulk L2 prefetch of page rows and 256-byte L2 fetches were measured slower, BENCHMARKS.md)

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
// Built without any header (NVRTC has none), so the few CUDA types and constants used are spelled out here.
struct __align__(16) Words4 {
    u32 x, y, z, w;
};
struct __align__(16) Floats4 {
    float x, y, z, w;
};
#define NEG_INF (-__int_as_float(0x7f800000))

#define KB (HEAD_DIM / 4)                       // key bytes per lane per token
#define VB (HEAD_DIM / 8)                       // value bytes per lane per token
#define K_STEPS (HEAD_DIM / 16)                 // mma k-steps of Q·K^T
#define N_BLOCKS (TILE / 8)                     // 8-token column blocks of S per tile
#define K_CHUNKS (TILE / 16)                    // 16-token k-steps of P·V per tile
#define ROW_CHUNKS (HEAD_DIM / 16)              // 16-byte chunks of a key or value row
#define COPIES (2 * TILE * ROW_CHUNKS / 32)     // 16-byte copies per lane per tile (keys and values)
#define STAGE_BYTES (2 * TILE * HEAD_DIM)

__device__ __forceinline__ u32 e4m3x2_lo_to_f16x2(u32 word) {
    u32 out;
    asm("{.reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo;}" : "=r"(out) : "r"(word));
    return out;
}

__device__ __forceinline__ u32 e4m3x2_hi_to_f16x2(u32 word) {
    u32 out;
    asm("{.reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, hi;}" : "=r"(out) : "r"(word));
    return out;
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 out;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
    return out;
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void mma_f16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void copy16(u32 smem, const u8* src, bool valid) {
    // src-size 0 fills the slot with zeros and reads nothing: tokens past the end never bring NaN garbage in.
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(src), "r"(valid ? 16 : 0));
}

// A stage holds a warp's tile as keys [TILE][HEAD_DIM] then values [TILE][HEAD_DIM], with the 16-byte chunks of each
// row XOR-swizzled so that both fragment reads are free of bank conflicts (at head_dim 128): a key read's 8 lanes of
// a phase take 4 chunks of rows 2k and 2k+1 (the row's bit 0 flips chunk bit 2), a value read's take chunk 0 or 1
// of rows 2j + t (bits 1-2 of the row move chunk bits 1-2).
__device__ __forceinline__ u32 slot(int row, int chunk) {
    const int swizzle = (((row >> 1) & 3) << 1) ^ ((row & 1) << 2);
    return row * HEAD_DIM + ((chunk ^ swizzle) << 4);
}

__device__ __forceinline__ u32 shared_address(const void* ptr) {
    u32 address;
    asm("{.reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t;}" : "=r"(address) : "l"(ptr));
    return address;
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void wait_groups() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

__device__ __forceinline__ Words4 load_shared16(u32 smem) {
    Words4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(smem));
    return v;
}

#ifndef STAGED_STORES
#define STAGED_STORES 1
#endif

__device__ __forceinline__ void store_shared16(u32 smem, Floats4 v) {
    asm volatile("st.shared.v4.f32 [%0], {%1,%2,%3,%4};" ::"r"(smem), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w));
}

__device__ __forceinline__ Floats4 load_shared16f(u32 smem) {
    Floats4 v;
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(smem));
    return v;
}

// A staged output row's 16-byte chunks, XOR-swizzled in their low 3 bits by the writing lane's quad position j and
// row parity: the 8 lanes of a store phase (rows 2i, 2i + 1 x j = 0..3) and of a load phase (8 consecutive chunks of
// one j) each hit 8 different bank groups.
__device__ __forceinline__ int out_slot(int chunk, int j, int row) { return chunk ^ ((j & 3) | ((row & 1) << 2)); }

#ifndef FUSED_MERGE
#define FUSED_MERGE 0
#endif
#ifndef OUT_KIND
#define OUT_KIND 0
#endif

#if FUSED_MERGE
#ifndef MERGE_LOADS
#define MERGE_LOADS 8  // splits a merging lane loads at once
#endif
// The merge of the splits folded into the partial kernel (a host plan of at most one wave, so that every block is
// resident at once): each block stores its partials, waits at a grid-wide barrier, then merges a share of every
// sequence's (head, 4 columns) vectors from L2. Saves the reduce kernel's launch and its own round trips.
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ float load_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ Floats4 load_cg4(const float* p) {
    Floats4 v;
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

// barrier[0] counts the blocks that arrived, barrier[1] those that left; the last to leave sets both back to 0 for
// the next launch (stream order puts it after this one). A block that waits ~2 s (never, with every block resident)
// traps rather than hang the GPU.
__device__ __forceinline__ void grid_barrier(unsigned* barrier, unsigned blocks) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(barrier, 1u);
        const long long began = clock64();
        while (load_acquire(barrier) < blocks) {
            if (clock64() - began > 4000000000LL) __trap();
        }
        __threadfence();
        if (atomicAdd(barrier + 1, 1u) == blocks - 1) {
            atomicExch(barrier, 0u);
            atomicExch(barrier + 1, 0u);
        }
    }
    __syncthreads();
}

// (m, l, acc) of some splits merged with another's: weights exp2(max - new max), a side that saw no token (-inf) 0.
__device__ __forceinline__ void merge_into(float& m, float& l, Floats4& a, float m2, float l2, Floats4 a2) {
    const float m_new = fmaxf(m, m2);
    if (m_new == NEG_INF) return;
    const float r = fast_exp2(m - m_new), w = fast_exp2(m2 - m_new);
    l = l * r + l2 * w;
    a = Floats4{a.x * r + a2.x * w, a.y * r + a2.y * w, a.z * r + a2.z * w, a.w * r + a2.w * w};
    m = m_new;
}

__device__ __forceinline__ void store_out(void* out, long long index, Floats4 v) {
#if OUT_KIND == 0
    *(Floats4*)((float*)out + index) = v;
#else
    u32 lo, hi;
#if OUT_KIND == 1
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(v.y), "f"(v.x));
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(v.w), "f"(v.z));
#else
    lo = pack_f16x2(v.x, v.y);
    hi = pack_f16x2(v.z, v.w);
#endif
    u32* dst = (u32*)((u16*)out + index);
    dst[0] = lo;
    dst[1] = hi;
#endif
}

// Every sequence's output: vector v = (seq, head, 4 columns) merged by `lanes` lanes of one warp (a power of two up to
// 32, as many as the grid's threads allow), lane p taking splits p, p + lanes, ... (MERGE_LOADS splits' loads in
// flight), then a butterfly over the lanes; scaled by out_scale / sum, as the reduce kernel does. Not inlined: the
// main loop then compiles as in the build without the merge (SASS compared).
__device__ __noinline__ void merge_splits(const float* __restrict__ part_acc, const float* __restrict__ part_max,
                             const float* __restrict__ part_sum, void* __restrict__ out, float out_scale, int splits,
                             int heads, long long s_as, long long s_ah, long long s_ap, long long s_ms, long long s_mh,
                             long long s_os, long long s_oh) {
    const long long threads = (long long)gridDim.x * gridDim.y * gridDim.z * blockDim.x;
    const long long thread =
        ((long long)(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
    const long long vectors = (long long)gridDim.z * heads * (HEAD_DIM / 4);
    int lanes = 32;
    while (lanes > 1 && vectors * lanes > threads) lanes >>= 1;
    // vectors is a multiple of 32 (HEAD_DIM / 4 is), so whole warps take items and the shuffles see every lane.
    for (long long item = thread; item < vectors * lanes; item += threads) {
        const long long v = item / lanes;
        const int p = (int)(item % lanes);
        const int c4 = (int)(v % (HEAD_DIM / 4));
        const long long sh = v / (HEAD_DIM / 4);
        const int head = (int)(sh % heads), seq = (int)(sh / heads);
        const float* maxes = part_max + seq * s_ms + head * s_mh;
        const float* sums = part_sum + seq * s_ms + head * s_mh;
        const float* accs = part_acc + seq * s_as + head * s_ah + 4 * c4;
        float m = NEG_INF, l = 0.f;
        Floats4 a{0.f, 0.f, 0.f, 0.f};
        for (int s0 = p; s0 < splits; s0 += MERGE_LOADS * lanes) {
            float mx[MERGE_LOADS], sm[MERGE_LOADS];
            Floats4 ac[MERGE_LOADS];
#pragma unroll
            for (int u = 0; u < MERGE_LOADS; ++u) {
                const int s = s0 + u * lanes;
                const bool ok = s < splits;
                mx[u] = ok ? load_cg(maxes + s) : NEG_INF;
                sm[u] = ok ? load_cg(sums + s) : 0.f;
                ac[u] = ok ? load_cg4(accs + s * s_ap) : Floats4{0.f, 0.f, 0.f, 0.f};
            }
#pragma unroll
            for (int u = 0; u < MERGE_LOADS; ++u) merge_into(m, l, a, mx[u], sm[u], ac[u]);
        }
        for (int offset = 1; offset < lanes; offset <<= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, offset), l2 = __shfl_xor_sync(0xffffffffu, l, offset);
            const Floats4 a2{__shfl_xor_sync(0xffffffffu, a.x, offset), __shfl_xor_sync(0xffffffffu, a.y, offset),
                             __shfl_xor_sync(0xffffffffu, a.z, offset), __shfl_xor_sync(0xffffffffu, a.w, offset)};
            merge_into(m, l, a, m2, l2, a2);
        }
        if (p == 0) {
            const float scale = out_scale / l;
            store_out(out, seq * s_os + head * s_oh + 4 * c4,
                      Floats4{a.x * scale, a.y * scale, a.z * scale, a.w * scale});
        }
    }
}
#endif

#if DEVICE_PLAN
#define TOKENS_PER_STEP (TILE * SLICES)
#define MAX_WARPS 32

// Splits of one sequence of `steps` steps when a grid row has `budget` blocks for `seqs` sequences of `total` steps:
// one each, the other budget - seqs shared in proportion to length (floor), at most one per step
// (_decode_mma.split_count).
__device__ __forceinline__ int split_count(long long budget, int seqs, long long total, int steps) {
    if (budget <= seqs) return 1;
    const long long n = 1 + (budget - seqs) * (long long)steps / total;
    return (int)(n < steps ? (n > 1 ? n : 1) : (steps > 1 ? steps : 1));
}

struct Work {
    int seq, split, splits, first;  // seq < 0: an idle block
};

// The block's work, computed by all its threads from seq_lens (_decode_mma.sequence_splits): the budget of blocks
// per grid row (whole waves while the longest sequence's splits keep min_split_steps steps, else one wave), each
// sequence's split count, and the running sum of counts that places block x in a sequence. Thread t takes a run of
// consecutive sequences, so one block-wide exclusive scan orders them.
__device__ Work plan_work(const int* __restrict__ seq_lens, int seqs, int wave, int most_waves, int min_split_steps,
                          int fixed_splits) {
    __shared__ long long warp_total[MAX_WARPS];
    __shared__ int warp_longest[MAX_WARPS], warp_splits[MAX_WARPS];
    __shared__ Work work;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int per_thread = (seqs + blockDim.x - 1) / blockDim.x;
    const int first_seq = min(threadIdx.x * per_thread, seqs), last_seq = min(first_seq + per_thread, seqs);
    long long total = 0;
    int longest = 0;
    for (int s = first_seq; s < last_seq; ++s) {
        const int steps = (seq_lens[s] + TOKENS_PER_STEP - 1) / TOKENS_PER_STEP;
        total += steps;
        longest = max(longest, steps);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        total += __shfl_xor_sync(0xffffffffu, total, offset);
        longest = max(longest, __shfl_xor_sync(0xffffffffu, longest, offset));
    }
    if (lane == 0) {
        warp_total[warp] = total;
        warp_longest[warp] = longest;
    }
    if (threadIdx.x == 0) work.seq = -1;
    __syncthreads();
    total = 0;
    longest = 0;
    for (int w = 0; w < warps; ++w) {
        total += warp_total[w];
        longest = max(longest, warp_longest[w]);
    }
    total = total > 0 ? total : 1;
    long long budget = (long long)wave / gridDim.y;  // one wave, unless more keep long enough splits
    for (int waves = most_waves; waves > 0; --waves) {
        const long long candidate = (long long)waves * wave / gridDim.y;
        if (longest >= (long long)split_count(candidate, seqs, total, longest) * min_split_steps) {
            budget = candidate;
            break;
        }
    }
    int mine = 0;
    for (int s = first_seq; s < last_seq; ++s) {
        const int steps = (seq_lens[s] + TOKENS_PER_STEP - 1) / TOKENS_PER_STEP;
        mine += fixed_splits > 0 ? fixed_splits : split_count(budget, seqs, total, steps);
    }
    int inclusive = mine;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const int up = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += up;
    }
    if (lane == 31) warp_splits[warp] = inclusive;
    __syncthreads();
    int first = inclusive - mine;
    for (int w = 0; w < warp; ++w) first += warp_splits[w];
    const int block = blockIdx.x;
    if (block >= first && block < first + mine) {
        for (int s = first_seq; s < last_seq; ++s) {
            const int steps = (seq_lens[s] + TOKENS_PER_STEP - 1) / TOKENS_PER_STEP;
            const int count = fixed_splits > 0 ? fixed_splits : split_count(budget, seqs, total, steps);
            if (block < first + count) {
                work = Work{s, block - first, count, first};
                break;
            }
            first += count;
        }
    }
    __syncthreads();
    return work;
}
#endif

extern "C" __global__ void __launch_bounds__(HEADS_PER_BLOCK * SLICES * 32) paged_decode_fp8_mma(
    const u8* __restrict__ q, const u8* __restrict__ k_cache, const u8* __restrict__ v_cache,
    const int* __restrict__ block_table, const int* __restrict__ seq_lens, float* __restrict__ part_acc,
    float* __restrict__ part_max, float* __restrict__ part_sum, int* __restrict__ part_index, float qk_scale,
    int group, int tokens_per_split, int seqs, int wave, int most_waves, int min_split_steps, int fixed_splits,
    long long s_qs, long long s_qh, long long s_kb, long long s_kt, long long s_kh, long long s_vb, long long s_vt,
    long long s_vh, long long s_bt, long long s_as, long long s_ah, long long s_ap, long long s_ms, long long s_mh,
    unsigned* __restrict__ barrier, void* __restrict__ merged, float out_scale, long long s_os, long long s_oh) {
    extern __shared__ __align__(16) u8 shared[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = lane >> 2, j = lane & 3;
    const int slice = warp / HEADS_PER_BLOCK;
#if DEVICE_PLAN
    // tokens_per_split is unused here (s_as and s_ms are 0: a block's partials row is its own), seqs and the plan's
    // parameters in plan_work.
    const Work work = plan_work(seq_lens, seqs, wave, most_waves, min_split_steps, fixed_splits);
    if (work.seq < 0) return;
    const int split = work.split, kv_head = blockIdx.y * HEADS_PER_BLOCK + warp % HEADS_PER_BLOCK, seq = work.seq;
    const int seq_len = seq_lens[seq];
    const int steps = (seq_len + TOKENS_PER_STEP - 1) / TOKENS_PER_STEP;
    const int split_tokens = (steps + work.splits - 1) / work.splits * TOKENS_PER_STEP;
    const int per_warp = split_tokens / SLICES;
    const int start = split * split_tokens + slice * per_warp;
    const int end = (seq_len < start + per_warp ? seq_len : start + per_warp);
    const int num_tiles = end > start ? (end - start + TILE - 1) / TILE : 0;
    const int part = blockIdx.x * SLICES + slice;  // = (first + split) * SLICES + slice: a sequence's rows are consecutive
    if (split == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
        part_index[2 * seq] = work.first * SLICES;
        part_index[2 * seq + 1] = work.splits * SLICES;
    }
#else
    const int split = blockIdx.x, kv_head = blockIdx.y * HEADS_PER_BLOCK + warp % HEADS_PER_BLOCK, seq = blockIdx.z;
    const int seq_len = seq_lens[seq];
    const int per_warp = tokens_per_split / SLICES;
    const int start = split * tokens_per_split + slice * per_warp;
    const int end = (seq_len < start + per_warp ? seq_len : start + per_warp);
    const int num_tiles = end > start ? (end - start + TILE - 1) / TILE : 0;
    const int part = split * SLICES + slice;
#endif
    const int* table = block_table + seq * s_bt;
    const int last_page = seq_len > 0 ? (seq_len - 1) / PAGE_SIZE : 0;
    const u8* k_head = k_cache + kv_head * s_kh;
    const u8* v_head = v_cache + kv_head * s_vh;
    const u32 smem_warp = shared_address(shared) + (u32)(warp * STAGES * STAGE_BYTES);

    // Query fragments (A operand of Q·K^T): rows r and r + 8 are query heads of this KV head (zero past the group).
    u32 qa[K_STEPS][4];
    {
        const int rows[2] = {r, r + 8};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = rows[half];
            if (half == 1 && !ROWS16) {
#pragma unroll
                for (int s = 0; s < K_STEPS; ++s) qa[s][1] = qa[s][3] = 0u;
                break;
            }
            const bool ok = row < group;
            const u8* src = q + seq * s_qs + (long long)(kv_head * group + row) * s_qh + 16 * j;
#pragma unroll
            for (int s = 0; s < K_STEPS; ++s) {
                const u32 word = ok ? *(const u32*)(src + 64 * (s / 4) + 4 * (s % 4)) : 0u;
                qa[s][half] = e4m3x2_lo_to_f16x2(word);
                qa[s][half + 2] = e4m3x2_hi_to_f16x2(word);
            }
        }
    }

    // The pages of a tile's 16-token chunks, read one loop iteration before the copies that need them.
    auto load_pages = [&](int tile, int (&pages)[K_CHUNKS]) {
#pragma unroll
        for (int c = 0; c < K_CHUNKS; ++c) {
            const int index = (start + tile * TILE + 16 * c) / PAGE_SIZE;
            pages[c] = table[index < last_page ? index : last_page];
        }
    };
    // Issues the copies of one tile into its stage. Copy u of the warp moves 512 consecutive bytes of the tile's
    // [keys|values][token][chunk] order, i.e. whole rows: copies that each took a lane's own fragment bytes (half
    // rows over 8 tokens) read the cache at ~3.1 TB/s on an H200, whole rows at ~4.1 (decode_mma_probe.py --rows).
    auto issue = [&](int tile, const int (&pages)[K_CHUNKS]) {
        const int tile_start = start + tile * TILE;
        const u32 base = smem_warp + (u32)((tile % STAGES) * STAGE_BYTES);
#pragma unroll
        for (int u = 0; u < COPIES; ++u) {
            const int linear = u * 32 + lane;
            const int values = linear / (TILE * ROW_CHUNKS);
            const int rest = linear % (TILE * ROW_CHUNKS);
            const int tok = rest / ROW_CHUNKS, chunk = rest % ROW_CHUNKS;
            const long long page = pages[tok / 16];
            const long long row_in_page = (tile_start + tok) % PAGE_SIZE;
            const u8* src = values ? v_head + page * s_vb + row_in_page * s_vt : k_head + page * s_kb + row_in_page * s_kt;
            copy16(base + values * TILE * HEAD_DIM + slot(tok, chunk), src + 16 * chunk, tile_start + tok < end);
        }
    };

    float out[VB][4];
#pragma unroll
    for (int b = 0; b < VB; ++b) out[b][0] = out[b][1] = out[b][2] = out[b][3] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};  // per lane: rows r, r + 8

    int pages[K_CHUNKS];
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) {
        if (p < num_tiles) {
            load_pages(p, pages);
            issue(p, pages);
        }
        commit();
    }
    load_pages(STAGES - 1, pages);
    for (int tile = 0; tile < num_tiles; ++tile) {
        if (tile + STAGES - 1 < num_tiles) issue(tile + STAGES - 1, pages);
        commit();
        load_pages(tile + STAGES, pages);
        wait_groups<STAGES - 1>();
        __syncwarp();  // the tile's bytes were copied by other lanes of the warp
        const u32 base = smem_warp + (u32)((tile % STAGES) * STAGE_BYTES);
        const int tile_start = start + tile * TILE;

        // S = Q·K^T for TILE tokens: accumulators s_acc[nb] hold rows r, r+8 x tokens 8nb + 2j, 8nb + 2j + 1.
        float s_acc[N_BLOCKS][4];
#pragma unroll
        for (int nb = 0; nb < N_BLOCKS; ++nb) {
            s_acc[nb][0] = s_acc[nb][1] = s_acc[nb][2] = s_acc[nb][3] = 0.f;
#pragma unroll
            for (int h = 0; h < KB / 16; ++h) {
                const Words4 kw = load_shared16(base + slot(8 * nb + r, 4 * h + j));  // bytes 64h + 16j
                const u32 words[4] = {kw.x, kw.y, kw.z, kw.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int s = 4 * h + e;
                    mma_f16(s_acc[nb], qa[s][0], qa[s][1], qa[s][2], qa[s][3], e4m3x2_lo_to_f16x2(words[e]),
                            e4m3x2_hi_to_f16x2(words[e]));
                }
            }
        }
        if (tile_start + TILE > end) {  // the last tile: mask tokens past the end
#pragma unroll
            for (int nb = 0; nb < N_BLOCKS; ++nb) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    if (tile_start + 8 * nb + 2 * j + (c & 1) >= end) s_acc[nb][c] = NEG_INF;
                }
            }
        }
        // Online softmax (log2 units); rows are shared by the 4 lanes of a quad.
        float alpha[2];
#pragma unroll
        for (int half = 0; half < (ROWS16 ? 2 : 1); ++half) {
            float mx = NEG_INF;
#pragma unroll
            for (int nb = 0; nb < N_BLOCKS; ++nb) mx = fmaxf(mx, fmaxf(s_acc[nb][2 * half], s_acc[nb][2 * half + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m_run[half], mx * qk_scale);
            alpha[half] = fast_exp2(m_run[half] - m_new);
            m_run[half] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int nb = 0; nb < N_BLOCKS; ++nb) {
#pragma unroll
                for (int c = 2 * half; c < 2 * half + 2; ++c) {
                    s_acc[nb][c] = fast_exp2(fmaf(s_acc[nb][c], qk_scale, -m_new));
                    sum += s_acc[nb][c];
                }
            }
            l_run[half] = l_run[half] * alpha[half] + sum;  // this lane's share; summed over the quad at the end
        }
        // P as the A operand of P·V (f16: 10 mantissa bits, probabilities need no scaling).
        u32 pa[K_CHUNKS][4];
#pragma unroll
        for (int c = 0; c < K_CHUNKS; ++c) {
            pa[c][0] = pack_f16x2(s_acc[2 * c][0], s_acc[2 * c][1]);
            pa[c][2] = pack_f16x2(s_acc[2 * c + 1][0], s_acc[2 * c + 1][1]);
            pa[c][1] = ROWS16 ? pack_f16x2(s_acc[2 * c][2], s_acc[2 * c][3]) : 0u;
            pa[c][3] = ROWS16 ? pack_f16x2(s_acc[2 * c + 1][2], s_acc[2 * c + 1][3]) : 0u;
        }
        // P·V, two-level: a fresh partial per tile, then out = out * alpha + partial.
#pragma unroll
        for (int h = 0; h < VB / 16; ++h) {
            u32 vw[K_CHUNKS][4][4];  // [chunk][token 2j, 2j+1, 8+2j, 9+2j][word]
#pragma unroll
            for (int c = 0; c < K_CHUNKS; ++c) {
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    const int tok = 16 * c + 2 * j + (t & 1) + 8 * (t >> 1);
                    const Words4 w = load_shared16(base + TILE * HEAD_DIM + slot(tok, r * (VB / 16) + h));
                    vw[c][t][0] = w.x;
                    vw[c][t][1] = w.y;
                    vw[c][t][2] = w.z;
                    vw[c][t][3] = w.w;
                }
            }
#pragma unroll
            for (int b16 = 0; b16 < 16; ++b16) {  // head_dim byte 16h + b16 of this lane's VB-byte slice
                const int w = b16 >> 2, e = b16 & 3;
                const u32 sel = (e < 2) ? 0x5140u : 0x7362u;
                float partial[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int c = 0; c < K_CHUNKS; ++c) {
                    const u32 lo = __byte_perm(vw[c][0][w], vw[c][1][w], sel);
                    const u32 hi = __byte_perm(vw[c][2][w], vw[c][3][w], sel);
                    const u32 b0 = ((e & 1) ? e4m3x2_hi_to_f16x2(lo) : e4m3x2_lo_to_f16x2(lo));
                    const u32 b1 = ((e & 1) ? e4m3x2_hi_to_f16x2(hi) : e4m3x2_lo_to_f16x2(hi));
                    mma_f16(partial, pa[c][0], pa[c][1], pa[c][2], pa[c][3], b0, b1);
                }
                const int b = 16 * h + b16;
                out[b][0] = fmaf(out[b][0], alpha[0], partial[0]);
                out[b][1] = fmaf(out[b][1], alpha[0], partial[1]);
                if (ROWS16) {
                    out[b][2] = fmaf(out[b][2], alpha[1], partial[2]);
                    out[b][3] = fmaf(out[b][3], alpha[1], partial[3]);
                }
            }
        }
        __syncwarp();  // every lane is done with this stage before the next copies refill it
    }
    wait_groups<0>();

    // Partials: lane (r, j) holds output columns VB*2j + b and VB*(2j+1) + b of rows r and r + 8.
#if STAGED_STORES
    // Written through the warp's (now idle) stages so that each store instruction writes 512 contiguous bytes of one
    // row: stored from the fragments, a store put 16 bytes in each of 32 different rows' 128-byte lines.
    __syncwarp();
#endif
#pragma unroll
    for (int half = 0; half < (ROWS16 ? 2 : 1); ++half) {
        const int row = r + 8 * half;
        float l_sum = l_run[half];
        l_sum += __shfl_xor_sync(0xffffffffu, l_sum, 1);
        l_sum += __shfl_xor_sync(0xffffffffu, l_sum, 2);
#if STAGED_STORES
#pragma unroll
        for (int col = 0; col < 2; ++col) {
#pragma unroll
            for (int b = 0; b < VB; b += 4) {
                const int chunk = (VB * (2 * j + col) + b) / 4;  // 16-byte chunk of the row
                store_shared16(smem_warp + r * (4 * HEAD_DIM) + (out_slot(chunk, j, r) << 4),
                               Floats4{out[b][2 * half + col], out[b + 1][2 * half + col], out[b + 2][2 * half + col],
                                       out[b + 3][2 * half + col]});
            }
        }
        __syncwarp();
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            if (k + 8 * half < group) {
                float* dst = part_acc + seq * s_as + (kv_head * group + k + 8 * half) * s_ah + part * s_ap;
#pragma unroll
                for (int h = 0; h < HEAD_DIM / 128; ++h) {
                    const int chunk = 32 * h + lane;
                    const u32 src = smem_warp + k * (4 * HEAD_DIM) + (out_slot(chunk, chunk / (HEAD_DIM / 16), k) << 4);
                    *(Floats4*)(dst + 4 * chunk) = load_shared16f(src);
                }
            }
        }
        if (row < group && j == 0) {
            const int head = kv_head * group + row;
            part_max[seq * s_ms + head * s_mh + part] = m_run[half];
            part_sum[seq * s_ms + head * s_mh + part] = l_sum;
        }
        __syncwarp();  // the next half overwrites the staged rows
#else
        if (row < group) {
            const int head = kv_head * group + row;
            float* dst = part_acc + seq * s_as + head * s_ah + part * s_ap;
#pragma unroll
            for (int col = 0; col < 2; ++col) {
                Floats4* run = (Floats4*)(dst + VB * (2 * j + col));
#pragma unroll
                for (int b = 0; b < VB; b += 4) {
                    run[b / 4] = Floats4{out[b][2 * half + col], out[b + 1][2 * half + col], out[b + 2][2 * half + col],
                                         out[b + 3][2 * half + col]};
                }
            }
            if (j == 0) {
                part_max[seq * s_ms + head * s_mh + part] = m_run[half];
                part_sum[seq * s_ms + head * s_mh + part] = l_sum;
            }
        }
#endif
    }
#if FUSED_MERGE && !DEVICE_PLAN
    // merged: the output; out_scale: v_scale; s_os, s_oh: its strides (elements). Sequence s's rows are [s * gridDim.x * SLICES,
    // ...): s_as and s_ms step over them.
    grid_barrier(barrier, gridDim.x * gridDim.y * gridDim.z);
    merge_splits(part_acc, part_max, part_sum, merged, out_scale, gridDim.x * SLICES, gridDim.y * HEADS_PER_BLOCK * group,
                 s_as, s_ah, s_ap, s_ms, s_mh, s_os, s_oh);
#endif
}
