//! How a routed expert's block is laid out in device memory and in the host bank, which moe.cu reads: bf16 gate,
//! up and down back to back, or FP8 (E4M3) gate, up and down followed, from the next 16-byte boundary, by their
//! f32 scales, or MXFP4 gate, up and down, each packed as loader/mxfp4.rs packs a matrix (values, then scales) and
//! padded to 16 bytes. Experts with biases (gpt-oss) end the block with them, in f32, from the next 16-byte
//! boundary. One contiguous block per expert in every format, so an offloaded miss stays one copy and the cache
//! counts the block's real bytes. Every block is padded to a multiple of [`BLOCK_ALIGN`] bytes: the expert kernels
//! take their vectorised path only on 16-byte aligned rows, and that path sums in another order than the scalar
//! one, so an expert must sit at the same alignment in every slot of the offload's cache and of the resident slab
//! for the two to agree bit for bit. Also what the kernels compute around the products ([`ExpertGlu`]) and the
//! launches that widen FP8 and MXFP4 experts for the grouped path (moe.rs picks the kernels by format).

use super::launch::{grid_1d, kernel, Ptr, BLOCK_THREADS};
use super::memory::bf16_bytes;
use super::{Bf16Matrix, CudaBackend};
use crate::backend::{ExpertActivation, ExpertTensors};
use crate::loader::mxfp4::MXFP4_BLOCK;
use crate::loader::{DType, TensorRef};
use crate::{Error, Result};

/// What every expert block's start and length are a multiple of (see the file's comment).
const BLOCK_ALIGN: usize = 16;

/// Zero bytes that pad an FP8 block's weights to where its scales start, and every block to its end.
const PAD: [u8; BLOCK_ALIGN] = [0; BLOCK_ALIGN];

/// The blocks an FP8 expert's scales cover, `[rows, cols]` per scale: gate's and up's (equal), and down's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Blocks {
    pub gate_up: [usize; 2],
    pub down: [usize; 2],
}

/// How one layer's expert blocks are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertFormat {
    Bf16,
    Fp8(Fp8Blocks),
    /// OpenAI's MXFP4 (gpt-oss): e2m1 values, an e8m0 scale per 32 along each row.
    Mxfp4,
}

/// What a layer's expert kernels compute between the products, in the form their arguments take: moe.cu's
/// `expert_glu` (silu(gate) * up, or gpt-oss's clamped SwiGLU) and where the block's f32 biases start (-1: none).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertGlu {
    pub bias_at: i64,
    pub clamped: i32,
    pub alpha: f32,
    pub limit: f32,
}

impl ExpertGlu {
    /// The kernels' arguments for `activation` over blocks of `format` whose biases (if `biased`) follow the
    /// weights.
    pub(super) fn new(
        activation: ExpertActivation,
        format: ExpertFormat,
        inter: usize,
        hidden: usize,
        biased: bool,
    ) -> Self {
        let bias_at = match biased {
            true => format.bias_at(inter, hidden) as i64,
            false => -1,
        };
        match activation {
            ExpertActivation::SiluGlu => ExpertGlu {
                bias_at,
                clamped: 0,
                alpha: 1.0,
                limit: f32::INFINITY,
            },
            ExpertActivation::ClampedSwiGlu { alpha, limit } => ExpertGlu {
                bias_at,
                clamped: 1,
                alpha,
                limit,
            },
        }
    }

    pub(super) fn biased(self) -> bool {
        self.bias_at >= 0
    }

    /// silu(gate) * up without biases: what every family but gpt-oss computes.
    pub(super) fn is_plain(self) -> bool {
        !self.biased() && self.clamped == 0
    }
}

/// An expert's biases as the block holds them: all three (zeros for one missing) in f32, when it has any.
pub(super) fn with_f32_biases(e: ExpertTensors, biased: bool) -> Result<ExpertTensors> {
    if !biased {
        return Ok(e);
    }
    let (inter, hidden) = (e.gate.shape[0], e.gate.shape[1]);
    let f32_bias = |bias: Option<TensorRef>, name: &str, len: usize| -> Result<Option<TensorRef>> {
        match bias {
            Some(b) if b.dtype == DType::F32 => Ok(Some(b)),
            Some(b) => TensorRef::from_f32(&b.name, b.shape.clone(), &b.to_f32_vec()).map(Some),
            None => TensorRef::from_f32(name, vec![len], &vec![0.0; len]).map(Some),
        }
    };
    Ok(ExpertTensors {
        gate_bias: f32_bias(e.gate_bias, &format!("{}.bias", e.gate.name), inter)?,
        up_bias: f32_bias(e.up_bias, &format!("{}.bias", e.up.name), inter)?,
        down_bias: f32_bias(e.down_bias, &format!("{}.bias", e.down.name), hidden)?,
        ..e
    })
}

/// Bytes of one packed `[rows, cols]` MXFP4 matrix in a block: 17 per 32 weights, padded to 16.
pub(super) fn mxfp4_matrix_bytes(rows: usize, cols: usize) -> usize {
    DType::Mxfp4.bytes_for(rows * cols).next_multiple_of(16)
}

/// The scale blocks of an FP8 matrix, or an error naming it.
fn scale_block(t: &TensorRef) -> Result<[usize; 2]> {
    t.scales()
        .map(|s| s.block)
        .ok_or_else(|| Error::tensor(&t.name, "an FP8 expert matrix without scales"))
}

/// Scales of a `[rows, cols]` matrix in `block`-sized blocks.
pub(super) fn grid(rows: usize, cols: usize, block: [usize; 2]) -> usize {
    rows.div_ceil(block[0]) * cols.div_ceil(block[1])
}

impl ExpertFormat {
    /// The format of a layer's experts: every matrix bf16, or every one FP8 with gate and up in the same blocks
    /// and every expert alike.
    pub(super) fn of(experts: &[ExpertTensors]) -> Result<Self> {
        let format = |e: &ExpertTensors| -> Result<ExpertFormat> {
            match e.gate.dtype {
                DType::F8E4M3 => {}
                DType::Mxfp4 => {
                    let (inter, hidden) = (e.gate.shape[0], e.gate.shape[1]);
                    if !inter.is_multiple_of(MXFP4_BLOCK) || !hidden.is_multiple_of(MXFP4_BLOCK) {
                        return Err(Error::tensor(
                            &e.gate.name,
                            format!("MXFP4 experts of {inter} x {hidden}: both must be multiples of 32"),
                        ));
                    }
                    if let Some(t) = [&e.up, &e.down].into_iter().find(|t| t.dtype != DType::Mxfp4) {
                        return Err(Error::tensor(&t.name, format!("{} in an MXFP4 expert", t.dtype.name())));
                    }
                    return Ok(ExpertFormat::Mxfp4);
                }
                DType::U8 => {
                    return Err(Error::tensor(
                        &e.gate.name,
                        format!("the CUDA backend has no {} expert kernels yet", e.gate.dtype.name()),
                    ))
                }
                _ => return Ok(ExpertFormat::Bf16),
            }
            let blocks = Fp8Blocks {
                gate_up: scale_block(&e.gate)?,
                down: scale_block(&e.down)?,
            };
            if scale_block(&e.up)? != blocks.gate_up {
                return Err(Error::tensor(
                    &e.up.name,
                    "FP8 scale blocks unlike its gate projection's",
                ));
            }
            Ok(ExpertFormat::Fp8(blocks))
        };
        let first = experts
            .first()
            .ok_or_else(|| Error::Cuda("a MoE layer without experts".into()))?;
        let layer = format(first)?;
        for e in experts {
            if format(e)? != layer {
                return Err(Error::tensor(
                    &e.gate.name,
                    format!("stored unlike the layer's first expert ({layer:?})"),
                ));
            }
        }
        Ok(layer)
    }

    /// Where an FP8 block's scales start: after the three matrices' bytes, at a multiple of 16.
    pub(super) fn scales_at(inter: usize, hidden: usize) -> usize {
        (3 * inter * hidden).next_multiple_of(BLOCK_ALIGN)
    }

    /// Bytes of one expert's weights (and scales) in its block.
    fn weight_bytes(self, inter: usize, hidden: usize) -> usize {
        match self {
            ExpertFormat::Bf16 => 3 * inter * hidden * 2,
            ExpertFormat::Fp8(b) => {
                Self::scales_at(inter, hidden) + 4 * (2 * grid(inter, hidden, b.gate_up) + grid(hidden, inter, b.down))
            }
            ExpertFormat::Mxfp4 => 3 * mxfp4_matrix_bytes(inter, hidden),
        }
    }

    /// Where a block's f32 biases start: after the weights, at a multiple of 16.
    pub(super) fn bias_at(self, inter: usize, hidden: usize) -> usize {
        self.weight_bytes(inter, hidden).next_multiple_of(BLOCK_ALIGN)
    }

    /// Bytes of one expert's weights and, when `biased`, its f32 biases (gate's, up's, down's), before the end
    /// padding.
    fn content_bytes(self, inter: usize, hidden: usize, biased: bool) -> usize {
        match biased {
            true => self.bias_at(inter, hidden) + 4 * (2 * inter + hidden),
            false => self.weight_bytes(inter, hidden),
        }
    }

    /// Bytes of one expert's block, padded to a multiple of [`BLOCK_ALIGN`]: blocks placed back to back (the
    /// resident slab, the cache's slots) all start 16-byte aligned.
    pub(super) fn block_bytes(self, inter: usize, hidden: usize, biased: bool) -> usize {
        self.content_bytes(inter, hidden, biased).next_multiple_of(BLOCK_ALIGN)
    }

    /// An expert's block as the byte runs that make it, in order (matrices, then padding and scales for FP8;
    /// each MXFP4 matrix padded; then padding and the f32 biases, when it has them, as [`with_f32_biases`] makes
    /// them; then the end padding): copied back to back they are [`ExpertFormat::block_bytes`] bytes.
    pub(super) fn block_parts(self, e: &ExpertTensors) -> Result<Vec<&[u8]>> {
        let mut parts = self.weight_parts(e)?;
        let biases = [&e.gate_bias, &e.up_bias, &e.down_bias];
        if biases.iter().any(|b| b.is_some()) {
            let (inter, hidden) = (e.gate.shape[0], e.gate.shape[1]);
            parts.push(&PAD[..self.bias_at(inter, hidden) - self.weight_bytes(inter, hidden)]);
            for bias in biases {
                match bias {
                    Some(b) if b.dtype == DType::F32 => parts.push(b.bytes()),
                    _ => return Err(Error::Shape(format!("{}: expert biases not made f32", e.gate.name))),
                }
            }
        }
        let (inter, hidden) = (e.gate.shape[0], e.gate.shape[1]);
        let biased = biases.iter().any(|b| b.is_some());
        parts.push(&PAD[..self.block_bytes(inter, hidden, biased) - self.content_bytes(inter, hidden, biased)]);
        Ok(parts)
    }

    /// The weight runs of [`ExpertFormat::block_parts`].
    fn weight_parts(self, e: &ExpertTensors) -> Result<Vec<&[u8]>> {
        let matrices = [&e.gate, &e.up, &e.down];
        let (inter, hidden) = (e.gate.shape[0], e.gate.shape[1]);
        match self {
            ExpertFormat::Bf16 => matrices.into_iter().map(bf16_bytes).collect(),
            ExpertFormat::Mxfp4 => {
                let mut parts = Vec::new();
                for t in matrices {
                    let bytes = t.bytes();
                    let pad = mxfp4_matrix_bytes(t.shape[0], t.shape[1])
                        .checked_sub(bytes.len())
                        .filter(|&pad| pad < PAD.len())
                        .ok_or_else(|| Error::Shape(format!("{}: MXFP4 bytes unlike its shape", t.name)))?;
                    parts.push(bytes);
                    parts.push(&PAD[..pad]);
                }
                Ok(parts)
            }
            ExpertFormat::Fp8(_) => {
                let mut parts: Vec<&[u8]> = matrices.iter().map(|t| t.bytes()).collect();
                parts.push(&PAD[..Self::scales_at(inter, hidden) - 3 * inter * hidden]);
                for t in matrices {
                    let scales = t
                        .scales()
                        .ok_or_else(|| Error::tensor(&t.name, "an FP8 expert matrix without scales"))?;
                    parts.push(scales.values.bytes());
                }
                Ok(parts)
            }
        }
    }

    /// The FP8 kernels' block arguments: gate/up rows and columns per scale, then down's.
    pub(super) fn fp8_block_args(blocks: Fp8Blocks) -> [i32; 4] {
        [blocks.gate_up[0], blocks.gate_up[1], blocks.down[0], blocks.down[1]].map(|v| v as i32)
    }
}

kernel! {
    /// moe.cu's `dequantize_fp8_expert`: matrices `first..first + count` of an FP8 expert block as bf16, back to
    /// back.
    struct DequantizeFp8Expert = "dequantize_fp8_expert" {
        block: Ptr<u8>,
        hidden: i32,
        inter: i32,
        gate_up_block_rows: i32,
        gate_up_block_cols: i32,
        down_block_rows: i32,
        down_block_cols: i32,
        first: i32,
        count: i32,
        hi: Ptr<u16>,
        lo: Ptr<u16>,
    }
}

/// Gate and up (`down == false`, one `[2 * inter, hidden]` matrix) or down (`[hidden, inter]`) of the FP8 expert
/// block at `block`, dequantized into bf16 halves `hi + lo` in `scratch` (at least `4 * inter * hidden` values):
/// the grouped prefill path's cuBLAS products read FP8 experts this way (no FP8 tensor cores yet), one product per
/// half.
pub(super) fn dequantized(
    cuda: &CudaBackend,
    block: u64,
    blocks: Fp8Blocks,
    inter: usize,
    hidden: usize,
    down: bool,
    scratch: Ptr<u16>,
) -> Result<[Bf16Matrix; 2]> {
    let [gate_up_block_rows, gate_up_block_cols, down_block_rows, down_block_cols] =
        ExpertFormat::fp8_block_args(blocks);
    let (first, count) = if down { (2, 1) } else { (0, 2) };
    let launch = DequantizeFp8Expert {
        block: Ptr::at(block),
        hidden: hidden as i32,
        inter: inter as i32,
        gate_up_block_rows,
        gate_up_block_cols,
        down_block_rows,
        down_block_cols,
        first,
        count,
        hi: scratch,
        lo: scratch.offset(2 * inter * hidden),
    };
    launch.launch(cuda, grid_1d(count as usize * inter * hidden, BLOCK_THREADS))?;
    let (rows, cols) = if down { (hidden, inter) } else { (2 * inter, hidden) };
    Ok([scratch, scratch.offset(2 * inter * hidden)].map(|data| Bf16Matrix { data, rows, cols }))
}

kernel! {
    /// moe.cu's `dequantize_mxfp4_expert`: matrices `first..first + count` of an MXFP4 expert block as bf16, back
    /// to back.
    struct DequantizeMxfp4Expert = "dequantize_mxfp4_expert" {
        block: Ptr<u8>,
        hidden: i32,
        inter: i32,
        first: i32,
        count: i32,
        out: Ptr<u16>,
    }
}

/// Gate and up (`down == false`, one `[2 * inter, hidden]` matrix) or down (`[hidden, inter]`) of the MXFP4 expert
/// block at `block`, widened to bf16 in `scratch` (at least `2 * inter * hidden` values): exact, so the grouped
/// prefill path's cuBLAS products read them as they read bf16 experts.
pub(super) fn widened_mxfp4(
    cuda: &CudaBackend,
    block: u64,
    inter: usize,
    hidden: usize,
    down: bool,
    scratch: Ptr<u16>,
) -> Result<Bf16Matrix> {
    let (first, count) = if down { (2, 1) } else { (0, 2) };
    let launch = DequantizeMxfp4Expert {
        block: Ptr::at(block),
        hidden: hidden as i32,
        inter: inter as i32,
        first,
        count,
        out: scratch,
    };
    launch.launch(cuda, grid_1d(count as usize * inter * hidden, BLOCK_THREADS))?;
    let (rows, cols) = if down { (hidden, inter) } else { (2 * inter, hidden) };
    Ok(Bf16Matrix {
        data: scratch,
        rows,
        cols,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::{quantize_fp8, Fp8Scheme};

    /// The planner sizes expert slots by `ModelInfo::bytes_per_expert`, which for gpt-oss-120b's experts is 17
    /// bytes per 32 weights (MXFP4) or 2 per weight (bf16), plus f32 biases (engine/plan.rs's test holds it to
    /// these numbers): exactly the block the GPU allocates per slot.
    #[test]
    fn gpt_oss_blocks_are_the_bytes_the_planner_counts() {
        let biases = 4 * (2 * 2880 + 2880);
        assert_eq!(
            ExpertFormat::Mxfp4.block_bytes(2880, 2880, true),
            3 * 2880 * 2880 / 32 * 17 + biases
        );
        assert_eq!(
            ExpertFormat::Bf16.block_bytes(2880, 2880, true),
            3 * 2880 * 2880 * 2 + biases
        );
    }

    /// Biases start 16-byte aligned after the weights, and a block without them ends with its weights.
    #[test]
    fn biases_follow_the_weights_on_a_16_byte_boundary() {
        // 32 x 96 MXFP4: 3 x 1632 bytes, 4896, a multiple of 16; bf16 32 x 33: 6336.
        assert_eq!(ExpertFormat::Mxfp4.bias_at(32, 96), 4896);
        assert_eq!(ExpertFormat::Mxfp4.block_bytes(32, 96, true), 4896 + 4 * (64 + 96));
        assert_eq!(ExpertFormat::Bf16.bias_at(32, 33), 6336);
        assert_eq!(ExpertFormat::Bf16.bias_at(3, 5), 96);
        // 90 bytes of weights, padded to 96 (BLOCK_ALIGN).
        assert_eq!(ExpertFormat::Bf16.block_bytes(3, 5, false), 96);
    }

    fn expert(inter: usize, hidden: usize, fp8: Option<Fp8Scheme>) -> ExpertTensors {
        let matrix = |name: &str, rows: usize, cols: usize| {
            let values: Vec<f32> = (0..rows * cols).map(|i| (i % 7) as f32 - 3.0).collect();
            let bf16 = values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect();
            let t = TensorRef::from_bytes(name, DType::BF16, vec![rows, cols], bf16).unwrap();
            match fp8 {
                Some(scheme) => quantize_fp8(&t, scheme).unwrap(),
                None => t,
            }
        };
        ExpertTensors::unbiased(
            matrix("gate", inter, hidden),
            matrix("up", inter, hidden),
            matrix("down", hidden, inter),
        )
    }

    /// The expert kernels sum aligned rows in another order than unaligned ones, so a block must sit at the same
    /// alignment wherever it is placed. qwen3_moe_fp8's experts (32 features of 64 inputs, one 128 x 128 block per
    /// matrix) made 6156-byte blocks: an expert's alignment then depended on its slot, and offload differed from
    /// all-resident (H200, 2026-12-01).
    #[test]
    fn every_expert_block_is_a_multiple_of_16_bytes_and_made_of_its_parts() {
        for (inter, hidden) in [(32, 64), (100, 520), (3, 5), (768, 2048)] {
            for fp8 in [None, Some(Fp8Scheme::BLOCK_128), Some(Fp8Scheme::PerChannel)] {
                let e = expert(inter, hidden, fp8);
                let format = ExpertFormat::of(std::slice::from_ref(&e)).unwrap();
                let bytes = format.block_bytes(inter, hidden, false);
                assert_eq!(bytes % BLOCK_ALIGN, 0, "{inter} x {hidden}, {fp8:?}: {bytes} bytes");
                let parts: usize = format.block_parts(&e).unwrap().iter().map(|p| p.len()).sum();
                assert_eq!(parts, bytes, "{inter} x {hidden}, {fp8:?}");
            }
        }
    }

    /// The budget planner sizes a cache slot by `ModelInfo::bytes_per_expert` (from `Fp8Scheme::matrix_bytes`):
    /// for the published shapes (bench/q30-fp8.json's) that is the block the GPU allocates per slot.
    #[test]
    fn an_fp8_slot_is_the_size_the_planner_counts() {
        let scheme = Fp8Scheme::BLOCK_128;
        let (inter, hidden) = (768, 2048);
        let format = ExpertFormat::of(&[expert(inter, hidden, Some(scheme))]).unwrap();
        let planned = 2 * scheme.matrix_bytes(inter, hidden) + scheme.matrix_bytes(hidden, inter);
        assert_eq!(format.block_bytes(inter, hidden, false) as u64, planned);
    }
}
