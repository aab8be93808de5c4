//! The sum across an expert-parallel group of CUDA ranks ([`crate::backend::expert_parallel`]): NCCL's all-reduce
//! on the ranks' own streams ([`NcclSum`]: one rank a GPU, nothing waits on the host), or through the host
//! ([`HostStagedSum`]: any devices, several ranks on one GPU included, every device waited for at each MoE layer).

use cudarc::nccl::safe::{group_end, group_start, Comm, ReduceOp};

use super::libs::load_nccl;
use super::{cuda_err, CudaBackend, CudaTensor};
use crate::backend::expert_parallel::Collective;
use crate::{Error, Result};

fn nccl_err(context: &str) -> impl Fn(cudarc::nccl::result::NcclError) -> Error + '_ {
    move |e| Error::Cuda(format!("NCCL, {context}: {e:?}"))
}

/// One NCCL communicator a rank, all made together in this process (ncclCommInitAll): the ranks must be on
/// distinct GPUs. NCCL's all-reduce gives every rank the same sum, so the ranks stay in step.
pub struct NcclSum {
    comms: Vec<Comm>,
}

// SAFETY: a communicator is used only from the thread issuing the group's ops, one collective at a time
// (ExpertParallel issues every op from one thread); NCCL's handles are not tied to the thread that made them.
unsafe impl Send for NcclSum {}
unsafe impl Sync for NcclSum {}

impl NcclSum {
    pub fn new(ranks: &[CudaBackend]) -> Result<Self> {
        load_nccl()?;
        let comms = Comm::from_devices(ranks.iter().map(|rank| rank.stream.clone()).collect())
            .map_err(nccl_err("creating the communicators"))?;
        Ok(NcclSum { comms })
    }
}

impl Collective<CudaBackend> for NcclSum {
    fn all_reduce_sum(&self, _ranks: &[CudaBackend], xs: &mut [CudaTensor]) -> Result<()> {
        if xs.len() != self.comms.len() {
            return Err(Error::Shape(format!(
                "all_reduce_sum: {} tensors for {} ranks",
                xs.len(),
                self.comms.len()
            )));
        }
        group_start().map_err(nccl_err("starting a group"))?;
        let reduced: Result<()> = self.comms.iter().zip(xs.iter_mut()).try_for_each(|(comm, x)| {
            comm.all_reduce_in_place(&mut x.data, &ReduceOp::Sum)
                .map(drop)
                .map_err(nccl_err("all-reduce"))
        });
        group_end().map_err(nccl_err("ending a group"))?;
        reduced
    }
}

pub struct HostStagedSum;

impl Collective<CudaBackend> for HostStagedSum {
    fn all_reduce_sum(&self, ranks: &[CudaBackend], xs: &mut [CudaTensor]) -> Result<()> {
        if ranks.len() != xs.len() {
            return Err(Error::Shape(format!(
                "all_reduce_sum: {} tensors for {} ranks",
                xs.len(),
                ranks.len()
            )));
        }
        let Some(first) = xs.first() else {
            return Ok(());
        };
        let shape = (first.rows, first.cols);
        if let Some(other) = xs.iter().find(|x| (x.rows, x.cols) != shape) {
            return Err(Error::Shape(format!(
                "all_reduce_sum: [{}, {}] beside [{}, {}]",
                shape.0, shape.1, other.rows, other.cols
            )));
        }
        let mut sum = ranks[0].tensor_to_host(&xs[0])?;
        for (rank, x) in ranks.iter().zip(xs.iter()).skip(1) {
            let part = rank.tensor_to_host(x)?;
            sum.iter_mut().zip(&part).for_each(|(s, p)| *s += p);
        }
        for (rank, x) in ranks.iter().zip(xs.iter_mut()) {
            rank.stream
                .memcpy_htod(&sum, &mut x.data)
                .map_err(cuda_err("sending the sum across ranks"))?;
        }
        Ok(())
    }
}
