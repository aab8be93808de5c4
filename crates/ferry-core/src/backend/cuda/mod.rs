//! The CUDA backend: the same ops as the CPU backend on an NVIDIA GPU, with f32 activations and bf16 weights.
//!
//! Kernels come precompiled from ferry-kernels; the driver and cuBLAS are found and loaded at run time
//! ([`libs`]). Decode-sized products (up to [`GEMV_MAX_ROWS`] rows) run as GEMV kernels that read each weight
//! once; larger ones run on cuBLAS's bf16 tensor cores with the activations split into two bf16 halves
//! (`x = hi + lo`), which keeps f32 accuracy. Routed experts sit in one slab per layer and are read through a
//! per-layer table of device pointers, so an expert cache only has to rewrite the table.

mod attention;
mod bank;
mod ceilings;
mod gdn;
mod kv;
mod libs;
mod offload;

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};

use super::{
    check_upload, AttentionParams, Backend, DeltaRuleParams, ExpertActivation, ExpertTensors, QkNormWeights, Rope,
    Router, RouterKind, SeqSlice,
};
use crate::kv::KvSpec;
use crate::loader::{DType, TensorRef};
use crate::moe::{OffloadStats, MOE_GROUP_ROWS};
use crate::{Error, Result};
pub use ceilings::GpuCeilings;
pub use kv::{DeviceBatch, DeviceKv};
pub use libs::CudaLibraries;

/// Products with at most this many rows use the GEMV kernels, one per row count.
pub const GEMV_MAX_ROWS: usize = 8;
/// gemv.cu's kernel for products of `r` rows is `GEMV_KERNELS[r - 1]`.
const GEMV_KERNELS: [&str; GEMV_MAX_ROWS] = [
    "gemv_bf16_1",
    "gemv_bf16_2",
    "gemv_bf16_3",
    "gemv_bf16_4",
    "gemv_bf16_5",
    "gemv_bf16_6",
    "gemv_bf16_7",
    "gemv_bf16_8",
];
/// Weight rows one warp of `GEMV_KERNELS[r - 1]` sums at once (gemv.cu's gemv_rows_per_warp).
const GEMV_ROWS_PER_WARP: [usize; GEMV_MAX_ROWS] = [1, 2, 4, 4, 4, 4, 4, 4];
/// Warps per block of the GEMV and MoE decode kernels (gemv.cu's GEMV_WARPS, moe.cu's MOE_WARPS).
const GEMV_WARPS: usize = 8;
/// Columns one warp covers per k-step (common.cuh's WARP_STEP_COLS).
const WARP_STEP_COLS: usize = 256;
/// Blocks a GEMV launch should have at least, so that every SM of a large GPU gets work: products with fewer rows
/// split k between the warps of a block until they do.
const GEMV_MIN_BLOCKS: usize = 256;
/// Output features per work item of moe_down (moe.cu's MOE_DOWN_ROWS).
const MOE_DOWN_ROWS: usize = 4;
/// Rows of a batch up to which the MoE block runs its decode kernels (routing never leaves the device).
const MOE_DECODE_MAX_ROWS: usize = GEMV_MAX_ROWS;

fn cuda_err(context: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Cuda(format!("{context}: {e}"))
}

fn blas_err(e: cudarc::cublas::result::CublasError) -> Error {
    Error::Cuda(format!("cuBLAS: {e}"))
}

/// A `[rows, cols]` f32 tensor in device memory.
pub struct CudaTensor {
    data: CudaSlice<f32>,
    rows: usize,
    cols: usize,
}

/// A weight on the device: a bf16 matrix `[rows, cols]`, or a vector widened to f32 (norms, biases).
pub enum CudaWeight {
    Matrix {
        data: CudaSlice<u8>,
        rows: usize,
        cols: usize,
    },
    Vector(CudaSlice<f32>),
}

/// One layer's routed experts, read by the expert kernels through a device table of block addresses indexed by
/// expert id. All resident: a slab of the layer's blocks (gate, up, down, each bf16). Offloaded: the blocks live in
/// the host bank and the table points into the shared cache slab, rewritten each step for the routed experts.
pub enum CudaExperts {
    Resident {
        _slab: CudaSlice<u8>,
        table: CudaSlice<u64>,
        addresses: Vec<u64>,
        hidden: usize,
        inter: usize,
    },
    Offloaded {
        layer: usize,
        table: CudaSlice<u64>,
        hidden: usize,
        inter: usize,
    },
}

impl CudaExperts {
    fn shape(&self) -> (usize, usize) {
        match self {
            CudaExperts::Resident { hidden, inter, .. } | CudaExperts::Offloaded { hidden, inter, .. } => {
                (*hidden, *inter)
            }
        }
    }
}

/// RoPE frequencies on the device.
pub struct CudaRope {
    inv_freq: CudaSlice<f32>,
    rotary_dim: usize,
}

/// Routing kept on the device: `ids` and `weights` are `[rows, top_k]`.
pub struct CudaRouting {
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    rows: usize,
    top_k: usize,
}

/// One group of rows of the grouped MoE path, and the experts' shape.
struct ExpertGroup {
    first_row: usize,
    rows: usize,
    hidden: usize,
    inter: usize,
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    functions: HashMap<&'static str, CudaFunction>,
    /// Set by [`CudaBackend::enable_offload`] before a model is loaded.
    offload: Option<Mutex<offload::Offload>>,
    device: String,
    /// Streaming multiprocessors: decode attention splits its keys so as to fill them.
    multiprocessors: usize,
    /// The most shared memory a block may opt into (the attention kernel's pipeline depth depends on it).
    max_shared_per_block: usize,
    /// Attention blocks one multiprocessor runs at once, by (threads, shared bytes) of the block: asked of the
    /// driver once per shape, not at every decode step.
    attention_blocks_per_multiprocessor: Mutex<HashMap<(u32, usize), usize>>,
    pub libraries: CudaLibraries,
}

const KERNELS: &[(&str, &[&str])] = &[
    (
        "elementwise",
        &[
            "embed_bf16",
            "rms_norm",
            "add_rms_norm",
            "add_assign",
            "add_bias",
            "silu_mul",
            "silu_mul_halves",
            "sigmoid_gate",
            "select_rows",
            "split_bf16",
        ],
    ),
    ("gemv", &GEMV_KERNELS),
    (
        "gdn",
        &[
            "causal_conv1d",
            "conv_state_update",
            "gated_delta_rule",
            "gated_delta_rule_chunked",
            "sigmoid_gate_elementwise",
        ],
    ),
    ("attention", &["attention", "attention_combine"]),
    ("qkv", &["qkv_rope_kv_append"]),
    (
        "moe",
        &[
            "route_softmax_topk",
            "moe_gate_up",
            "moe_down",
            "gather_rows",
            "scatter_rows",
            "moe_combine",
        ],
    ),
];

fn grid_1d(n: usize, threads: u32) -> LaunchConfig {
    let blocks = n.div_ceil(threads as usize).clamp(1, 65_535 * 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Warps of a GEMV block that split each weight row's k-steps between them (1, 2, 4 or 8): more when n is small,
/// until the launch has `GEMV_MIN_BLOCKS` blocks or each warp is down to one k-step.
fn gemv_k_slices(rows: usize, n: usize, k: usize) -> usize {
    let rows_per_warp = GEMV_ROWS_PER_WARP[rows - 1];
    let steps = k.div_ceil(WARP_STEP_COLS);
    let mut slices = 1;
    while slices < GEMV_WARPS
        && n.div_ceil(GEMV_WARPS / slices * rows_per_warp) < GEMV_MIN_BLOCKS
        && steps >= 2 * slices
    {
        slices *= 2;
    }
    slices
}

impl CudaBackend {
    /// Opens GPU `ordinal`: loads the driver and cuBLAS, creates a context and a stream, loads the kernels.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !ferry_kernels::available() {
            return Err(Error::Cuda(
                "this ferry binary was built without CUDA kernels (nvcc was not found at build time); run \
                 scripts/install-cuda-toolchain.sh, then rebuild"
                    .into(),
            ));
        }
        let libraries = libs::load_cuda_libraries()?;
        let count = CudaContext::device_count().map_err(cuda_err("no usable NVIDIA GPU (cuInit failed)"))?;
        if count <= ordinal as i32 {
            return Err(Error::Cuda(format!("no GPU {ordinal}: {count} found")));
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("creating a context"))?;
        // ferry orders its work with its own streams and events; cudarc's per-buffer events would add a record
        // and a wait to every launch.
        unsafe { ctx.disable_event_tracking() };
        keep_freed_memory_pooled(&ctx)?;
        let stream = ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        let blas = CudaBlas::new(stream.clone()).map_err(blas_err)?;
        let mut functions = HashMap::new();
        for (module, names) in KERNELS {
            let image = ferry_kernels::module(module)
                .ok_or_else(|| Error::Cuda(format!("kernel module {module} missing from this build")))?;
            let loaded = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(image.to_vec()))
                .map_err(cuda_err(&format!(
                    "loading kernel module {module} (does this GPU's architecture have code in the fatbin?)"
                )))?;
            for name in *names {
                let f = loaded.load_function(name).map_err(cuda_err(name))?;
                functions.insert(*name, f);
            }
        }
        let attribute = |a, what| ctx.attribute(a).map(|v| v as usize).map_err(cuda_err(what));
        let multiprocessors = attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "multiprocessor count",
        )?;
        let max_shared_per_block = attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            "shared memory per block",
        )?;
        functions["attention"]
            .set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                max_shared_per_block as i32,
            )
            .map_err(cuda_err("attention shared memory"))?;
        functions["gated_delta_rule_chunked"]
            .set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                gdn::CHUNKED_MAX_SHARED_BYTES as i32,
            )
            .map_err(cuda_err("gated_delta_rule_chunked shared memory"))?;
        let (major, minor) = ctx.compute_capability().map_err(cuda_err("compute capability"))?;
        let device = format!(
            "{} (sm_{major}{minor}, {:.1} GiB)",
            ctx.name().map_err(cuda_err("device name"))?,
            ctx.total_mem().map_err(cuda_err("device memory"))? as f64 / (1u64 << 30) as f64
        );
        tracing::info!(
            "CUDA: {device}; driver {}, cuBLAS {}, cuBLASLt {}",
            libraries.driver,
            libraries.cublas,
            libraries.cublas_lt
        );
        Ok(CudaBackend {
            ctx,
            stream,
            blas,
            functions,
            offload: None,
            device,
            multiprocessors,
            max_shared_per_block,
            attention_blocks_per_multiprocessor: Mutex::new(HashMap::new()),
            libraries,
        })
    }

    /// Keeps the routed experts of models loaded from now on in a host bank, with `slots` of them cached on the GPU.
    pub fn enable_offload(&mut self, slots: usize) -> Result<()> {
        self.offload = Some(Mutex::new(offload::Offload::new(self.ctx.clone(), slots)?));
        Ok(())
    }

    /// The GPU's name, architecture and memory, as the log shows it.
    pub fn device_name(&self) -> &str {
        &self.device
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Bytes free and total on the device (cuMemGetInfo).
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(cuda_err("cuMemGetInfo"))
    }

    fn function(&self, name: &str) -> &CudaFunction {
        &self.functions[name]
    }

    fn alloc<T: cudarc::driver::DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every caller hands the buffer to a kernel or copy that writes all of it before it is read.
        unsafe { self.stream.alloc::<T>(len.max(1)) }.map_err(cuda_err("allocating device memory"))
    }

    fn copy_to_device<T: cudarc::driver::DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        if host.is_empty() {
            return self.alloc(1);
        }
        self.stream.clone_htod(host).map_err(cuda_err("copy to device"))
    }

    fn address<T>(&self, slice: &CudaSlice<T>) -> u64 {
        slice.device_ptr(&self.stream).0
    }

    fn tensor(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        Ok(CudaTensor {
            data: self.alloc(rows * cols)?,
            rows,
            cols,
        })
    }

    /// `out = x W^T (+ bias)` for a bf16 weight `[n, k]` at device address `w`.
    fn matmul(&self, x: &CudaTensor, w: u64, n: usize, k: usize, bias: Option<&CudaSlice<f32>>) -> Result<CudaTensor> {
        if x.cols != k {
            return Err(Error::Cuda(format!(
                "matmul: input has {} features, weight expects {k}",
                x.cols
            )));
        }
        let out = self.tensor(x.rows, n)?;
        if x.rows == 0 {
            return Ok(out);
        }
        if x.rows <= GEMV_MAX_ROWS {
            let slices = gemv_k_slices(x.rows, n, k);
            let block_rows = GEMV_WARPS / slices * GEMV_ROWS_PER_WARP[x.rows - 1];
            let (k32, n32, slices32) = (k as i32, n as i32, slices as i32);
            let bias = bias.map_or(0, |b| self.address(b));
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(block_rows) as u32, 1, 1),
                block_dim: (GEMV_WARPS as u32 * 32, 1, 1),
                shared_mem_bytes: 0,
            };
            self.launch(GEMV_KERNELS[x.rows - 1], cfg, |kernel| {
                kernel
                    .arg(&x.data)
                    .arg(&k32)
                    .arg(&w)
                    .arg(&n32)
                    .arg(&slices32)
                    .arg(&bias)
                    .arg(&out.data);
            })?;
            return Ok(out);
        }
        let (hi, lo) = self.split_bf16(x)?;
        self.gemm_split(&hi, &lo, 0, x.rows, w, n, k, &out)?;
        if let Some(b) = bias {
            let (len, cols) = (out.rows * out.cols, out.cols as i32);
            self.launch("add_bias", grid_1d(len, 256), |kernel| {
                kernel.arg(&out.data).arg(b).arg(&len).arg(&cols);
            })?;
        }
        Ok(out)
    }

    /// `x = hi + lo`, both bf16: products of bf16 are exact in f32, so a GEMM of each half, summed in f32, keeps
    /// f32 accuracy on the bf16 tensor cores.
    fn split_bf16(&self, x: &CudaTensor) -> Result<(CudaSlice<u16>, CudaSlice<u16>)> {
        let len = x.rows * x.cols;
        let hi: CudaSlice<u16> = self.alloc(len)?;
        let lo: CudaSlice<u16> = self.alloc(len)?;
        self.launch("split_bf16", grid_1d(len, 256), |kernel| {
            kernel.arg(&x.data).arg(&hi).arg(&lo).arg(&len);
        })?;
        Ok((hi, lo))
    }

    /// `out[rows, n] = (hi + lo)[rows, k] W^T` for the bf16 weight `[n, k]` at `w`, where hi, lo and out start
    /// `first_row` rows into their buffers: two bf16 tensor-core GEMMs accumulated in f32.
    #[allow(clippy::too_many_arguments)]
    fn gemm_split(
        &self,
        hi: &CudaSlice<u16>,
        lo: &CudaSlice<u16>,
        first_row: usize,
        rows: usize,
        w: u64,
        n: usize,
        k: usize,
        out: &CudaTensor,
    ) -> Result<()> {
        let (alpha, zero, one) = (1.0f32, 0.0f32, 1.0f32);
        let out_ptr = self.address(&out.data) + (first_row * out.cols * 4) as u64;
        for (half, beta) in [(hi, &zero), (lo, &one)] {
            let input = self.address(half) + (first_row * k * 2) as u64;
            // Row-major out[rows, n] = x[rows, k] W[n, k]^T is column-major out^T = W^T(k x n)^T x^T.
            unsafe {
                blas::gemm_ex(
                    *self.blas.handle(),
                    blas_sys::cublasOperation_t::CUBLAS_OP_T,
                    blas_sys::cublasOperation_t::CUBLAS_OP_N,
                    n as i32,
                    rows as i32,
                    k as i32,
                    &alpha as *const f32 as *const _,
                    w as *const _,
                    blas_sys::cudaDataType_t::CUDA_R_16BF,
                    k as i32,
                    input as *const _,
                    blas_sys::cudaDataType_t::CUDA_R_16BF,
                    k as i32,
                    beta as *const f32 as *const _,
                    out_ptr as *mut _,
                    blas_sys::cudaDataType_t::CUDA_R_32F,
                    out.cols as i32,
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(blas_err)?;
        }
        Ok(())
    }

    fn matrix<'a>(&self, w: &'a CudaWeight) -> Result<(&'a CudaSlice<u8>, usize, usize)> {
        match w {
            CudaWeight::Matrix { data, rows, cols } => Ok((data, *rows, *cols)),
            CudaWeight::Vector(_) => Err(Error::Cuda("a vector weight used as a matrix".into())),
        }
    }

    fn vector<'a>(&self, w: &'a CudaWeight) -> Result<&'a CudaSlice<f32>> {
        match w {
            CudaWeight::Vector(v) => Ok(v),
            CudaWeight::Matrix { .. } => Err(Error::Cuda("a matrix weight used as a vector".into())),
        }
    }

    /// The MoE block for a batch too large for the decode kernels: the routing comes to the host, and the rows
    /// run in groups of at most [`MOE_GROUP_ROWS`] (bounding the workspace of long steps), each expert's rows of a
    /// group gathered and run through cuBLAS, and the results combined in router order.
    fn moe_experts_grouped(
        &self,
        x: &CudaTensor,
        routing: &CudaRouting,
        addresses: &[u64],
        hidden: usize,
        inter: usize,
    ) -> Result<CudaTensor> {
        let ids = self
            .stream
            .clone_dtoh(&routing.ids)
            .map_err(cuda_err("routing to host"))?;
        let out = self.tensor(routing.rows, hidden)?;
        for first_row in (0..routing.rows).step_by(MOE_GROUP_ROWS) {
            let group = ExpertGroup {
                first_row,
                rows: MOE_GROUP_ROWS.min(routing.rows - first_row),
                hidden,
                inter,
            };
            self.moe_expert_group(x, routing, &ids, addresses, &group, &out)?;
        }
        Ok(out)
    }

    /// Rows `group.first_row..+group.rows` of the grouped MoE block, written to the same rows of `out`.
    fn moe_expert_group(
        &self,
        x: &CudaTensor,
        routing: &CudaRouting,
        ids: &[i32],
        addresses: &[u64],
        group: &ExpertGroup,
        out: &CudaTensor,
    ) -> Result<()> {
        let &ExpertGroup {
            first_row,
            rows,
            hidden,
            inter,
        } = group;
        let top_k = routing.top_k;
        let pairs = rows * top_k;
        let ids = &ids[first_row * top_k..first_row * top_k + pairs];
        // The group's (row, k) pairs ordered by expert (stably, so rows keep their order): each expert's pairs are
        // one contiguous run, which its GEMMs read and write in place.
        let mut order: Vec<u32> = (0..pairs as u32).collect();
        order.sort_by_key(|&pair| ids[pair as usize]);
        let source_rows: Vec<u32> = order
            .iter()
            .map(|&pair| (first_row + pair as usize / top_k) as u32)
            .collect();
        let (order_dev, source_rows_dev) = (self.copy_to_device(&order)?, self.copy_to_device(&source_rows)?);
        let gathered = self.tensor(pairs, hidden)?;
        let hidden32 = hidden as i32;
        self.launch_rows("gather_rows", pairs, |kernel| {
            kernel
                .arg(&x.data)
                .arg(&source_rows_dev)
                .arg(&gathered.data)
                .arg(&hidden32);
        })?;
        let mut runs: Vec<(usize, usize, usize)> = Vec::new(); // (expert, first pair, pairs)
        for (i, &pair) in order.iter().enumerate() {
            let e = ids[pair as usize] as usize;
            match runs.last_mut() {
                Some((last, _, len)) if *last == e => *len += 1,
                _ => runs.push((e, i, 1)),
            }
        }
        // Each buffer is dropped (freed in stream order) once read, so that at most 2 * (hidden + inter) floats per
        // pair are alive at once (budget.rs's workspace estimate counts on it).
        let expert_bytes = (inter * hidden * 2) as u64;
        // Gate and up are adjacent in an expert's block: one [2 * inter, hidden] product.
        let gate_up = self.tensor(pairs, 2 * inter)?;
        let (hi, lo) = self.split_bf16(&gathered)?;
        drop(gathered);
        for &(e, first, len) in &runs {
            self.gemm_split(&hi, &lo, first, len, addresses[e], 2 * inter, hidden, &gate_up)?;
        }
        drop((hi, lo));
        let act = self.tensor(pairs, inter)?;
        let (len, inter32) = (pairs * inter, inter as i32);
        self.launch("silu_mul_halves", grid_1d(len, 256), |kernel| {
            kernel.arg(&gate_up.data).arg(&inter32).arg(&act.data).arg(&len);
        })?;
        drop(gate_up);
        let (hi, lo) = self.split_bf16(&act)?;
        drop(act);
        let by_expert = self.tensor(pairs, hidden)?;
        for &(e, first, len) in &runs {
            let down = addresses[e] + 2 * expert_bytes;
            self.gemm_split(&hi, &lo, first, len, down, hidden, inter, &by_expert)?;
        }
        drop((hi, lo));
        let y = self.tensor(pairs, hidden)?;
        self.launch_rows("scatter_rows", pairs, |kernel| {
            kernel.arg(&by_expert.data).arg(&order_dev).arg(&y.data).arg(&hidden32);
        })?;
        // The group's router weights and output rows, as addresses into the whole batch's.
        let weights = self.address(&routing.weights) + (first_row * top_k * 4) as u64;
        let out_rows = self.address(&out.data) + (first_row * hidden * 4) as u64;
        let top_k32 = top_k as i32;
        self.launch("moe_combine", per_row(rows, 256), |kernel| {
            kernel
                .arg(&y.data)
                .arg(&weights)
                .arg(&top_k32)
                .arg(&hidden32)
                .arg(&out_rows);
        })
    }

    /// Launches kernel `name` with `cfg` on the compute stream, its arguments pushed by `args` in the kernel's
    /// parameter order.
    fn launch<'a>(
        &'a self,
        name: &str,
        cfg: LaunchConfig,
        args: impl FnOnce(&mut cudarc::driver::LaunchArgs<'a>),
    ) -> Result<()> {
        let mut builder = self.stream.launch_builder(self.function(name));
        args(&mut builder);
        // SAFETY: every caller pushes the kernel's parameters in order, with the types its .cu signature names.
        unsafe { builder.launch(cfg) }.map_err(cuda_err(name))?;
        Ok(())
    }

    /// Launches a one-block-per-row kernel whose arguments `args` pushes.
    fn launch_rows<'a>(
        &'a self,
        name: &str,
        rows: usize,
        args: impl FnOnce(&mut cudarc::driver::LaunchArgs<'a>),
    ) -> Result<()> {
        self.launch(name, per_row(rows, 256), args)
    }
}

/// Freed device memory stays in the stream-ordered pool instead of going back to the driver at every
/// synchronisation, so the per-step allocations of a forward pass cost no driver calls. What earlier backends of
/// this process left in the pool is released first, so that cuMemGetInfo shows what this one allocates.
fn keep_freed_memory_pooled(ctx: &CudaContext) -> Result<()> {
    let mut pool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .map_err(cuda_err("default memory pool"))?;
        ctx.synchronize().map_err(cuda_err("synchronize"))?;
        sys::cuMemPoolTrimTo(pool, 0)
            .result()
            .map_err(cuda_err("trimming the memory pool"))?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut _,
        )
        .result()
        .map_err(cuda_err("memory pool release threshold"))?;
    }
    Ok(())
}

/// The bytes of a bf16 matrix, as stored.
pub(super) fn bf16_bytes(t: &TensorRef) -> Result<&[u8]> {
    if t.dtype != DType::BF16 {
        return Err(Error::tensor(
            &t.name,
            format!("the CUDA backend runs bf16 weights; this one is {}", t.dtype.name()),
        ));
    }
    Ok(t.bytes())
}

/// What [`Backend::check_router`] and [`Backend::route`] answer for a router kind without a kernel here.
fn no_router_for(kind: RouterKind) -> Error {
    Error::Config(format!(
        "the CUDA backend has no router for {kind:?} yet (the CPU backend has)"
    ))
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Experts = CudaExperts;
    type Kv = DeviceKv;
    type Batch = DeviceBatch;
    type Routing = CudaRouting;
    type RopeTable = CudaRope;

    fn name(&self) -> String {
        format!("cuda: {}", self.device)
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(cuda_err("synchronize"))
    }

    fn offload_stats(&self) -> Option<OffloadStats> {
        self.offload
            .as_ref()
            .map(|o| o.lock().unwrap_or_else(|e| e.into_inner()).stats())
    }

    fn weight(&self, tensor: TensorRef) -> Result<CudaWeight> {
        match tensor.shape.len() {
            1 => Ok(CudaWeight::Vector(self.copy_to_device(&tensor.to_f32_vec())?)),
            2 => Ok(CudaWeight::Matrix {
                data: self.copy_to_device(bf16_bytes(&tensor)?)?,
                rows: tensor.shape[0],
                cols: tensor.shape[1],
            }),
            _ => Err(Error::tensor(
                &tensor.name,
                format!("expected a matrix or vector, found {:?}", tensor.shape),
            )),
        }
    }

    fn check_router(&self, kind: RouterKind) -> Result<()> {
        match kind {
            RouterKind::SoftmaxTopK { .. } => Ok(()),
            RouterKind::SigmoidGroupedTopK { .. } => Err(no_router_for(kind)),
        }
    }

    fn experts(&self, experts: Vec<ExpertTensors>, activation: ExpertActivation) -> Result<CudaExperts> {
        let biased = experts.iter().any(ExpertTensors::has_bias);
        if activation != ExpertActivation::SiluGlu || biased {
            let biases = if biased { " with biases" } else { "" };
            return Err(Error::Config(format!(
                "the CUDA backend has no expert kernels for {activation:?}{biases} yet (the CPU backend has)"
            )));
        }
        let first = experts
            .first()
            .ok_or_else(|| Error::Cuda("a MoE layer without experts".into()))?;
        let (inter, hidden) = (first.gate.shape[0], first.gate.shape[1]);
        if let Some(offload) = &self.offload {
            let layer = offload
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .add_layer(&self.stream, &experts)?;
            let table = self
                .stream
                .alloc_zeros::<u64>(experts.len())
                .map_err(cuda_err("allocating a slot table"))?;
            return Ok(CudaExperts::Offloaded {
                layer,
                table,
                hidden,
                inter,
            });
        }
        // One expert's gate, up and down, back to back, in bytes.
        let block = 3 * inter * hidden * 2;
        let mut slab: CudaSlice<u8> = self.alloc(block * experts.len())?;
        for (e, expert) in experts.iter().enumerate() {
            for (part, t) in [&expert.gate, &expert.up, &expert.down].into_iter().enumerate() {
                let bytes = bf16_bytes(t)?;
                let start = e * block + part * inter * hidden * 2;
                let mut dst = slab.slice_mut(start..start + bytes.len());
                self.stream
                    .memcpy_htod(bytes, &mut dst)
                    .map_err(cuda_err("uploading experts"))?;
            }
        }
        let base = self.address(&slab);
        let addresses: Vec<u64> = (0..experts.len()).map(|e| base + (e * block) as u64).collect();
        Ok(CudaExperts::Resident {
            table: self.copy_to_device(&addresses)?,
            _slab: slab,
            addresses,
            hidden,
            inter,
        })
    }

    fn rope_table(&self, rope: &Rope) -> Result<CudaRope> {
        Ok(CudaRope {
            inv_freq: self.copy_to_device(&rope.inv_freq)?,
            rotary_dim: rope.rotary_dim,
        })
    }

    fn new_kv(&self, spec: KvSpec) -> Result<DeviceKv> {
        DeviceKv::new(&self.stream, spec)
    }

    fn prepare_batch(&self, kv: &mut DeviceKv, batch: &[SeqSlice]) -> Result<DeviceBatch> {
        kv.prepare(&self.stream, batch)
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaTensor> {
        check_upload(data.len(), rows, cols)?;
        Ok(CudaTensor {
            data: self.copy_to_device(data)?,
            rows,
            cols,
        })
    }

    fn to_host(&self, x: &CudaTensor) -> Result<Vec<f32>> {
        self.stream.clone_dtoh(&x.data).map_err(cuda_err("copy to host"))
    }

    fn shape(&self, x: &CudaTensor) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32]) -> Result<CudaTensor> {
        let (data, _, hidden) = self.matrix(table)?;
        let ids_dev = self.copy_to_device(ids)?;
        let out = self.tensor(ids.len(), hidden)?;
        let cols = hidden as i32;
        self.launch_rows("embed_bf16", ids.len(), |kernel| {
            kernel.arg(data).arg(&ids_dev).arg(&out.data).arg(&cols);
        })
        .map(|_| out)
    }

    fn rms_norm(&self, x: &CudaTensor, weight: &CudaWeight, group: usize, eps: f32) -> Result<CudaTensor> {
        let w = self.vector(weight)?;
        let out = self.tensor(x.rows, x.cols)?;
        let groups = x.rows * x.cols / group;
        let group32 = group as i32;
        let threads = (group.div_ceil(32) * 32).clamp(32, 1024) as u32;
        self.launch("rms_norm", per_row(groups, threads), |kernel| {
            kernel.arg(&x.data).arg(w).arg(&out.data).arg(&group32).arg(&eps);
        })?;
        Ok(out)
    }

    fn linear(&self, x: &CudaTensor, w: &CudaWeight, bias: Option<&CudaWeight>) -> Result<CudaTensor> {
        let (data, n, k) = self.matrix(w)?;
        let bias = bias.map(|b| self.vector(b)).transpose()?;
        self.matmul(x, self.address(data), n, k, bias)
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        let len = x.rows * x.cols;
        self.launch("add_assign", grid_1d(len, 256), |kernel| {
            kernel.arg(&x.data).arg(&y.data).arg(&len);
        })?;
        Ok(())
    }

    fn add_rms_norm(&self, x: &mut CudaTensor, y: &CudaTensor, weight: &CudaWeight, eps: f32) -> Result<CudaTensor> {
        let w = self.vector(weight)?;
        let out = self.tensor(x.rows, x.cols)?;
        let cols = x.cols as i32;
        let threads = (x.cols.div_ceil(32) * 32).clamp(32, 1024) as u32;
        self.launch("add_rms_norm", per_row(x.rows, threads), |kernel| {
            kernel
                .arg(&x.data)
                .arg(&y.data)
                .arg(w)
                .arg(&out.data)
                .arg(&cols)
                .arg(&eps);
        })?;
        Ok(out)
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
        let out = self.tensor(gate.rows, gate.cols)?;
        let len = gate.rows * gate.cols;
        self.launch("silu_mul", grid_1d(len, 256), |kernel| {
            kernel.arg(&gate.data).arg(&up.data).arg(&out.data).arg(&len);
        })?;
        Ok(out)
    }

    fn sigmoid_gate(&self, x: &mut CudaTensor, gate: &CudaTensor) -> Result<()> {
        if gate.cols == x.cols {
            let len = x.rows * x.cols;
            self.launch("sigmoid_gate_elementwise", grid_1d(len, 256), |kernel| {
                kernel.arg(&x.data).arg(&gate.data).arg(&len);
            })?;
            return Ok(());
        }
        let cols = x.cols as i32;
        self.launch_rows("sigmoid_gate", x.rows, |kernel| {
            kernel.arg(&x.data).arg(&gate.data).arg(&cols);
        })
    }

    fn causal_conv1d(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        kv: &mut DeviceKv,
        layer: usize,
        batch: &DeviceBatch,
    ) -> Result<CudaTensor> {
        self.causal_conv1d_on_device(x, weight, kv, layer, batch)
    }

    fn gated_delta_rule(
        &self,
        qkv: &CudaTensor,
        a: &CudaTensor,
        b: &CudaTensor,
        a_log: &CudaWeight,
        dt_bias: &CudaWeight,
        kv: &mut DeviceKv,
        layer: usize,
        batch: &DeviceBatch,
        params: &DeltaRuleParams,
    ) -> Result<CudaTensor> {
        self.gated_delta_rule_on_device(qkv, a, b, a_log, dt_bias, kv, layer, batch, params)
    }

    fn attention(
        &self,
        qkv: &CudaTensor,
        qk_norm: Option<QkNormWeights<'_, CudaWeight>>,
        rope: &CudaRope,
        kv: &mut DeviceKv,
        layer: usize,
        batch: &DeviceBatch,
        p: &AttentionParams,
    ) -> Result<CudaTensor> {
        if p.head_dim > 256 {
            return Err(Error::Cuda(format!(
                "head_dim {} is over the attention kernel's 256",
                p.head_dim
            )));
        }
        let q_width = p.num_heads * p.head_dim;
        p.check_qkv_width(qkv.cols)?;
        let q = self.tensor(qkv.rows, q_width)?;
        let (k_pool, v_pool) = kv.layer_pools(layer, p.num_kv_heads * p.head_dim)?;
        let null = 0u64;
        let (q_norm, k_norm) = match &qk_norm {
            Some(n) => (self.address(self.vector(n.q)?), self.address(self.vector(n.k)?)),
            None => (null, null),
        };
        let (per_head, eps) = qk_norm.map_or((1, 0.0f32), |n| (n.per_head as i32, n.eps));
        let (heads, kv_heads, head_dim) = (p.num_heads as i32, p.num_kv_heads as i32, p.head_dim as i32);
        let rotary_dim = rope.rotary_dim as i32;
        let cfg = LaunchConfig {
            grid_dim: (qkv.rows as u32, (p.num_heads + p.num_kv_heads) as u32, 1),
            block_dim: (p.head_dim.div_ceil(32) as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch("qkv_rope_kv_append", cfg, |kernel| {
            kernel
                .arg(&qkv.data)
                .arg(&heads)
                .arg(&kv_heads)
                .arg(&head_dim)
                .arg(&q_norm)
                .arg(&k_norm)
                .arg(&per_head)
                .arg(&eps)
                .arg(&batch.positions)
                .arg(&rope.inv_freq)
                .arg(&rotary_dim)
                .arg(&batch.row_slot)
                .arg(&q.data)
                .arg(k_pool)
                .arg(v_pool);
        })?;
        self.attend(&q, kv, layer, batch, p)
    }

    fn route(&self, logits: &CudaTensor, router: Router<'_, CudaWeight>) -> Result<CudaRouting> {
        let (top_k, RouterKind::SoftmaxTopK { renormalize }) = (router.top_k, router.kind) else {
            return Err(no_router_for(router.kind));
        };
        if logits.cols > 512 {
            return Err(Error::Cuda(format!(
                "{} experts is over the router kernel's 512",
                logits.cols
            )));
        }
        let ids: CudaSlice<i32> = self.alloc(logits.rows * top_k)?;
        let weights: CudaSlice<f32> = self.alloc(logits.rows * top_k)?;
        let (experts, k, renorm) = (logits.cols as i32, top_k as i32, renormalize as i32);
        self.launch("route_softmax_topk", per_row(logits.rows, 32), |kernel| {
            kernel
                .arg(&logits.data)
                .arg(&experts)
                .arg(&k)
                .arg(&renorm)
                .arg(&ids)
                .arg(&weights);
        })?;
        Ok(CudaRouting {
            ids,
            weights,
            rows: logits.rows,
            top_k,
        })
    }

    fn routing_to_host(&self, routing: &CudaRouting) -> Result<Vec<u32>> {
        let ids = self
            .stream
            .clone_dtoh(&routing.ids)
            .map_err(cuda_err("routing to host"))?;
        Ok(ids
            .into_iter()
            .take(routing.rows * routing.top_k)
            .map(|e| e as u32)
            .collect())
    }

    fn routing_from_host(&self, ids: &[u32], weights: &[f32], top_k: usize) -> Result<CudaRouting> {
        let signed: Vec<i32> = ids.iter().map(|&e| e as i32).collect();
        Ok(CudaRouting {
            ids: self.copy_to_device(&signed)?,
            weights: self.copy_to_device(weights)?,
            rows: ids.len() / top_k.max(1),
            top_k,
        })
    }

    fn moe_experts(&self, x: &CudaTensor, routing: &CudaRouting, experts: &CudaExperts) -> Result<CudaTensor> {
        let (table, addresses) = match experts {
            // Borrowed: the decode path never reads the addresses, only the grouped prefill path does.
            CudaExperts::Resident { table, addresses, .. } => (table, Cow::Borrowed(addresses.as_slice())),
            CudaExperts::Offloaded { layer, table, .. } => {
                let offload = self
                    .offload
                    .as_ref()
                    .ok_or_else(|| Error::Cuda("offloaded experts without offload".into()))?;
                let addresses = offload.lock().unwrap_or_else(|e| e.into_inner()).prepare_layer(
                    &self.stream,
                    *layer,
                    routing,
                    table,
                )?;
                (table, Cow::Owned(addresses))
            }
        };
        let (hidden, inter) = experts.shape();
        if x.rows > MOE_DECODE_MAX_ROWS {
            return self.moe_experts_grouped(x, routing, &addresses, hidden, inter);
        }
        let (hidden32, inter32, top_k) = (hidden as i32, inter as i32, routing.top_k as i32);
        let pairs = routing.rows * routing.top_k;
        let act = self.tensor(pairs, inter)?;
        let block = (GEMV_WARPS as u32 * 32, 1, 1);
        self.launch(
            "moe_gate_up",
            LaunchConfig {
                grid_dim: (inter.div_ceil(GEMV_WARPS) as u32, pairs as u32, 1),
                block_dim: block,
                shared_mem_bytes: 0,
            },
            |kernel| {
                kernel
                    .arg(&x.data)
                    .arg(&hidden32)
                    .arg(&inter32)
                    .arg(&top_k)
                    .arg(&routing.ids)
                    .arg(table)
                    .arg(&act.data);
            },
        )?;
        let out = self.tensor(routing.rows, hidden)?;
        // Each warp takes (expert, feature group) items: with few experts per row, more feature groups per block
        // keep every warp busy.
        let feature_groups = (GEMV_WARPS / routing.top_k).max(1);
        let block_features = feature_groups * MOE_DOWN_ROWS;
        let groups32 = feature_groups as i32;
        self.launch(
            "moe_down",
            LaunchConfig {
                grid_dim: (hidden.div_ceil(block_features) as u32, routing.rows as u32, 1),
                block_dim: block,
                shared_mem_bytes: (routing.top_k * block_features * std::mem::size_of::<f32>()) as u32,
            },
            |kernel| {
                kernel
                    .arg(&act.data)
                    .arg(&hidden32)
                    .arg(&inter32)
                    .arg(&top_k)
                    .arg(&routing.ids)
                    .arg(&routing.weights)
                    .arg(table)
                    .arg(&groups32)
                    .arg(&out.data);
            },
        )?;
        Ok(out)
    }

    fn select_rows(&self, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor> {
        let rows32: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let rows_dev = self.copy_to_device(&rows32)?;
        let out = self.tensor(rows.len(), x.cols)?;
        let cols = x.cols as i32;
        self.launch_rows("select_rows", rows.len(), |kernel| {
            kernel.arg(&x.data).arg(&rows_dev).arg(&out.data).arg(&cols);
        })
        .map(|_| out)
    }
}
