//! A tensor's element types and the tensor itself: [`TensorRef`], a shared handle on its bytes (a mapped shard's
//! range or memory of our own) with its shape and dtype, sliced, gathered and reshaped without copying where it
//! can be, counted for non-finite values and widened to f32. Where the bytes come from is the weight store's job.

use std::sync::Arc;

use memmap2::Mmap;

use super::Fp8Scales;
use crate::loader::mxfp4;
use crate::{Error, Result};

/// Element type of a stored tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// `float8_e4m3fn`; a weight of this dtype carries its [`Fp8Scales`].
    F8E4M3,
    /// Raw bytes: MXFP4's stored blocks and scales.
    U8,
    /// An MXFP4 matrix packed at load ([`super::mxfp4`]): 17 bytes per 32 values, so no whole size per value.
    Mxfp4,
}

impl DType {
    /// Bytes per value; for [`DType::Mxfp4`], which has none, the average rounded up (see [`DType::bytes_for`]).
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F8E4M3 | DType::U8 | DType::Mxfp4 => 1,
        }
    }

    /// Bytes of `numel` values (for MXFP4, a multiple of 32: half a byte each and a scale byte per 32).
    pub fn bytes_for(self, numel: usize) -> usize {
        match self {
            DType::Mxfp4 => numel / 2 + numel / mxfp4::MXFP4_BLOCK,
            other => numel * other.size(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F8E4M3 => "fp8",
            DType::U8 => "u8",
            DType::Mxfp4 => "mxfp4",
        }
    }
}

/// Where a tensor's bytes live: a mapped shard, or memory of our own (synthetic weights, tests).
pub(super) enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Storage {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A tensor inside a mapped shard (or owned memory): shape, dtype and a byte range, read in place; an FP8 tensor
/// with its scales.
#[derive(Clone)]
pub struct TensorRef {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub(super) shard: Arc<Storage>,
    pub(super) start: usize,
    pub(super) len: usize,
    pub(super) scales: Option<Arc<Fp8Scales>>,
}

impl std::fmt::Debug for TensorRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}{:?}", self.name, self.dtype.name(), self.shape)?;
        if let Some(s) = &self.scales {
            write!(f, " scales {:?} per {}x{}", s.values.shape, s.block[0], s.block[1])?;
        }
        Ok(())
    }
}

impl TensorRef {
    /// A tensor over bytes of our own; fails unless `bytes` holds exactly `shape` elements of `dtype`.
    pub fn from_bytes(name: &str, dtype: DType, shape: Vec<usize>, bytes: Vec<u8>) -> Result<Self> {
        let expected = dtype.bytes_for(shape.iter().product::<usize>());
        if bytes.len() != expected {
            return Err(Error::tensor(
                name,
                format!("{} bytes for shape {shape:?} of {}", bytes.len(), dtype.name()),
            ));
        }
        Ok(TensorRef {
            name: name.to_string(),
            dtype,
            shape,
            len: bytes.len(),
            shard: Arc::new(Storage::Owned(bytes)),
            start: 0,
            scales: None,
        })
    }

    pub fn bytes(&self) -> &[u8] {
        &self.shard[self.start..self.start + self.len]
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn byte_len(&self) -> usize {
        self.len
    }

    /// Fails unless the shape is exactly `expected`; the message names the tensor and both shapes.
    pub fn expect_shape(self, expected: &[usize]) -> Result<Self> {
        if self.shape != expected {
            return Err(Error::tensor(
                &self.name,
                format!("expected shape {expected:?}, found {:?}", self.shape),
            ));
        }
        Ok(self)
    }

    /// Fails for a packed MXFP4 matrix, whose bytes are not one run per row (all blocks, then all scales).
    fn expect_divisible_rows(&self) -> Result<()> {
        match self.dtype {
            DType::Mxfp4 => Err(Error::tensor(&self.name, "a packed MXFP4 matrix is not sliced by rows")),
            _ => Ok(()),
        }
    }

    /// Entry `index` of the outermost dimension (expert `index` of a fused [E, ...] expert tensor), without copying.
    pub fn select(&self, index: usize) -> Result<TensorRef> {
        self.expect_divisible_rows()?;
        let (&outer, inner) = self
            .shape
            .split_first()
            .ok_or_else(|| Error::tensor(&self.name, "cannot index a scalar"))?;
        if index >= outer {
            return Err(Error::tensor(
                &self.name,
                format!("index {index} out of range for shape {:?}", self.shape),
            ));
        }
        let stride = self.len / outer;
        let scales = match &self.scales {
            Some(s) if inner.len() >= 2 => Some(Arc::new(Fp8Scales {
                values: s.values.select(index)?,
                block: s.block,
            })),
            Some(_) => return Err(Error::tensor(&self.name, "cannot take one row of an FP8 matrix")),
            None => None,
        };
        Ok(TensorRef {
            name: format!("{}[{index}]", self.name),
            dtype: self.dtype,
            shape: inner.to_vec(),
            shard: self.shard.clone(),
            start: self.start + index * stride,
            len: stride,
            scales,
        })
    }

    /// Rows `start..end` of the outermost dimension, without copying.
    pub fn rows(&self, start: usize, end: usize) -> Result<TensorRef> {
        self.expect_divisible_rows()?;
        let outer = *self.shape.first().unwrap_or(&0);
        if start > end || end > outer {
            return Err(Error::tensor(
                &self.name,
                format!("rows {start}..{end} out of range for shape {:?}", self.shape),
            ));
        }
        let stride = self.len / outer.max(1);
        let mut shape = self.shape.clone();
        shape[0] = end - start;
        Ok(TensorRef {
            name: format!("{}[{start}..{end}]", self.name),
            dtype: self.dtype,
            shape,
            shard: self.shard.clone(),
            start: self.start + start * stride,
            len: (end - start) * stride,
            scales: self.scales_of_rows(start, end)?,
        })
    }

    /// An f32 tensor holding `values` (a (1 + w) norm scale derived at load).
    pub fn from_f32(name: &str, shape: Vec<usize>, values: &[f32]) -> Result<TensorRef> {
        Self::from_bytes(
            name,
            DType::F32,
            shape,
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        )
    }

    /// The rows of each range, in order, copied into one new tensor in the stored dtype: how a family turns a
    /// projection whose output features are interleaved (per head or per head group) into the plain layout the
    /// shared layers compute with, once, at load.
    pub fn gather_rows(&self, ranges: &[std::ops::Range<usize>]) -> Result<TensorRef> {
        let parts = ranges
            .iter()
            .map(|r| self.rows(r.start, r.end))
            .collect::<Result<Vec<_>>>()?;
        Self::concat_rows(&format!("{}[gathered]", self.name), &parts)
    }

    /// The rows of `parts`, one after the other, copied into one new tensor: projections that read the same input
    /// fused into one product at load. The parts must agree in dtype and in every dimension but the first.
    pub fn concat_rows(name: &str, parts: &[TensorRef]) -> Result<TensorRef> {
        let Some(first) = parts.first() else {
            return Err(Error::tensor(name, "nothing to concatenate".to_string()));
        };
        let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.len).sum());
        for part in parts {
            if part.dtype != first.dtype || part.shape.get(1..) != first.shape.get(1..) {
                return Err(Error::tensor(name, format!("cannot stack {part:?} under {first:?}")));
            }
            bytes.extend_from_slice(part.bytes());
        }
        let mut shape = first.shape.clone();
        shape[0] = parts.iter().map(|p| p.shape[0]).sum();
        let stacked = Self::from_bytes(name, first.dtype, shape, bytes)?;
        stacked.stack_scales_of(parts)
    }

    /// The same bytes seen with another shape of as many elements (a conv1d weight `[C, 1, K]` as `[C, K]`).
    pub fn reshape(self, shape: Vec<usize>) -> Result<TensorRef> {
        if self.scales.is_some() && shape != self.shape {
            return Err(Error::tensor(
                &self.name,
                format!("cannot view an FP8 matrix as {shape:?}"),
            ));
        }
        if shape.iter().product::<usize>() != self.numel() {
            return Err(Error::tensor(
                &self.name,
                format!("cannot view shape {:?} as {shape:?}", self.shape),
            ));
        }
        Ok(TensorRef { shape, ..self })
    }

    /// How many of the values are NaN and how many are infinite, counted in parallel over chunks of the bytes.
    pub fn count_non_finite(&self) -> (u64, u64) {
        // Exponent all ones: infinite when the mantissa is zero, NaN otherwise.
        match self.dtype {
            DType::F32 => count_non_finite::<4>(self.bytes(), 0x7f80_0000, 0x007f_ffff),
            DType::F16 => count_non_finite::<2>(self.bytes(), 0x7c00, 0x03ff),
            DType::BF16 => count_non_finite::<2>(self.bytes(), 0x7f80, 0x007f),
            // E4M3 has no infinities; S.1111.111 is NaN.
            DType::F8E4M3 => (self.bytes().iter().filter(|&&b| b & 0x7f == 0x7f).count() as u64, 0),
            // Every byte is a value or a power of two.
            DType::U8 | DType::Mxfp4 => (0, 0),
        }
    }

    /// Values `range` (element indices) of an f32, f16 or bf16 tensor widened to f32; empty for other dtypes.
    pub fn float_range_to_f32(&self, range: std::ops::Range<usize>) -> Vec<f32> {
        let size = self.dtype.size();
        let b = &self.bytes()[range.start * size..range.end * size];
        match self.dtype {
            DType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::F8E4M3 | DType::U8 | DType::Mxfp4 => vec![],
        }
    }

    /// The values widened to f32 (an FP8 tensor's dequantized by its scales): for small tensors only (norm
    /// weights, biases, a row of the embedding table), and for dequantizing a dense FP8 matrix once at upload.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let b = self.bytes();
        match self.dtype {
            DType::F8E4M3 => self.dequantize_fp8(),
            DType::F32 | DType::F16 | DType::BF16 => self.float_range_to_f32(0..self.numel()),
            DType::U8 => b.iter().map(|&v| v as f32).collect(),
            DType::Mxfp4 => {
                let (rows, cols) = (self.shape[0], self.numel() / self.shape[0].max(1));
                let mut out = vec![0.0; rows * cols];
                for (r, row) in out.chunks_exact_mut(cols.max(1)).enumerate() {
                    mxfp4::dequantize_row(b, rows, cols, r, row);
                }
                out
            }
        }
    }
}

/// NaN and infinite values among little-endian values of `N` bytes whose exponent bits are `exponent`, in parallel
/// over chunks.
fn count_non_finite<const N: usize>(bytes: &[u8], exponent: u32, mantissa: u32) -> (u64, u64) {
    use rayon::prelude::*;
    bytes
        .par_chunks(N << 18)
        .map(|chunk| {
            let (mut nan, mut inf) = (0, 0);
            for value in chunk.chunks_exact(N) {
                let mut word = [0u8; 4];
                word[..N].copy_from_slice(value);
                let bits = u32::from_le_bytes(word);
                if bits & exponent == exponent {
                    if bits & mantissa == 0 {
                        inf += 1;
                    } else {
                        nan += 1;
                    }
                }
            }
            (nan, inf)
        })
        .reduce(|| (0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
}
