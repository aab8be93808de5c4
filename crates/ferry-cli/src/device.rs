//! Choosing the backend a command runs on (`--device cpu|cuda|auto`) and opening the model's checkpoint
//! (`--model DIR` or `--synthetic CONFIG.json`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::ValueEnum;
use ferry_core::backend::cpu::CpuBackend;
use ferry_core::backend::cuda::CudaBackend;
use ferry_core::loader::Checkpoint;

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

pub fn open_backend(device: Device) -> Result<Backends> {
    match device {
        Device::Cpu => Ok(Backends::Cpu(CpuBackend)),
        Device::Cuda => Ok(Backends::Cuda(Box::new(CudaBackend::new(0).context("--device cuda")?))),
        Device::Auto => match CudaBackend::new(0) {
            Ok(cuda) => Ok(Backends::Cuda(Box::new(cuda))),
            Err(e) => {
                tracing::info!("running on the CPU: {e}");
                Ok(Backends::Cpu(CpuBackend))
            }
        },
    }
}

/// Runs `$body` with `$be` bound to whichever backend `$backends` holds.
#[macro_export]
macro_rules! with_backend {
    ($backends:expr, $be:ident => $body:expr) => {
        match $backends {
            $crate::device::Backends::Cpu(ref $be) => $body,
            $crate::device::Backends::Cuda(ref $be) => {
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
