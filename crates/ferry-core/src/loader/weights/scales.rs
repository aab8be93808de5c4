//! An FP8 tensor's scales: attaching them (checked against the tensor's shape), keeping them right when rows are
//! sliced, gathered or stacked, and dequantizing. Not for reading checkpoints' quantization configs (`fp8.rs`).

use std::sync::Arc;

use super::{DType, TensorRef};
use crate::loader::fp8::fp8_e4m3_to_f32;
use crate::{Error, Result};

/// The scales of an FP8 weight: `values` (f32) holds one scale per `block[0] x block[1]` block of each matrix,
/// with the weight's leading dimensions (`[E, ceil(rows / block[0]), ceil(cols / block[1])]` for a fused `[E,
/// rows, cols]` tensor); a weight's value is its FP8 value times its block's scale.
#[derive(Clone, Debug)]
pub struct Fp8Scales {
    pub values: TensorRef,
    /// Weight rows and columns per scale (per channel: one row and every column).
    pub block: [usize; 2],
}

impl TensorRef {
    /// This FP8 tensor with its scales (f32, `block` rows and columns each); fails, naming the tensor, unless the
    /// tensor is FP8 and the scales have its leading dimensions and one value per block.
    pub fn with_scales(self, values: TensorRef, block: [usize; 2]) -> Result<Self> {
        let expected = match self.shape.as_slice() {
            [lead @ .., rows, cols] if block[0] > 0 && block[1] > 0 => {
                let mut s = lead.to_vec();
                s.extend([rows.div_ceil(block[0]), cols.div_ceil(block[1])]);
                s
            }
            _ => {
                return Err(Error::tensor(
                    &self.name,
                    format!("cannot scale shape {:?} by {block:?} blocks", self.shape),
                ))
            }
        };
        // Per-channel scales are stored `[rows, 1]` (or `[rows]`); blocks as a grid: compare element counts in order.
        let squeezed = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if self.dtype != DType::F8E4M3 || values.dtype != DType::F32 || squeezed(&values.shape) != squeezed(&expected) {
            return Err(Error::tensor(
                &self.name,
                format!(
                    "{:?} cannot scale {:?} in {}x{} blocks: expected f32 scales of shape {expected:?}",
                    values, self, block[0], block[1]
                ),
            ));
        }
        let values = values.reshape(expected)?;
        Ok(TensorRef {
            scales: Some(Arc::new(Fp8Scales { values, block })),
            ..self
        })
    }

    /// The scales of an FP8 tensor.
    pub fn scales(&self) -> Option<&Fp8Scales> {
        self.scales.as_deref()
    }

    /// This tensor as f32 (itself when it is f32, a converted copy otherwise): scales are kept as f32.
    pub(crate) fn to_f32_tensor(&self) -> Result<TensorRef> {
        match self.dtype {
            DType::F32 => Ok(self.clone()),
            _ => Self::from_f32(&self.name, self.shape.clone(), &self.to_f32_vec()),
        }
    }

    /// The scales of rows `start..end` (outermost dimension) of this tensor, when it has any: the same blocks
    /// sliced when the rows start on a block (or the tensor is 3-D, its outermost dimension the matrices'),
    /// else one scale row per weight row, copied.
    pub(super) fn scales_of_rows(&self, start: usize, end: usize) -> Result<Option<Arc<Fp8Scales>>> {
        let Some(s) = &self.scales else { return Ok(None) };
        let outer = self.shape[0];
        let br = s.block[0];
        let sliced = if self.shape.len() > 2 {
            Fp8Scales {
                values: s.values.rows(start, end)?,
                block: s.block,
            }
        } else if start.is_multiple_of(br) && (end.is_multiple_of(br) || end == outer) {
            Fp8Scales {
                values: s.values.rows(start / br, end.div_ceil(br))?,
                block: s.block,
            }
        } else {
            let per_row = self.per_row_scales()?;
            Fp8Scales {
                values: per_row.values.rows(start, end)?,
                block: per_row.block,
            }
        };
        Ok(Some(Arc::new(sliced)))
    }

    /// A 2-D FP8 matrix's scales with one scale row per weight row (copied, unless they are so already).
    fn per_row_scales(&self) -> Result<Fp8Scales> {
        let s = self
            .scales()
            .ok_or_else(|| Error::tensor(&self.name, "has no FP8 scales"))?;
        let [br, bc] = s.block;
        if br == 1 {
            return Ok(s.clone());
        }
        let (rows, per_row) = (self.shape[0], s.values.shape[1]);
        let all = s.values.to_f32_vec();
        let values: Vec<f32> = (0..rows)
            .flat_map(|r| all[(r / br) * per_row..(r / br + 1) * per_row].iter().copied())
            .collect();
        Ok(Fp8Scales {
            values: Self::from_f32(&s.values.name, vec![rows, per_row], &values)?,
            block: [1, bc],
        })
    }

    /// `self` (the parts stacked by [`TensorRef::concat_rows`]) with the parts' scales stacked likewise, when they
    /// have any.
    pub(super) fn stack_scales_of(self, parts: &[TensorRef]) -> Result<TensorRef> {
        let Some(first_scales) = parts.first().and_then(TensorRef::scales) else {
            return Ok(self);
        };
        // The parts' scales stacked likewise: whole blocks where every part is whole blocks of the same shape, else
        // one scale row per weight row.
        let aligned = parts.iter().all(|p| {
            p.scales()
                .is_some_and(|ps| ps.block == first_scales.block && p.shape[0].is_multiple_of(ps.block[0]))
        });
        let mut values = Vec::with_capacity(parts.len());
        for part in parts {
            match (aligned, part.scales()) {
                (true, Some(ps)) => values.push(ps.values.clone()),
                (false, Some(_)) => values.push(part.per_row_scales()?.values),
                (_, None) => {
                    return Err(Error::tensor(
                        &self.name,
                        format!("cannot stack {part:?} under FP8 rows"),
                    ))
                }
            }
        }
        let block = match aligned {
            true => first_scales.block,
            false => [1, first_scales.block[1]],
        };
        let name = format!("{}_scale", self.name);
        self.with_scales(Self::concat_rows(&name, &values)?, block)
    }

    /// The values of an FP8 tensor as f32: each E4M3 value times its block's scale (the raw values without scales).
    pub(super) fn dequantize_fp8(&self) -> Vec<f32> {
        let b = self.bytes();
        let mut values: Vec<f32> = b.iter().map(|&v| fp8_e4m3_to_f32(v)).collect();
        if let Some(s) = &self.scales {
            let cols = *self.shape.last().unwrap_or(&1);
            let rows = values.len() / cols.max(1);
            let (scale_rows, scale_cols) = (
                s.values.shape[s.values.shape.len() - 2],
                s.values.shape[s.values.shape.len() - 1],
            );
            let per_matrix = self.shape[self.shape.len() - 2];
            let scales = s.values.to_f32_vec();
            for r in 0..rows {
                let (m, row) = (r / per_matrix, r % per_matrix);
                let scale_row = &scales[(m * scale_rows + row / s.block[0]) * scale_cols..][..scale_cols];
                for (c, v) in values[r * cols..(r + 1) * cols].iter_mut().enumerate() {
                    *v *= scale_row[c / s.block[1]];
                }
            }
        }
        values
    }
}
