//! TEMPORARY scalar placeholder; replaced by the SIMD module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDType {
    F32,
    F16,
    BF16,
}

pub fn matmul(x: &[f32], m_tokens: usize, k: usize, w: &[u8], dtype: WeightDType, n_rows: usize, out: &mut [f32]) {
    let es = if dtype == WeightDType::F32 { 4 } else { 2 };
    for r in 0..n_rows {
        let row: Vec<f32> = w[r * k * es..(r + 1) * k * es]
            .chunks_exact(es)
            .map(|c| match dtype {
                WeightDType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                WeightDType::F16 => half::f16::from_le_bytes([c[0], c[1]]).to_f32(),
                WeightDType::BF16 => half::bf16::from_le_bytes([c[0], c[1]]).to_f32(),
            })
            .collect();
        for m in 0..m_tokens {
            out[m * n_rows + r] = x[m * k..(m + 1) * k].iter().zip(&row).map(|(a, b)| a * b).sum();
        }
    }
}
