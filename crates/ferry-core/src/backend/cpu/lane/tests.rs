//! The CPU lane against the CPU backend's `moe_experts`: the same kernels over the same rows in the same order, so
//! each pair's product, weighted and summed in router order, must equal the backend's output to the bit, for bf16,
//! FP8 and MXFP4 experts.

use super::*;
use crate::backend::cpu::moe::{CpuExperts, Routing};
use crate::backend::cpu::CpuTensor;
use crate::backend::ExpertTensors;
use crate::loader::{quantize_fp8, DType, Fp8Scheme, TensorRef};

struct Random(u64);

impl Random {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    fn below(&mut self, n: usize) -> usize {
        ((self.next() + 1.0) / 2.0 * n as f32) as usize % n
    }

    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

fn bf16_tensor(name: &str, shape: Vec<usize>, values: &[f32]) -> TensorRef {
    let bytes = values
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect();
    TensorRef::from_bytes(name, DType::BF16, shape, bytes).unwrap()
}

/// `n` experts of `hidden` x `inter` in bf16, with f32 biases when `biased`.
fn experts(random: &mut Random, n: usize, hidden: usize, inter: usize, biased: bool) -> Vec<ExpertTensors> {
    (0..n)
        .map(|e| {
            let mut bias =
                |len: usize| biased.then(|| TensorRef::from_f32("bias", vec![len], &random.values(len)).unwrap());
            let (gate_bias, up_bias, down_bias) = (bias(inter), bias(inter), bias(hidden));
            ExpertTensors {
                gate_bias,
                up_bias,
                down_bias,
                ..ExpertTensors::unbiased(
                    bf16_tensor(&format!("gate{e}"), vec![inter, hidden], &random.values(inter * hidden)),
                    bf16_tensor(&format!("up{e}"), vec![inter, hidden], &random.values(inter * hidden)),
                    bf16_tensor(&format!("down{e}"), vec![hidden, inter], &random.values(hidden * inter)),
                )
            }
        })
        .collect()
}

/// The lane's products for `routing`, weighted and summed per row in router order as moe_combine sums them.
fn lane_forward(
    lane: &mut HostLane,
    experts: &[ExpertTensors],
    activation: ExpertActivation,
    x: &CpuTensor,
    routing: &Routing,
) -> Vec<f32> {
    let biases: Vec<[Option<Vec<f32>>; 3]> = experts
        .iter()
        .map(|e| [&e.gate_bias, &e.up_bias, &e.down_bias].map(|b| b.as_ref().map(TensorRef::to_f32_vec)))
        .collect();
    let lane_experts: Vec<LaneExpert> = experts
        .iter()
        .zip(&biases)
        .map(|(e, [g, u, d])| LaneExpert {
            gate: e.gate.bytes(),
            up: e.up.bytes(),
            down: e.down.bytes(),
            dtype: match e.gate.dtype {
                DType::F8E4M3 => LaneDType::Gemv(WeightDType::F8E4M3),
                DType::Mxfp4 => LaneDType::Mxfp4,
                _ => LaneDType::Gemv(WeightDType::BF16),
            },
            scales: e.gate.scales().map(|_| {
                [&e.gate, &e.up, &e.down].map(|t| {
                    let s = t.scales().unwrap();
                    BlockScales {
                        bytes: s.values.bytes(),
                        block_rows: s.block[0],
                        block_cols: s.block[1],
                    }
                })
            }),
            gate_bias: g.as_deref(),
            up_bias: u.as_deref(),
            down_bias: d.as_deref(),
        })
        .collect();
    let (hidden, inter) = (x.cols, experts[0].gate.shape[0]);
    let pairs: Vec<(u32, u32)> = routing
        .ids
        .iter()
        .enumerate()
        .map(|(p, &e)| ((p / routing.top_k) as u32, e))
        .collect();
    let work = LaneWork {
        x: &x.data,
        hidden,
        inter,
        activation,
        experts: &lane_experts,
        pairs: &pairs,
    };
    let mut products = vec![f32::NAN; pairs.len() * hidden];
    let (during, _) = lane.compute(&work, &mut products, || "the caller ran").unwrap();
    assert_eq!(during, "the caller ran");
    let mut out = vec![0.0f32; x.rows * hidden];
    for (r, row) in out.chunks_mut(hidden).enumerate() {
        for k in 0..routing.top_k {
            let pair = r * routing.top_k + k;
            let w = routing.weights[pair];
            row.iter_mut()
                .zip(&products[pair * hidden..(pair + 1) * hidden])
                .for_each(|(o, y)| *o += w * y);
        }
    }
    out
}

#[test]
fn lane_matches_the_cpu_backend_to_the_bit_for_1_to_16_rows_both_activations_and_biases() {
    let mut random = Random(42);
    let (hidden, inter, n_experts, top_k) = (96, 80, 6, 3);
    let mut lane = HostLane::new(3).unwrap();
    for (activation, biased) in [
        (ExpertActivation::SiluGlu, false),
        (
            ExpertActivation::ClampedSwiGlu {
                alpha: 1.702,
                limit: 0.5,
            },
            true,
        ),
    ] {
        let tensors = experts(&mut random, n_experts, hidden, inter, biased);
        let cpu = CpuExperts::new(tensors.clone(), activation).unwrap();
        for rows in [1, 2, 3, 5, 8, 16] {
            let x = CpuTensor {
                data: random.values(rows * hidden),
                rows,
                cols: hidden,
            };
            // Distinct experts per row, in a random router order.
            let mut ids = Vec::new();
            for _ in 0..rows {
                let mut row: Vec<u32> = Vec::new();
                while row.len() < top_k {
                    let e = random.below(n_experts) as u32;
                    if !row.contains(&e) {
                        row.push(e);
                    }
                }
                ids.extend(row);
            }
            let routing = Routing {
                top_k,
                weights: random.values(ids.len()),
                ids,
            };
            let want = cpu.forward(&x, &routing).unwrap();
            let got = lane_forward(&mut lane, &tensors, activation, &x, &routing);
            assert!(
                got.iter().zip(&want.data).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{activation:?}, {rows} rows: the lane differs from the CPU backend"
            );
        }
    }
}

#[test]
fn lane_spreads_large_experts_over_items_and_refuses_bad_shapes() {
    // Large enough that gate/up and down each split into several items (ITEM_BYTES over a row's bytes).
    let mut random = Random(7);
    let (hidden, inter) = (1024, 320);
    let tensors = experts(&mut random, 2, hidden, inter, false);
    let cpu = CpuExperts::new(tensors.clone(), ExpertActivation::SiluGlu).unwrap();
    let x = CpuTensor {
        data: random.values(2 * hidden),
        rows: 2,
        cols: hidden,
    };
    let routing = Routing {
        top_k: 2,
        ids: vec![1, 0, 0, 1],
        weights: vec![0.25, 0.75, 0.5, 0.5],
    };
    let mut lane = HostLane::new(2).unwrap();
    let got = lane_forward(&mut lane, &tensors, ExpertActivation::SiluGlu, &x, &routing);
    let want = cpu.forward(&x, &routing).unwrap();
    assert!(got.iter().zip(&want.data).all(|(a, b)| a.to_bits() == b.to_bits()));

    let e = &tensors[0];
    let expert = LaneExpert {
        gate: e.gate.bytes(),
        up: e.up.bytes(),
        down: &e.down.bytes()[2..],
        dtype: LaneDType::Gemv(WeightDType::BF16),
        scales: None,
        gate_bias: None,
        up_bias: None,
        down_bias: None,
    };
    let work = LaneWork {
        x: &x.data,
        hidden,
        inter,
        activation: ExpertActivation::SiluGlu,
        experts: &[expert],
        pairs: &[(0, 0)],
    };
    let mut out = vec![0.0; hidden];
    assert!(matches!(lane.compute(&work, &mut out, || ()), Err(Error::Shape(_))));
    let work = LaneWork {
        experts: &[LaneExpert {
            down: e.down.bytes(),
            ..expert
        }],
        pairs: &[(2, 0)],
        ..work
    };
    assert!(
        matches!(lane.compute(&work, &mut out, || ()), Err(Error::Shape(_))),
        "a row past x"
    );
}

#[test]
fn lane_over_fp8_experts_matches_the_cpu_backend_to_the_bit_in_blocks_and_per_channel() {
    let mut random = Random(11);
    // Gate/up and down each split into several items, whose rows must start on the scale grid's rows: 256 KiB
    // over 2 x 512 one-byte rows is 256 rows of gate/up, 288 with 96-row scale blocks (4 items); 227 rows of down,
    // 288 again (2 items, the last scale block of down partial); per channel 256 and 240.
    let (hidden, inter, n_experts, top_k) = (512, 1152, 4, 2);
    let bf16 = experts(&mut random, n_experts, hidden, inter, false);
    let mut lane = HostLane::new(3).unwrap();
    for scheme in [Fp8Scheme::Blocks { rows: 96, cols: 64 }, Fp8Scheme::PerChannel] {
        let fp8: Vec<ExpertTensors> = bf16
            .iter()
            .map(|e| {
                ExpertTensors::unbiased(
                    quantize_fp8(&e.gate, scheme).unwrap(),
                    quantize_fp8(&e.up, scheme).unwrap(),
                    quantize_fp8(&e.down, scheme).unwrap(),
                )
            })
            .collect();
        assert_eq!(fp8[0].gate.dtype, DType::F8E4M3);
        let cpu = CpuExperts::new(fp8.clone(), ExpertActivation::SiluGlu).unwrap();
        for rows in [1, 3, 8] {
            let x = CpuTensor {
                data: random.values(rows * hidden),
                rows,
                cols: hidden,
            };
            let ids: Vec<u32> = (0..rows * top_k)
                .map(|p| ((p / top_k + p % top_k) % n_experts) as u32)
                .collect();
            let routing = Routing {
                top_k,
                weights: random.values(ids.len()),
                ids,
            };
            let want = cpu.forward(&x, &routing).unwrap();
            let got = lane_forward(&mut lane, &fp8, ExpertActivation::SiluGlu, &x, &routing);
            assert!(
                got.iter().zip(&want.data).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{scheme:?}, {rows} rows: the lane differs from the CPU backend"
            );
        }
    }
    // FP8 weights without their scales, or with a grid of the wrong size, are refused.
    let e = {
        let e = &bf16[0];
        [&e.gate, &e.up, &e.down].map(|t| quantize_fp8(t, Fp8Scheme::BLOCK_128).unwrap())
    };
    let scales = e.each_ref().map(|t| {
        let s = t.scales().unwrap();
        BlockScales {
            bytes: s.values.bytes(),
            block_rows: s.block[0],
            block_cols: s.block[1],
        }
    });
    let expert = LaneExpert {
        gate: e[0].bytes(),
        up: e[1].bytes(),
        down: e[2].bytes(),
        dtype: LaneDType::Gemv(WeightDType::F8E4M3),
        scales: None,
        gate_bias: None,
        up_bias: None,
        down_bias: None,
    };
    let x = random.values(hidden);
    let mut out = vec![0.0; hidden];
    let mut run = |expert: LaneExpert| {
        let work = LaneWork {
            x: &x,
            hidden,
            inter,
            activation: ExpertActivation::SiluGlu,
            experts: &[expert],
            pairs: &[(0, 0)],
        };
        lane.compute(&work, &mut out, || ()).map(drop)
    };
    assert!(matches!(run(expert), Err(Error::Shape(_))), "FP8 without scales");
    let short = [
        scales[0],
        BlockScales {
            bytes: &scales[1].bytes[4..],
            ..scales[1]
        },
        scales[2],
    ];
    let short = LaneExpert {
        scales: Some(short),
        ..expert
    };
    assert!(matches!(run(short), Err(Error::Shape(_))), "a scale grid too small");
    run(LaneExpert {
        scales: Some(scales),
        ..expert
    })
    .unwrap();
}

/// A packed `[n, k]` MXFP4 matrix of random values, its scales 2^-6 ..= 2^1.
fn mxfp4_tensor(random: &mut Random, name: &str, n: usize, k: usize) -> TensorRef {
    let mut bytes: Vec<u8> = (0..n * k / 2).map(|_| random.below(256) as u8).collect();
    bytes.extend((0..n * k / 32).map(|_| 121 + random.below(8) as u8));
    TensorRef::from_bytes(name, DType::Mxfp4, vec![n, k], bytes).unwrap()
}

/// gpt-oss's experts: MXFP4 with f32 biases and the clamped SwiGLU, large enough that gate/up split into three
/// items (128, 128 and 64 rows: 256 KiB over 2 x 1088-byte rows, rounded up to 16) and down into two (1552 and 496
/// features), each item several 16-row tiles, and plain SiLU without biases over the same weights.
#[test]
fn lane_over_mxfp4_experts_matches_the_cpu_backend_to_the_bit_with_biases_and_the_clamped_swiglu() {
    let mut random = Random(5);
    let (hidden, inter, n_experts, top_k) = (2048, 320, 3, 2);
    let mxfp4: Vec<ExpertTensors> = (0..n_experts)
        .map(|e| ExpertTensors {
            gate_bias: Some(TensorRef::from_f32("gate.bias", vec![inter], &random.values(inter)).unwrap()),
            up_bias: Some(TensorRef::from_f32("up.bias", vec![inter], &random.values(inter)).unwrap()),
            down_bias: Some(TensorRef::from_f32("down.bias", vec![hidden], &random.values(hidden)).unwrap()),
            ..ExpertTensors::unbiased(
                mxfp4_tensor(&mut random, &format!("gate{e}"), inter, hidden),
                mxfp4_tensor(&mut random, &format!("up{e}"), inter, hidden),
                mxfp4_tensor(&mut random, &format!("down{e}"), hidden, inter),
            )
        })
        .collect();
    let unbiased: Vec<ExpertTensors> = mxfp4
        .iter()
        .map(|e| ExpertTensors::unbiased(e.gate.clone(), e.up.clone(), e.down.clone()))
        .collect();
    let mut lane = HostLane::new(3).unwrap();
    let clamped = ExpertActivation::ClampedSwiGlu {
        alpha: 1.702,
        limit: 7.0,
    };
    for (tensors, activation) in [(&mxfp4, clamped), (&unbiased, ExpertActivation::SiluGlu)] {
        let cpu = CpuExperts::new(tensors.clone(), activation).unwrap();
        for rows in [1, 3, 8] {
            let x = CpuTensor {
                data: random.values(rows * hidden),
                rows,
                cols: hidden,
            };
            let ids: Vec<u32> = (0..rows * top_k)
                .map(|p| ((p / top_k + 2 * (p % top_k)) % n_experts) as u32)
                .collect();
            let routing = Routing {
                top_k,
                weights: random.values(ids.len()),
                ids,
            };
            let want = cpu.forward(&x, &routing).unwrap();
            assert!(
                want.data.iter().all(|v| v.is_finite() && *v != 0.0),
                "{activation:?}: degenerate products"
            );
            let got = lane_forward(&mut lane, tensors, activation, &x, &routing);
            assert!(
                got.iter().zip(&want.data).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{activation:?}, {rows} rows: the lane differs from the CPU backend"
            );
        }
    }
    // MXFP4 matrices of the wrong length are refused.
    let e = &mxfp4[0];
    let expert = LaneExpert {
        gate: e.gate.bytes(),
        up: e.up.bytes(),
        down: &e.down.bytes()[1..],
        dtype: LaneDType::Mxfp4,
        scales: None,
        gate_bias: None,
        up_bias: None,
        down_bias: None,
    };
    let work = LaneWork {
        x: &random.values(hidden),
        hidden,
        inter,
        activation: ExpertActivation::SiluGlu,
        experts: &[expert],
        pairs: &[(0, 0)],
    };
    let mut out = vec![0.0; hidden];
    assert!(matches!(lane.compute(&work, &mut out, || ()), Err(Error::Shape(_))));
}
