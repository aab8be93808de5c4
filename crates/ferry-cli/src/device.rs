//! Choosing the backend a command runs on (`--device cpu|cuda|auto`) and opening the model's checkpoint
//! (`--model DIR` or `--synthetic CONFIG.json`).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use ferry_core::backend::cpu::CpuBackend;
use ferry_core::backend::cuda::{CudaBackend, CudaBackendBuilder, LaneCeilings, NcclSum, OffloadConfig};
use ferry_core::backend::expert_parallel::ExpertParallel;
use ferry_core::backend::Backend;
use ferry_core::engine::plan::{parse_size, plan_group, BudgetRequest, MemoryPlan, OffloadMode, MAX_BATCH_TOKENS};
use ferry_core::loader::Checkpoint;
use ferry_core::model::{spec_for, ModelInfo};
use ferry_core::moe::{EvictionPolicy, PolicyChoice, SplitRule};

use crate::doctor_lanes::{split_rule, MoeStrategy};

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
    /// Several GPUs by expert parallelism (`--gpus N`).
    CudaGroup(Box<ExpertParallel<CudaBackend>>),
}

impl Backends {
    /// The GPUs, in rank order (none on the CPU).
    pub fn gpus(&self) -> &[CudaBackend] {
        match self {
            Backends::Cpu(_) => &[],
            Backends::Cuda(cuda) => std::slice::from_ref(&**cuda),
            Backends::CudaGroup(group) => group.ranks(),
        }
    }
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
    /// Which expert leaves a full cache: `default`, or `lru`/`lrfu` followed by any of `+floors` (per-layer floors)
    /// and `+prefill` (prefill-aware admission); `ferry cache-sim` compares them on a routing trace.
    #[arg(long, default_value = "default", value_parser = parse_policy)]
    pub moe_cache_policy: PolicyChoice,
    /// KV tokens kept before expert cache slots are sized.
    #[arg(long, default_value_t = 8192)]
    pub kv_reserve_tokens: usize,
    /// Tokens one forward pass carries at most (a prefill chunk and the running decodes); the GPU workspace is
    /// sized for it. Default: 2048, or 4096 when the experts are offloaded and the budget has room for its
    /// workspace (each prefill chunk streams nearly the whole expert bank, so longer chunks stream it fewer times).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    pub max_batch_tokens: Option<u64>,
    /// Run every step eagerly: all-resident decode steps of up to 8 rows otherwise replay a CUDA graph captured
    /// per row count and context span (the eager path is the reference they are held to).
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Launch each kernel only once the one before it has finished: from sm_90 on, kernels otherwise launch as
    /// programmatic dependents, their launch overlapping the previous kernel's tail (each still waits for it
    /// before it reads).
    #[arg(long)]
    pub no_dependent_launch: bool,
    /// Run on GPUs 0 to N-1 by expert parallelism: each holds the dense part and the KV cache, and its share of the
    /// routed experts (expert e on GPU e mod N), which it alone caches, streams over its own link and computes; the
    /// experts' outputs are summed across the GPUs with NCCL. --gpu-memory-budget is then each GPU's.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub gpus: u64,
    /// Not a flag: recurrent-state snapshots the plan keeps room for (`serve` sets it unless --no-prefix-cache).
    #[arg(skip)]
    pub snapshot_slots: usize,
}

fn parse_policy(name: &str) -> std::result::Result<PolicyChoice, String> {
    name.parse().map_err(|e: ferry_core::Error| e.to_string())
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
        self.gpu_memory_budget.is_none()
            && self.offload == OffloadChoice::Auto
            && self.moe_cache_slots.is_none()
            && self.moe_cache_policy == PolicyChoice::DEFAULT
            && !self.no_cuda_graphs
            && self.gpus == 1
    }

    /// The plan of each GPU (`--gpus`) for `checkpoint` under a budget of `budget_bytes` each.
    pub fn plans(&self, checkpoint: &Checkpoint, budget_bytes: u64) -> Result<Vec<MemoryPlan>> {
        let spec = spec_for(&checkpoint.model_type, &checkpoint.config)?;
        let info = ModelInfo::new(&spec, checkpoint.weight_format());
        let request = BudgetRequest {
            budget_bytes,
            mode: self.mode()?,
            slots: self.moe_cache_slots,
            kv_reserve_tokens: self.kv_reserve_tokens,
            max_batch_tokens: self.max_batch_tokens.map(|n| n as usize),
            snapshot_slots: self.snapshot_slots,
        };
        Ok(plan_group(&info, &spec, &request, self.gpus as usize)?)
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
/// offload (a cache under `--moe-cache-policy`, misses split by `strategy`) when the plan says so. Returns the plan
/// (None on the CPU).
pub fn open_backend(
    device: Device,
    offload: &OffloadArgs,
    strategy: MoeStrategy,
    checkpoint: &Checkpoint,
) -> Result<(Backends, Option<MemoryPlan>)> {
    // FERRY_GEMV_ISA picks the CPU kernels' path; they cannot return an error, so a bad value is reported here,
    // whatever the device.
    ferry_core::backend::cpu::gemv::check_isa_env()?;
    if offload.gpus > 1 {
        return open_group(device, offload, strategy, checkpoint);
    }
    let gpu = match device {
        Device::Cpu => None,
        Device::Cuda => Some(CudaBackend::builder(0).context("--device cuda")?),
        Device::Auto => CudaBackend::builder(0)
            .map_err(|e| tracing::info!("running on the CPU: {e}"))
            .ok(),
    };
    let Some(gpu) = gpu else {
        if !offload.is_default() || strategy != MoeStrategy::Offload {
            bail!(
                "--gpu-memory-budget, --moe-strategy, --no-cuda-graphs, --gpus and the offload flags need a GPU (this \
                 run is on the CPU)"
            );
        }
        return Ok((Backends::Cpu(CpuBackend), None));
    };
    let budget = match offload.budget_bytes()? {
        Some(b) => b,
        None => free_budget(&gpu)?,
    };
    let plan = offload.plans(checkpoint, budget)?.remove(0);
    let gpu = build_gpu(gpu, &plan, budget, offload, strategy, checkpoint)?;
    Ok((Backends::Cuda(Box::new(gpu)), Some(plan)))
}

/// The budget of a GPU given none: its free memory, less a little for the CUDA context's own growth and other
/// processes.
fn free_budget(gpu: &CudaBackendBuilder) -> Result<u64> {
    Ok((gpu.memory_info()?.0 as u64).saturating_sub(1 << 30))
}

/// `--gpus N`: GPUs 0 to N-1 as one expert-parallel group, each under the same budget (the asked one, else the
/// least free memory of any of them) and its own plan, its experts' outputs summed with NCCL. Returns the group's
/// plan (the first GPU's: the largest share of experts, and every GPU's KV).
fn open_group(
    device: Device,
    offload: &OffloadArgs,
    strategy: MoeStrategy,
    checkpoint: &Checkpoint,
) -> Result<(Backends, Option<MemoryPlan>)> {
    let gpus = offload.gpus as usize;
    if device == Device::Cpu {
        bail!("--gpus {gpus} runs on GPUs: give --device cuda (or auto)");
    }
    let builders = (0..gpus)
        .map(|rank| CudaBackend::builder(rank).with_context(|| format!("--gpus {gpus}: GPU {rank}")))
        .collect::<Result<Vec<_>>>()?;
    let budget = match offload.budget_bytes()? {
        Some(b) => b,
        None => builders
            .iter()
            .map(free_budget)
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .min()
            .unwrap_or(0),
    };
    let plans = offload.plans(checkpoint, budget)?;
    let ranks = builders
        .into_iter()
        .zip(&plans)
        .map(|(gpu, plan)| build_gpu(gpu, plan, budget, offload, strategy, checkpoint))
        .collect::<Result<Vec<_>>>()?;
    let sum = NcclSum::new(&ranks).context("--gpus: NCCL")?;
    let group = ExpertParallel::new(ranks, Box::new(sum))?;
    Ok((Backends::CudaGroup(Box::new(group)), plans.into_iter().next()))
}

/// Makes an opened GPU a backend under `plan` (made for a budget of `budget`): with expert offload (a cache under
/// `--moe-cache-policy`, misses split by `strategy`) when the plan says so.
fn build_gpu(
    gpu: CudaBackendBuilder,
    plan: &MemoryPlan,
    budget: u64,
    offload: &OffloadArgs,
    strategy: MoeStrategy,
    checkpoint: &Checkpoint,
) -> Result<CudaBackend> {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    tracing::info!(
        "{} budget {:.2} GiB: dense {:.2}, workspace {:.2} ({}-token steps), experts {:.2} ({}), KV {:.2} GiB ({} \
         tokens)",
        gpu.device_name(),
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
        tracing::info!("expert cache policy {}", offload.moe_cache_policy);
        let name = gpu.device_name().to_string();
        let (policy, split) = offload_start(offload, strategy, checkpoint, plan.slots, &name, |experts, rounds| {
            gpu.measure_lanes(experts, rounds)
        })?;
        gpu.offload(OffloadConfig {
            slots: plan.slots,
            policy,
            decode_prefetch: true,
        })
        .split(split)
    } else {
        if strategy != MoeStrategy::Offload {
            tracing::info!("every expert is resident: --moe-strategy {strategy:?} has no misses to split");
        }
        gpu
    };
    Ok(gpu
        .cuda_graphs(!offload.no_cuda_graphs)
        .dependent_launch(!offload.no_dependent_launch)
        .build()?)
}

/// The expert cache's eviction policy and the misses' split rule that the offload of `checkpoint` (over `slots`
/// cache slots) starts with under `strategy`, on the GPU named `gpu` (`measure` times its lanes when this machine
/// has no cached rates).
fn offload_start(
    offload: &OffloadArgs,
    strategy: MoeStrategy,
    checkpoint: &Checkpoint,
    slots: usize,
    gpu: &str,
    measure: impl FnOnce(usize, usize) -> ferry_core::Result<LaneCeilings>,
) -> Result<(Box<dyn EvictionPolicy>, SplitRule)> {
    let spec = spec_for(&checkpoint.model_type, &checkpoint.config)?;
    let info = ModelInfo::new(&spec, checkpoint.weight_format());
    let top_k = info.experts_per_token;
    let policy = offload.moe_cache_policy.build(
        u32::try_from(slots).context("expert cache slots")?,
        info.num_moe_layers as u32,
        top_k as u32,
    );
    let split = split_rule(strategy, gpu, measure, info.bytes_per_expert as usize, top_k)?;
    Ok((policy, split))
}

/// Starts the expert offload of every GPU of `backends` over, as [`open_backend`] would have started it under
/// `strategy`, the loaded bank kept (`CudaBackend::restart_offload`): `ferry bench`'s later variants on one load.
/// Nothing to do when every expert is resident, or on the CPU, which have `offload` only.
pub fn restart_offload(
    backends: &Backends,
    offload: &OffloadArgs,
    strategy: MoeStrategy,
    checkpoint: &Checkpoint,
) -> Result<()> {
    let gpus = backends.gpus();
    let offloaded = !gpus.is_empty() && gpus.iter().all(|gpu| gpu.offload_stats().is_some());
    if !offloaded {
        if strategy == MoeStrategy::Offload {
            return Ok(());
        }
        if gpus.is_empty() {
            bail!("--moe-strategy {strategy:?} needs a GPU (this run is on the CPU)");
        }
        bail!("--moe-strategy {strategy:?} needs offloaded experts: every expert is resident");
    }
    for gpu in gpus {
        let slots = gpu.offload_stats().map_or(0, |stats| stats.slots);
        let (policy, split) = offload_start(
            offload,
            strategy,
            checkpoint,
            slots,
            gpu.device_name(),
            |experts, rounds| gpu.measure_lanes(experts, rounds),
        )?;
        gpu.restart_offload(policy, split)?;
    }
    Ok(())
}

/// The share of the host memory left after the weights that the CPU backend's KV cache may fill by default.
const CPU_KV_SHARE: f64 = 0.5;
/// Host memory assumed available where neither /proc/meminfo nor a cgroup limit says.
const FALLBACK_AVAILABLE_BYTES: u64 = 8 << 30;
/// The smallest default CPU KV budget, even when the weights leave less memory than that needs.
const MIN_CPU_KV_TOKENS: usize = 2048;

/// `MemAvailable` in a /proc/meminfo text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let kib: u64 = line.trim().strip_suffix("kB")?.trim().parse().ok()?;
    Some(kib * 1024)
}

/// What a cgroup v2 memory limit still allows (`memory.max` less `memory.current`), when there is a limit.
fn cgroup_headroom(max: &str, current: &str) -> Option<u64> {
    let max: u64 = max.trim().parse().ok()?; // "max": no limit
    let current: u64 = current.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

/// Host memory this process can still use: the smaller of the kernel's estimate and the container's headroom.
fn available_host_memory() -> u64 {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    let host = read("/proc/meminfo").as_deref().and_then(mem_available);
    let cgroup = read("/sys/fs/cgroup/memory.max")
        .zip(read("/sys/fs/cgroup/memory.current"))
        .and_then(|(max, current)| cgroup_headroom(&max, &current));
    match (host, cgroup) {
        (Some(a), Some(b)) => a.min(b),
        (a, b) => a.or(b).unwrap_or(FALLBACK_AVAILABLE_BYTES),
    }
}

/// The most tokens the KV cache may hold: on a GPU, what the memory plan left for KV; on the CPU, where keys and
/// values are f32 and grow with the sequences, [`CPU_KV_SHARE`] of the memory available once the weights are
/// resident. The decision is logged.
pub fn kv_budget_tokens(plan: Option<&MemoryPlan>, checkpoint: &Checkpoint) -> Result<usize> {
    if let Some(plan) = plan {
        return Ok(plan.kv_tokens);
    }
    let spec = spec_for(&checkpoint.model_type, &checkpoint.config)?;
    let info = ModelInfo::new(&spec, checkpoint.weight_format());
    // The CPU cache stores f32, twice the bf16 bytes ModelInfo counts.
    let bytes_per_token = (2 * info.kv_bytes_per_token_bf16).max(1);
    let available = available_host_memory();
    let weights = info.dense_bytes + info.expert_bank_bytes;
    let budget = (available.saturating_sub(weights) as f64 * CPU_KV_SHARE) as u64;
    let tokens = usize::try_from(budget / bytes_per_token)
        .unwrap_or(usize::MAX)
        .max(MIN_CPU_KV_TOKENS);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    tracing::info!(
        "CPU KV budget {tokens} tokens ({:.2} GiB at {bytes_per_token} bytes a token): half of the {:.2} GiB of \
         host memory available less the {:.2} GiB of weights; --kv-cache-tokens sets it",
        gib(tokens as u64 * bytes_per_token),
        gib(available),
        gib(weights)
    );
    Ok(tokens)
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
            $crate::device::Backends::CudaGroup($be) => {
                let $be = &**$be;
                $body
            }
        }
    };
}

#[derive(clap::Args)]
#[group(required = true, multiple = false)]
pub struct ModelArgs {
    /// A Hugging Face checkpoint directory, or a hub repo id (owner/name) fetched into the Hugging Face cache.
    #[arg(long)]
    pub model: Option<String>,
    /// A config.json whose model is built with seeded random weights in memory (no files), e.g. bench/q30.json.
    #[arg(long)]
    pub synthetic: Option<PathBuf>,
}

/// How the routed experts are held, whatever the checkpoint stores.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertDtype {
    /// As the checkpoint stores them.
    #[default]
    Stored,
    /// FP8 (E4M3) in 128 x 128 blocks, quantized at load from a BF16 checkpoint (an FP8 one is already): half the
    /// bytes per expert, so twice the expert cache and half the copy time under offload, for a little accuracy.
    Fp8,
}

#[derive(clap::Args)]
pub struct ExpertDtypeArgs {
    /// The routed experts' format in memory: stored, or fp8 (quantized at load, 128 x 128 blocks).
    #[arg(long, value_enum, default_value_t = ExpertDtype::Stored)]
    pub expert_dtype: ExpertDtype,
}

impl ExpertDtypeArgs {
    /// Makes `checkpoint`'s routed experts load in the asked format.
    pub fn apply(&self, checkpoint: &mut Checkpoint) {
        if self.expert_dtype == ExpertDtype::Fp8 {
            checkpoint
                .weights
                .quantize_experts(ferry_core::loader::Fp8Scheme::BLOCK_128);
        }
    }
}

impl ModelArgs {
    pub fn open(&self) -> Result<Checkpoint> {
        Ok(match (&self.model, &self.synthetic) {
            (Some(model), _) => {
                Checkpoint::open(&crate::hub::resolve(model, &mut |stage, _| tracing::info!("{stage}"))?)?
            }
            (None, Some(config)) => Checkpoint::synthetic(config, 0)?,
            (None, None) => anyhow::bail!("give --model DIR or --synthetic CONFIG.json"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn available_memory_is_read_from_meminfo_and_the_cgroup() {
        let meminfo = "MemTotal:       24683584 kB\nMemFree:          313644 kB\nMemAvailable:   23882692 kB\n";
        assert_eq!(mem_available(meminfo), Some(23882692 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(cgroup_headroom("8589934592\n", "1073741824\n"), Some(7 << 30));
        assert_eq!(cgroup_headroom("max\n", "1073741824\n"), None);
        assert_eq!(cgroup_headroom("100\n", "200\n"), Some(0));
    }
}
