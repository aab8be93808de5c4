//! The CPU backend: f32 activations, weights read in place from the mapped checkpoint in their stored dtype,
//! rayon for threads and [`gemv`]'s SIMD kernels for every product with a weight matrix.
//!
//! It is the numerical reference every other backend is tested against, CI's backend, and (later) the lane that
//! computes expert misses straight from host RAM. This file holds the backend and its plain ops; attention, the
//! Gated DeltaNet ops and the MoE ops have files of their own. Every op checks its operands' shapes and answers a
//! mismatch with [`Error::Shape`], never a panic.

mod attention;
mod collective;
mod gdn;
pub mod gemv;
pub mod lane;
mod mla;
mod moe;
mod mxfp4;

use rayon::prelude::*;

use super::{
    batch_positions, check_argmax_cols, check_upload, AttentionParams, Backend, DeltaRuleParams, ExpertActivation,
    ExpertTensors, MlaParams, QkNormWeights, Rope, Router, RouterKind, SeqSlice,
};
use crate::kv::{HostKv, KvSpec, SeqId};
use crate::loader::{DType, TensorRef};
use crate::{Error, Result};
pub use collective::HostSum;
use gemv::{BlockScales, WeightDType, WeightEncoding};
pub use moe::{CpuExperts, Routing};

/// A `[rows, cols]` row-major f32 tensor.
#[derive(Clone, Debug)]
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl CpuTensor {
    fn zeros(rows: usize, cols: usize) -> Self {
        CpuTensor {
            data: vec![0.0; rows * cols],
            rows,
            cols,
        }
    }

    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Columns `cols` of every row, as a tensor of their own.
    fn columns(&self, cols: std::ops::Range<usize>) -> CpuTensor {
        let data = self
            .data
            .chunks(self.cols)
            .flat_map(|row| &row[cols.clone()])
            .copied()
            .collect();
        CpuTensor {
            data,
            rows: self.rows,
            cols: cols.len(),
        }
    }

    /// Fails unless `other` has this tensor's shape.
    fn expect_same_shape(&self, other: &CpuTensor, op: &str) -> Result<()> {
        check_shape(self.rows == other.rows && self.cols == other.cols, || {
            format!(
                "{op}: [{}, {}] against [{}, {}]",
                self.rows, self.cols, other.rows, other.cols
            )
        })
    }
}

/// `Err(Error::Shape(message()))` unless `ok`: the CPU ops' answer to operands that do not fit together.
fn check_shape(ok: bool, message: impl FnOnce() -> String) -> Result<()> {
    match ok {
        true => Ok(()),
        false => Err(Error::Shape(message())),
    }
}

/// Fails unless `w` is a vector of `len` values.
fn check_vector(w: &TensorRef, len: usize, op: &str) -> Result<()> {
    check_shape(w.shape == [len], || {
        format!("{op}: {} has shape {:?}, expected [{len}]", w.name, w.shape)
    })
}

#[derive(Clone, Copy, Default)]
pub struct CpuBackend;

/// A batch as the CPU ops see it: its slices and each row's position.
pub struct CpuBatch {
    slices: Vec<SeqSlice>,
    positions: Vec<u32>,
}

impl CpuBatch {
    /// Fails unless `x` has a row for each of the batch's tokens.
    fn expect_rows(&self, x: &CpuTensor, op: &str) -> Result<()> {
        check_shape(x.rows == self.positions.len(), || {
            format!("{op}: {} rows for a batch of {} tokens", x.rows, self.positions.len())
        })
    }
}

/// How the gemv kernels read `w`: its dtype and, for FP8, its scales. MXFP4 is not theirs to read ([`matmul`] hands
/// it to [`mxfp4::matmul`]), nor are raw bytes.
fn weight_encoding(w: &TensorRef) -> Result<WeightEncoding<'_>> {
    let dtype = match w.dtype {
        DType::F32 => WeightDType::F32,
        DType::F16 => WeightDType::F16,
        DType::BF16 => WeightDType::BF16,
        DType::F8E4M3 => WeightDType::F8E4M3,
        DType::U8 | DType::Mxfp4 => {
            return Err(Error::tensor(
                &w.name,
                format!("{} is not a dtype the gemv kernels read", w.dtype.name()),
            ))
        }
    };
    let scales = w.scales().map(|s| BlockScales {
        bytes: s.values.bytes(),
        block_rows: s.block[0],
        block_cols: s.block[1],
    });
    Ok(WeightEncoding { dtype, scales })
}

/// `x W^T` for `rows` rows of `x` and a weight `[n, k]` held in place.
fn matmul(x: &[f32], rows: usize, w: &TensorRef) -> Result<Vec<f32>> {
    let &[n, k] = w.shape.as_slice() else {
        return Err(Error::Shape(format!(
            "{} of shape {:?} is not a matrix",
            w.name, w.shape
        )));
    };
    check_shape(x.len() == rows * k, || {
        format!("{} [{n}, {k}] applied to {} values in {rows} rows", w.name, x.len())
    })?;
    check_shape(w.dtype != DType::F8E4M3 || w.scales().is_some(), || {
        format!("{} is FP8 without scales", w.name)
    })?;
    let mut out = vec![0.0; rows * n];
    match w.dtype {
        DType::Mxfp4 => mxfp4::matmul(x, rows, k, w.bytes(), n, &mut out),
        _ => gemv::matmul(x, rows, k, w.bytes(), weight_encoding(w)?, n, &mut out),
    }
    Ok(out)
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn dot(x: &[f32], y: &[f32]) -> f32 {
    x.iter().zip(y).map(|(a, b)| a * b).sum()
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = TensorRef;
    type Experts = CpuExperts;
    type Kv = HostKv;
    type Batch = CpuBatch;
    type Routing = Routing;
    type RopeTable = Rope;

    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn weight(&self, tensor: TensorRef) -> Result<TensorRef> {
        if tensor.shape.len() > 2 {
            return Err(Error::tensor(
                &tensor.name,
                format!("expected a matrix or vector, found shape {:?}", tensor.shape),
            ));
        }
        Ok(tensor)
    }

    fn check_router(&self, _: RouterKind) -> Result<()> {
        Ok(())
    }

    fn experts(&self, experts: Vec<ExpertTensors>, activation: ExpertActivation) -> Result<CpuExperts> {
        CpuExperts::new(experts, activation)
    }

    fn expert_shard(&self, experts: Vec<Option<ExpertTensors>>, activation: ExpertActivation) -> Result<CpuExperts> {
        CpuExperts::shard(experts, activation)
    }

    fn rope_table(&self, rope: &Rope) -> Result<Rope> {
        Ok(rope.clone())
    }

    fn new_kv(&self, spec: KvSpec) -> Result<HostKv> {
        Ok(HostKv::new(spec))
    }

    fn prepare_batch(&self, kv: &mut HostKv, batch: &[SeqSlice]) -> Result<CpuBatch> {
        kv.reserve(&batch.iter().map(|s| (s.seq, s.start_pos, s.len)).collect::<Vec<_>>())?;
        Ok(CpuBatch {
            slices: batch.to_vec(),
            positions: batch_positions(batch),
        })
    }

    fn save_state(&self, kv: &mut HostKv, seq: SeqId, slot: usize) -> Result<()> {
        kv.save_state(seq, slot)
    }

    fn restore_state(&self, kv: &mut HostKv, seq: SeqId, slot: usize) -> Result<()> {
        kv.restore_state(seq, slot)
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<CpuTensor> {
        check_upload(data.len(), rows, cols)?;
        Ok(CpuTensor {
            data: data.to_vec(),
            rows,
            cols,
        })
    }

    fn to_host(&self, x: &CpuTensor) -> Result<Vec<f32>> {
        Ok(x.data.clone())
    }

    fn argmax_rows(&self, x: &CpuTensor, cols: usize) -> Result<Vec<u32>> {
        check_argmax_cols(cols, x.cols)?;
        Ok((0..x.rows).map(|r| argmax(&x.row(r)[..cols]) as u32).collect())
    }

    fn shape(&self, x: &CpuTensor) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn embed(&self, table: &TensorRef, ids: &[u32]) -> Result<CpuTensor> {
        let &[_, hidden] = table.shape.as_slice() else {
            return Err(Error::Shape(format!(
                "embed: {} of shape {:?}",
                table.name, table.shape
            )));
        };
        let mut out = CpuTensor::zeros(ids.len(), hidden);
        for (row, &id) in out.data.chunks_mut(hidden).zip(ids) {
            let id = id as usize;
            row.copy_from_slice(&table.rows(id, id + 1)?.to_f32_vec());
        }
        Ok(out)
    }

    fn rms_norm(&self, x: &CpuTensor, weight: &TensorRef, group: usize, eps: f32) -> Result<CpuTensor> {
        check_shape(group > 0 && x.cols.is_multiple_of(group), || {
            format!("rms_norm: groups of {group} in rows of {}", x.cols)
        })?;
        check_vector(weight, group, "rms_norm")?;
        let w = weight.to_f32_vec();
        let mut out = x.clone();
        out.data.par_chunks_mut(group).for_each(|chunk| {
            let mean_sq = chunk.iter().map(|v| v * v).sum::<f32>() / group as f32;
            let inv = 1.0 / (mean_sq + eps).sqrt();
            for (v, &g) in chunk.iter_mut().zip(&w) {
                *v = *v * inv * g;
            }
        });
        Ok(out)
    }

    fn linear(&self, x: &CpuTensor, w: &TensorRef, bias: Option<&TensorRef>) -> Result<CpuTensor> {
        let mut data = matmul(&x.data, x.rows, w)?;
        let n = w.shape[0];
        if let Some(bias) = bias {
            check_vector(bias, n, "linear")?;
            let b = bias.to_f32_vec();
            for row in data.chunks_mut(n) {
                row.iter_mut().zip(&b).for_each(|(v, b)| *v += b);
            }
        }
        Ok(CpuTensor {
            data,
            rows: x.rows,
            cols: n,
        })
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        x.expect_same_shape(y, "add_assign")?;
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn add_rms_norm(&self, x: &mut CpuTensor, y: &CpuTensor, weight: &TensorRef, eps: f32) -> Result<CpuTensor> {
        self.add_assign(x, y)?;
        self.rms_norm(x, weight, x.cols, eps)
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> Result<CpuTensor> {
        gate.expect_same_shape(up, "silu_mul")?;
        Ok(CpuTensor {
            data: gate.data.iter().zip(&up.data).map(|(&g, &u)| silu(g) * u).collect(),
            rows: gate.rows,
            cols: gate.cols,
        })
    }

    fn sigmoid_gate(&self, x: &mut CpuTensor, gate: &CpuTensor) -> Result<()> {
        let cols = x.cols;
        check_shape(gate.rows == x.rows && (gate.cols == cols || gate.cols == 1), || {
            format!(
                "sigmoid_gate: a [{}, {}] gate for [{}, {cols}]",
                gate.rows, gate.cols, x.rows
            )
        })?;
        if gate.cols == cols {
            x.data.iter_mut().zip(&gate.data).for_each(|(v, &g)| *v *= sigmoid(g));
            return Ok(());
        }
        for (row, g) in x.data.chunks_mut(cols).zip(&gate.data) {
            let s = sigmoid(*g);
            row.iter_mut().for_each(|v| *v *= s);
        }
        Ok(())
    }

    fn attention(
        &self,
        qkv: &CpuTensor,
        qk_norm: Option<QkNormWeights<'_, TensorRef>>,
        sinks: Option<&TensorRef>,
        rope: &Rope,
        kv: &mut HostKv,
        layer: usize,
        batch: &CpuBatch,
        params: &AttentionParams,
    ) -> Result<CpuTensor> {
        let inputs = attention::AttentionInputs {
            qkv,
            qk_norm,
            sinks,
            rope,
            params,
        };
        inputs.run(self, kv, layer, batch)
    }

    fn mla_attention(
        &self,
        q: &CpuTensor,
        compressed: &CpuTensor,
        kv_norm: &TensorRef,
        kv_b: &TensorRef,
        rope: &Rope,
        kv: &mut HostKv,
        layer: usize,
        batch: &CpuBatch,
        params: &MlaParams,
    ) -> Result<CpuTensor> {
        let inputs = mla::MlaInputs {
            q,
            compressed,
            kv_norm,
            kv_b,
            rope,
            params,
        };
        inputs.run(self, kv, layer, batch)
    }

    fn causal_conv1d(
        &self,
        x: &CpuTensor,
        weight: &TensorRef,
        kv: &mut HostKv,
        layer: usize,
        batch: &CpuBatch,
    ) -> Result<CpuTensor> {
        gdn::ConvInputs { x, weight }.run(kv, layer, batch)
    }

    fn gated_delta_rule(
        &self,
        qkv: &CpuTensor,
        a: &CpuTensor,
        b: &CpuTensor,
        a_log: &TensorRef,
        dt_bias: &TensorRef,
        kv: &mut HostKv,
        layer: usize,
        batch: &CpuBatch,
        params: &DeltaRuleParams,
    ) -> Result<CpuTensor> {
        let inputs = gdn::DeltaRuleInputs {
            qkv,
            a,
            b,
            a_log,
            dt_bias,
        };
        inputs.run(kv, layer, batch, params)
    }

    fn route(&self, logits: &CpuTensor, router: Router<'_, TensorRef>) -> Result<Routing> {
        moe::route(logits, router)
    }

    fn routing_to_host(&self, routing: &Routing) -> Result<Vec<u32>> {
        Ok(routing.ids.clone())
    }

    fn routing_from_host(&self, ids: &[u32], weights: &[f32], top_k: usize) -> Result<Routing> {
        check_shape(
            top_k > 0 && ids.len() == weights.len() && ids.len().is_multiple_of(top_k),
            || {
                format!(
                    "routing_from_host: {} ids and {} weights, top-{top_k}",
                    ids.len(),
                    weights.len()
                )
            },
        )?;
        Ok(Routing {
            top_k,
            ids: ids.to_vec(),
            weights: weights.to_vec(),
        })
    }

    fn moe_experts(&self, x: &CpuTensor, routing: &Routing, experts: &CpuExperts) -> Result<CpuTensor> {
        experts.forward(x, routing)
    }

    fn select_rows(&self, x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor> {
        check_shape(rows.iter().all(|&r| r < x.rows), || {
            format!("select_rows: rows {rows:?} of {}", x.rows)
        })?;
        let data = rows.iter().flat_map(|&r| x.row(r).iter().copied()).collect();
        Ok(CpuTensor {
            data,
            rows: rows.len(),
            cols: x.cols,
        })
    }
}

/// The index of the largest of `values`, the lowest among equals (torch's argmax); NaN counts as below every number,
/// and a slice of NaN (or an empty one) gives 0.
pub fn argmax(values: &[f32]) -> usize {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in values.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i)
}

/// Host memory read bandwidth in GB/s with rayon's threads: the best of a few parallel sums over `bytes`.
pub fn measure_read_bandwidth(bytes: usize) -> f64 {
    let words: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
    (0..5)
        .map(|_| {
            let started = std::time::Instant::now();
            let sum: u64 = words
                .par_chunks(1 << 16)
                .map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
                .sum();
            std::hint::black_box(sum);
            bytes as f64 / started.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_lowest_index_of_the_largest_and_passes_over_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, f32::NAN, 0.5]), 3);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[]), 0);
    }

    #[test]
    fn argmax_rows_reads_each_rows_first_columns() {
        let be = CpuBackend;
        let x = be.upload(&[0.0, 1.0, 9.0, 5.0, 4.0, 9.0], 2, 3).unwrap();
        assert_eq!(be.argmax_rows(&x, 3).unwrap(), vec![2, 2]);
        assert_eq!(be.argmax_rows(&x, 2).unwrap(), vec![1, 0]);
        assert!(matches!(be.argmax_rows(&x, 4), Err(Error::Shape(_))));
        assert!(matches!(be.argmax_rows(&x, 0), Err(Error::Shape(_))));
    }
}
