//! Choosing the backend a command runs on (`--device cpu|cuda|auto`) and opening the model's checkpoint
//! (`--model DIR` or `--synthetic CONFIG.json`).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use ferry_core::backend::cpu::CpuBackend;
use ferry_core::backend::cuda::{CudaBackend, OffloadConfig};
use ferry_core::engine::plan::{parse_size, plan_memory, BudgetRequest, MemoryPlan, OffloadMode, MAX_BATCH_TOKENS};
use ferry_core::loader::Checkpoint;
use ferry_core::model::{spec_for, ModelInfo};
use ferry_core::moe::Lru;

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    Cpu,
    Cuda,
    /// The GPU when there is one, else the CPU.
    Auto,
}

/// An opened backend.
pub enum Backends {
    Cpu(CpuBackend),
    Cuda(Box<CudaBackend>),
}

/// Where routed experts live (`--offload`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OffloadChoice {
    /// Everything on the GPU.
    None,
    /// Routed experts in host RAM, the hot ones in a GPU cache sized from the budget: dense weights and workspace
    /// first, then the KV floor, then cache slots, the rest to KV.
    Experts,
    /// `none` when the whole model fits the budget, else `experts`.
    Auto,
}

/// GPU memory and expert offload settings (named as FreeToken names them where it has them).
#[derive(clap::Args, Clone, Debug)]
pub struct OffloadArgs {
    /// Everything ferry allocates on the GPU stays under this, e.g. 22.3GiB. Default: the GPU's free memory.
    #[arg(long)]
    pub gpu_memory_budget: Option<String>,
    #[arg(long, value_enum, default_value_t = OffloadChoice::Auto)]
    pub offload: OffloadChoice,
    /// Offload the experts with exactly this many GPU cache slots (the rest of the budget goes to KV).
    #[arg(long)]
    pub moe_cache_slots: Option<usize>,
    /// KV tokens kept before expert cache slots are sized.
    #[arg(long, default_value_t = 8192)]
    pub kv_reserve_tokens: usize,
    /// Tokens one forward pass carries at most (a prefill chunk and the running decodes); the GPU workspace is
    /// sized for it. Default: 2048, or 4096 when the experts are offloaded and the budget has room for its
    /// workspace (each prefill chunk streams nearly the whole expert bank, so longer chunks stream it fewer times).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    pub max_batch_tokens: Option<u64>,
}

impl OffloadArgs {
    fn mode(&self) -> Result<OffloadMode> {
        Ok(match self.offload {
            OffloadChoice::None if self.moe_cache_slots.is_some() => {
                bail!("--offload none contradicts --moe-cache-slots")
            }
            OffloadChoice::None => OffloadMode::None,
            OffloadChoice::Experts => OffloadMode::Experts,
            // With --moe-cache-slots the planner offloads.
            OffloadChoice::Auto => OffloadMode::Auto,
        })
    }

    fn is_default(&self) -> bool {
        self.gpu_memory_budget.is_none() && self.offload == OffloadChoice::Auto && self.moe_cache_slots.is_none()
    }

    /// The plan for `checkpoint` under a budget of `budget_bytes`.
    pub fn plan(&self, checkpoint: &Checkpoint, budget_bytes: u64) -> Result<MemoryPlan> {
        let spec = spec_for(&checkpoint.model_type, &checkpoint.config)?;
        let info = ModelInfo::new(&spec, checkpoint.weight_dtype());
        let request = BudgetRequest {
            budget_bytes,
            mode: self.mode()?,
            slots: self.moe_cache_slots,
            kv_reserve_tokens: self.kv_reserve_tokens,
            max_batch_tokens: self.max_batch_tokens.map(|n| n as usize),
        };
        Ok(plan_memory(&info, &spec, &request)?)
    }

    /// Tokens one forward pass carries at most: what the GPU memory plan was sized for, else `--max-batch-tokens`,
    /// else [`MAX_BATCH_TOKENS`].
    pub fn step_tokens(&self, plan: Option<&MemoryPlan>) -> usize {
        plan.map(|p| p.step_tokens)
            .or(self.max_batch_tokens.map(|n| n as usize))
            .unwrap_or(MAX_BATCH_TOKENS)
    }

    pub fn budget_bytes(&self) -> Result<Option<u64>> {
        self.gpu_memory_budget
            .as_deref()
            .map(|b| Ok(parse_size(b)?))
            .transpose()
    }
}

/// Opens the backend; on a GPU, divides its memory budget for `checkpoint` and builds the backend with expert
/// offload (an LRU cache) when the plan says so. Returns the plan (None on the CPU).
pub fn open_backend(
    device: Device,
    offload: &OffloadArgs,
    checkpoint: &Checkpoint,
) -> Result<(Backends, Option<MemoryPlan>)> {
    // FERRY_GEMV_ISA picks the CPU kernels' path; they cannot return an error, so a bad value is reported here,
    // whatever the device.
    ferry_core::backend::cpu::gemv::check_isa_env()?;
    let gpu = match device {
        Device::Cpu => None,
        Device::Cuda => Some(CudaBackend::builder(0).context("--device cuda")?),
        Device::Auto => CudaBackend::builder(0)
            .map_err(|e| tracing::info!("running on the CPU: {e}"))
            .ok(),
    };
    let Some(gpu) = gpu else {
        if !offload.is_default() {
            bail!("--gpu-memory-budget and the offload flags need a GPU (this run is on the CPU)");
        }
        return Ok((Backends::Cpu(CpuBackend), None));
    };
    let budget = match offload.budget_bytes()? {
        Some(b) => b,
        // Leave a little for the CUDA context's own growth and other processes.
        None => (gpu.memory_info()?.0 as u64).saturating_sub(1 << 30),
    };
    let plan = offload.plan(checkpoint, budget)?;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    tracing::info!(
        "GPU budget {:.2} GiB: dense {:.2}, workspace {:.2} ({}-token steps), experts {:.2} ({}), KV {:.2} GiB ({} \
         tokens)",
        gib(budget),
        gib(plan.dense_bytes),
        gib(plan.workspace_bytes),
        plan.step_tokens,
        gib(plan.expert_bytes),
        if plan.offload {
            format!("offloaded, {} cache slots", plan.slots)
        } else {
            "all resident".into()
        },
        gib(plan.kv_bytes),
        plan.kv_tokens
    );
    let gpu = if plan.offload {
        gpu.offload(OffloadConfig {
            slots: plan.slots,
            policy: Box::new(Lru::new()),
            decode_prefetch: true,
        })
    } else {
        gpu
    };
    Ok((Backends::Cuda(Box::new(gpu.build()?)), Some(plan)))
}

/// Runs `$body` with `$be` bound to whichever backend `$backends` holds.
#[macro_export]
macro_rules! with_backend {
    ($backends:expr, $be:ident => $body:expr) => {
        match &$backends {
            $crate::device::Backends::Cpu($be) => $body,
            $crate::device::Backends::Cuda($be) => {
                let $be = &**$be;
                $body
            }
        }
    };
}

#[derive(clap::Args)]
#[group(required = true, multiple = false)]
pub struct ModelArgs {
    /// A Hugging Face checkpoint directory.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A config.json whose model is built with seeded random weights in memory (no files), e.g. bench/q30.json.
    #[arg(long)]
    pub synthetic: Option<PathBuf>,
}

impl ModelArgs {
    pub fn open(&self) -> Result<Checkpoint> {
        Ok(match (&self.model, &self.synthetic) {
            (Some(dir), _) => Checkpoint::open(dir)?,
            (None, Some(config)) => Checkpoint::synthetic(config, 0)?,
            (None, None) => anyhow::bail!("give --model DIR or --synthetic CONFIG.json"),
        })
    }
}
