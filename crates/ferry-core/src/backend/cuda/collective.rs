//! The sum across an expert-parallel group of CUDA ranks ([`crate::backend::expert_parallel`]) through the host:
//! each rank's partial sum comes back, they are added in rank order, and the sum goes to every rank. It works for
//! any set of devices (several ranks on one GPU included) and waits for every device at each MoE layer: the
//! correct first step, which an NCCL all-reduce on the ranks' streams is to replace for speed.

use super::{cuda_err, CudaBackend, CudaTensor};
use crate::backend::expert_parallel::Collective;
use crate::{Error, Result};

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
