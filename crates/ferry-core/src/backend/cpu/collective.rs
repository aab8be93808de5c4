//! The sum across an expert-parallel group of CPU ranks ([`crate::backend::expert_parallel`]): the ranks' tensors
//! live in this process's memory, so it is a plain sum, in rank order, copied back to every rank.

use super::{CpuBackend, CpuTensor};
use crate::backend::expert_parallel::Collective;
use crate::{Error, Result};

pub struct HostSum;

impl Collective<CpuBackend> for HostSum {
    fn all_reduce_sum(&self, _ranks: &[CpuBackend], xs: &mut [CpuTensor]) -> Result<()> {
        let Some((first, others)) = xs.split_first_mut() else {
            return Ok(());
        };
        if let Some(other) = others.iter().find(|x| (x.rows, x.cols) != (first.rows, first.cols)) {
            return Err(Error::Shape(format!(
                "all_reduce_sum: [{}, {}] beside [{}, {}]",
                first.rows, first.cols, other.rows, other.cols
            )));
        }
        for other in others.iter() {
            first.data.iter_mut().zip(&other.data).for_each(|(sum, x)| *sum += x);
        }
        for other in others {
            other.data.copy_from_slice(&first.data);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_gets_the_sum_in_rank_order() {
        let tensor = |data: Vec<f32>| CpuTensor {
            rows: 1,
            cols: data.len(),
            data,
        };
        let mut xs = vec![
            tensor(vec![1.0, 2.0]),
            tensor(vec![10.0, 20.0]),
            tensor(vec![100.0, 200.0]),
        ];
        HostSum
            .all_reduce_sum(&[CpuBackend, CpuBackend, CpuBackend], &mut xs)
            .unwrap();
        assert!(xs.iter().all(|x| x.data == [111.0, 222.0]));
        let mut mismatched = vec![tensor(vec![1.0]), tensor(vec![1.0, 2.0])];
        assert!(HostSum
            .all_reduce_sum(&[CpuBackend, CpuBackend], &mut mismatched)
            .is_err());
    }
}
