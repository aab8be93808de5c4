//! The numbers the kernels and the Rust that launches them must agree on: block shapes, tile sizes, limits.
//!
//! This list is their one source. The crate exports each as a `usize` (`ferry_kernels::constants::GEMV_WARPS`);
//! build.rs reads the same list and writes it into `constants.cuh` as `constexpr int`s, which every kernel sees
//! through common.cuh. Numbers only one side uses (a kernel's register tiling, a launch heuristic) live there.

kernel_constants! {
    /// Bytes of a weight row one warp covers per k-step of a dot product: 32 lanes x one 16-byte copy (256 bf16
    /// weights, 512 FP8 ones).
    WARP_STEP_BYTES: usize = 512;

    /// Products with at most this many rows run as GEMV kernels, one kernel per row count (gemv.cu).
    GEMV_MAX_ROWS: usize = 8;
    /// Warps per block of the GEMV kernels.
    GEMV_WARPS: usize = 8;
    /// Weight rows one warp of the GEMV kernel for `r` rows sums at once, at index `r - 1`: each activation value a
    /// lane loads serves that many weight rows. At least 2 even for one row: a lane's activation loads (16 bytes
    /// a lane, 32 or 64 bytes apart) touch 4x the L1 lines a coalesced load would, and at one weight row a warp
    /// they, not the weights, bounded the batch-1 GEMVs (12-layer q30 on the H200: 2 rows a warp +3 % bf16, +8 %
    /// FP8 against 1; 4 rows a warp between the two). From 3 rows on, 4 a warp although their registers (80 bf16,
    /// 140 FP8 at 4 rows) run q30's launches in two waves: at 4 sequences 2 rows a warp were -3 %, 1 row -16 %.
    GEMV_ROWS_PER_WARP: [usize; GEMV_MAX_ROWS] = [2, 2, 4, 4, 4, 4, 4, 4];

    /// Warps per block of the MoE decode kernels (moe.cu's moe_gate_up and moe_down).
    MOE_WARPS: usize = 8;
    /// Output features per (expert, feature group) work item of moe_down.
    MOE_DOWN_ROWS: usize = 4;
    /// Output features a warp of moe_gate_up_fp8 computes: two, so that q30's batch-1 launch (768 blocks of one
    /// feature a warp at 56 registers, 1.45 waves on the H200) runs in one wave of 384.
    MOE_FP8_GATE_UP_FEATURES: usize = 2;
    /// Experts the router kernel handles: one warp, 16 per lane.
    ROUTER_MAX_EXPERTS: usize = 512;
    /// Experts a row the router kernel chooses at most: lane k of its warp keeps the k-th choice.
    ROUTER_MAX_TOP_K: usize = 32;
    /// Floats of scratch a warp of the fused router GEMV (gemv.cu's gemv_route_R) has for the grouped sigmoid
    /// router, in its 4 KiB of staging slots: 2 x experts + 2 x groups must fit (route.cuh).
    FUSED_ROUTER_SCRATCH_FLOATS: usize = 1024;

    /// Tokens per block of the paged KV cache.
    KV_BLOCK_SIZE: usize = 16;
    /// The largest attention head: qkv_rope_kv_append holds a head in shared memory, and the attention kernels are
    /// built for heads padded up to 16, 32, 64, 128 or 256.
    MAX_HEAD_DIM: usize = 256;
    /// Keys per shared-memory tile of the decode attention kernel: 16 for each of its two key warps.
    KEYS_PER_TILE: usize = 32;
    /// Warps per decode attention block at most: two key warps for each 8 of a group's (up to 32) heads.
    ATTENTION_MAX_WARPS: usize = 8;
    /// Tiles in the attention kernel's copy pipeline at most.
    ATTENTION_MAX_STAGES: usize = 3;
    /// Splits of a row's keys at most (attention_combine's weights fit in shared memory).
    ATTENTION_MAX_SPLITS: usize = 256;
    /// Threads per block of attention_combine.
    ATTENTION_COMBINE_THREADS: usize = 128;

    /// M-rows ((query row, head) pairs) per warp of the flash prefill attention: one m16 tensor-core tile.
    FLASH_WARP_ROWS: usize = 16;
    /// Key features per key tile of the flash prefill attention (keys per tile times the padded head dim).
    FLASH_TILE_FEATURES: usize = 4096;
    /// Keys per tile of the flash prefill attention at most (the tile of heads of 64 and smaller).
    FLASH_MAX_KEYS_PER_TILE: usize = 64;

    /// The largest compressed kv of multi-head latent attention (DeepSeek-V3's 512): mla_attend keeps o_c of a
    /// group's heads in registers, and mla_expand holds a chunk of rows' o_c of a head in shared memory.
    MLA_MAX_RANK: usize = 512;
    /// Heads of one mla_attend block, which score each key row read into shared memory against all of them.
    MLA_GROUP_HEADS: usize = 16;
    /// Key rows per shared-memory tile of mla_attend.
    MLA_KEYS_PER_TILE: usize = 16;
    /// Threads per block of mla_absorb_query, mla_attend and mla_expand.
    MLA_ATTEND_THREADS: usize = 256;
    /// Rows of a round that one mla_absorb_query or mla_expand block takes (each weight it reads serves them all).
    MLA_CHUNK_ROWS: usize = 16;
    /// Rows one round of MLA's kernels takes (mla.rs loops over a longer batch): bounds the latent queries, o_c and
    /// the splits' partials that a round holds, whatever the step's length.
    MLA_ROWS_PER_LAUNCH: usize = 64;

    /// The largest key head of the gated delta rule: the state column a thread keeps in registers.
    MAX_K_HEAD_DIM: usize = 128;
    /// Tokens per chunk of the chunked gated delta rule (the CPU backend's chunked reference uses the same).
    DELTA_CHUNK: usize = 64;
    /// State columns of a head one block of the chunked gated delta rule takes.
    DELTA_CHUNK_COLUMNS: usize = 32;
    /// Threads per block of the chunked gated delta rule.
    DELTA_CHUNK_THREADS: usize = 256;
}
