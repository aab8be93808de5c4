//! Opening the GPU: the driver and cuBLAS loaded, a context and a compute stream created, every kernel module of
//! ferry-kernels loaded into the function table the launches read, and what the launches need to know about the
//! device (multiprocessors, shared memory per block).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaStream};

use super::memory::keep_freed_memory_pooled;
use super::{attention, flash_attention, gdn, libs, linear, mla, CudaBackend};
use crate::{Error, Result};

pub(super) fn cuda_err(context: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Cuda(format!("{context}: {e}"))
}

pub(super) fn blas_err(e: cudarc::cublas::result::CublasError) -> Error {
    Error::Cuda(format!("cuBLAS: {e}"))
}

/// Every kernel the backend launches, by module (a `cuda/NAME.cu` of ferry-kernels).
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
            "argmax_rows",
            "split_bf16",
            "read_mapped",
        ],
    ),
    ("gemv", &linear::GEMV_KERNELS),
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
    ("attention", &attention::KERNELS),
    ("flash_attention", &flash_attention::FLASH_KERNELS),
    ("qkv", &["qkv_rope_kv_append"]),
    ("mla", &mla::KERNELS),
    (
        "moe",
        &[
            "route_softmax_topk",
            "route_sigmoid_grouped_topk",
            "moe_gate_up",
            "moe_down",
            "moe_down_shard",
            "moe_down_pairs",
            "moe_gate_up_fp8",
            "moe_down_fp8",
            "moe_down_fp8_shard",
            "moe_down_pairs_fp8",
            "dequantize_fp8_expert",
            "moe_gate_up_mxfp4",
            "moe_down_mxfp4",
            "moe_down_mxfp4_shard",
            "moe_down_pairs_mxfp4",
            "dequantize_mxfp4_expert",
            "moe_glu_grouped",
            "moe_add_down_bias",
            "gather_rows",
            "moe_combine",
        ],
    ),
];

/// Loads every kernel of [`KERNELS`] into `ctx`, by name.
fn load_kernels(ctx: &Arc<CudaContext>) -> Result<HashMap<&'static str, CudaFunction>> {
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
    Ok(functions)
}

/// Kernel `name` of a loaded table; an error, not a panic, for a name the table lacks.
fn kernel<'a>(functions: &'a HashMap<&str, CudaFunction>, name: &str) -> Result<&'a CudaFunction> {
    functions
        .get(name)
        .ok_or_else(|| Error::Cuda(format!("kernel {name} is not in the kernel table")))
}

/// Lets kernel `name` ask for up to `bytes` of dynamic shared memory per block.
fn allow_shared_bytes(functions: &HashMap<&str, CudaFunction>, name: &str, bytes: usize) -> Result<()> {
    kernel(functions, name)?
        .set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(cuda_err(&format!("{name} shared memory")))
}

impl CudaBackend {
    /// Opens GPU `ordinal`: loads the driver and cuBLAS, creates a context and a stream, loads the kernels. Decode
    /// steps run as CUDA graphs (graph.rs) unless [`super::CudaBackendBuilder::cuda_graphs`] turns them off.
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
        let functions = load_kernels(&ctx)?;
        let block_counter = stream
            .alloc_zeros::<u32>(1)
            .map_err(cuda_err("allocating the block counter"))?;
        let attribute = |a, what| ctx.attribute(a).map(|v| v as usize).map_err(cuda_err(what));
        let multiprocessors = attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "multiprocessor count",
        )?;
        let max_shared_per_block = attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            "shared memory per block",
        )?;
        for name in attention::ATTENTION_KERNELS
            .into_iter()
            .chain(flash_attention::FLASH_KERNELS)
        {
            allow_shared_bytes(&functions, name, max_shared_per_block)?;
        }
        allow_shared_bytes(&functions, "gated_delta_rule_chunked", gdn::CHUNKED_MAX_SHARED_BYTES)?;
        allow_shared_bytes(&functions, "mla_attend", max_shared_per_block)?;
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
            block_counter,
            dependent_launch: major >= 9,
            offload: None,
            graphs: Some(Mutex::new(Default::default())),
            step_inputs: Mutex::new(None),
            device,
            multiprocessors,
            max_shared_per_block,
            attention_blocks_per_multiprocessor: Mutex::new(HashMap::new()),
            libraries,
        })
    }

    /// Decode steps captured as CUDA graphs so far (graph.rs).
    pub fn captured_steps(&self) -> usize {
        self.graphs
            .as_ref()
            .map_or(0, |g| g.lock().unwrap_or_else(|e| e.into_inner()).captures())
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

    /// The loaded kernel `name`.
    pub(super) fn function(&self, name: &str) -> Result<&CudaFunction> {
        kernel(&self.functions, name)
    }
}

#[cfg(test)]
mod tests;
