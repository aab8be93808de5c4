//! Opening a GPU as a backend in two steps: [`CudaBackend::builder`] opens the device (its memory can then be
//! measured to plan a budget), and [`CudaBackendBuilder`] chooses expert offload, the split of its misses, CUDA
//! graphs and dependent launches before [`CudaBackendBuilder::build`] makes the backend.

use std::sync::Mutex;

use super::offload::{Offload, OffloadConfig};
use super::CudaBackend;
use crate::moe::SplitRule;
use crate::Result;

/// A GPU opened (context, kernels, cuBLAS) but not yet a backend: its memory can be measured to plan a budget, and
/// expert offload chosen, before any model is loaded.
pub struct CudaBackendBuilder {
    backend: CudaBackend,
    offload: Option<OffloadConfig>,
    split: SplitRule,
    cuda_graphs: bool,
}

impl CudaBackend {
    /// Opens GPU `ordinal`; [`CudaBackendBuilder::build`] makes it a backend, all resident unless offload was asked.
    pub fn builder(ordinal: usize) -> Result<CudaBackendBuilder> {
        Ok(CudaBackendBuilder {
            backend: CudaBackend::new(ordinal)?,
            offload: None,
            split: SplitRule::Link,
            cuda_graphs: true,
        })
    }
}

impl CudaBackendBuilder {
    /// Bytes free and total on the device (cuMemGetInfo).
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.backend.memory_info()
    }

    pub fn device_name(&self) -> &str {
        self.backend.device_name()
    }

    /// [`CudaBackend::measure_lanes`] on the opened GPU, before a split rule is chosen.
    pub fn measure_lanes(&self, experts: usize, rounds: usize) -> Result<super::LaneCeilings> {
        self.backend.measure_lanes(experts, rounds)
    }

    /// Keeps the routed experts of the models the backend loads in a host bank, cached on the GPU as `config` says.
    pub fn offload(self, config: OffloadConfig) -> Self {
        CudaBackendBuilder {
            offload: Some(config),
            ..self
        }
    }

    /// Who computes the misses under offload (`--moe-strategy`): the link alone (the default), the CPU lane
    /// alone, or the two split by the planner. Nothing without offload.
    pub fn split(self, split: SplitRule) -> Self {
        CudaBackendBuilder { split, ..self }
    }

    /// Whether all-resident decode steps run as CUDA graphs (the default; offloaded experts run eagerly).
    pub fn cuda_graphs(self, on: bool) -> Self {
        CudaBackendBuilder {
            cuda_graphs: on,
            ..self
        }
    }

    /// Whether kernels launch as programmatic dependents of the kernel before them (launch.rs: the default where
    /// the GPU has it, sm_90 on); off, each launches after the one before it has finished.
    pub fn dependent_launch(mut self, on: bool) -> Self {
        self.backend.dependent_launch &= on;
        self
    }

    pub fn build(self) -> Result<CudaBackend> {
        let mut backend = self.backend;
        if !self.cuda_graphs || self.offload.is_some() {
            backend.graphs = None;
        }
        if let Some(config) = self.offload {
            backend.offload = Some(Mutex::new(Offload::new(backend.ctx.clone(), config, self.split)?));
        }
        Ok(backend)
    }
}
