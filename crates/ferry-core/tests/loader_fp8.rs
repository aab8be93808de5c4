//! FP8 checkpoints as the loader sees them: the block-FP8 fixture's weights carry their scales and count real bytes,
//! and a checkpoint whose FP8 weights lack their scales, or have scales of the wrong shape, or has no quantization
//! config, fails with an error naming the tensor.

use std::path::{Path, PathBuf};

use ferry_core::loader::{Checkpoint, DType, Fp8Scheme};
use ferry_core::model::{spec_for, FfnKind, ModelInfo};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

#[test]
fn block_fp8_fixture_loads_with_scales_and_real_sizes() {
    let checkpoint = Checkpoint::open(&fixtures().join("qwen3_moe_fp8")).unwrap();
    let format = checkpoint.weight_format();
    assert_eq!(format.dtype, DType::BF16);
    assert_eq!(format.experts_fp8, Some(Fp8Scheme::BLOCK_128));
    assert_eq!(format.dense_fp8, Some(Fp8Scheme::BLOCK_128), "its attention is FP8 too");
    assert_eq!(
        format.describe(),
        "bf16, dense linears and experts fp8 e4m3, 128x128 blocks"
    );
    let gate = checkpoint
        .weights
        .get("model.layers.0.mlp.experts.3.gate_proj.weight")
        .unwrap();
    assert_eq!(gate.dtype, DType::F8E4M3);
    let scales = gate.scales().expect("FP8 weights carry their scales");
    assert_eq!(
        (scales.block, scales.values.shape.as_slice()),
        ([128, 128], &[1, 1][..])
    );
    // Routers stay bf16, as the config's modules_to_not_convert says.
    assert_eq!(
        checkpoint.weights.get("model.layers.0.mlp.gate.weight").unwrap().dtype,
        DType::BF16
    );
    let spec = spec_for(&checkpoint.model_type, &checkpoint.config).unwrap();
    let info = ModelInfo::new(&spec, format);
    // Three [32, 64] matrices of one byte per weight and one f32 scale each.
    assert_eq!(info.bytes_per_expert, 3 * (32 * 64 + 4));
    assert_eq!(info.expert_bank_bytes, 2 * 8 * info.bytes_per_expert);
    // The attention projections and the dense MLP count one byte a weight and an f32 scale a 128 x 128 block, not
    // two bytes a weight; the rest of the dense part is as in bf16.
    let bf16 = ModelInfo::new(
        &spec,
        ferry_core::loader::WeightFormat {
            dense_fp8: None,
            ..format
        },
    );
    let (h, q, kv) = (
        spec.hidden_size,
        spec.num_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
    );
    let mut linears = Vec::new();
    for layer in &spec.layers {
        linears.extend([(q, h), (kv, h), (kv, h), (h, q)]);
        if let FfnKind::Dense { intermediate: i } = layer.ffn {
            linears.extend([(i, h), (i, h), (h, i)]);
        }
    }
    let saved: usize = linears
        .iter()
        .map(|&(rows, cols)| 2 * rows * cols - (rows * cols + 4 * rows.div_ceil(128) * cols.div_ceil(128)))
        .sum();
    assert_eq!(bf16.dense_bytes - info.dense_bytes, saved as u64);
    let largest = linears.iter().map(|&(rows, cols)| rows * cols).max().unwrap();
    assert_eq!(info.largest_fp8_dense_linear, largest as u64);
    assert_eq!(bf16.largest_fp8_dense_linear, 0);
}

/// A checkpoint directory holding `tensors` (name, dtype, shape, bytes) and a qwen3_moe config with `quantization`.
fn checkpoint_with(
    dir: &Path,
    tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)],
    quantization: Option<serde_json::Value>,
) {
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("qwen3_moe/config.json")).unwrap()).unwrap();
    if let Some(q) = quantization {
        config["quantization_config"] = q;
    }
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| (name.to_string(), TensorView::new(*dtype, shape.clone(), bytes).unwrap()))
        .collect();
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
}

fn open_error(tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)], quantization: Option<serde_json::Value>) -> String {
    let dir = tempfile::tempdir().unwrap();
    checkpoint_with(dir.path(), tensors, quantization);
    match Checkpoint::open(dir.path()) {
        Ok(_) => panic!("a broken FP8 checkpoint opened"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn broken_fp8_checkpoints_fail_naming_the_tensor() {
    let block = serde_json::json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]});
    let weight = ("w.weight", Dtype::F8_E4M3, vec![130, 64], vec![0x38; 130 * 64]);
    let f32s = |n: usize| 1f32.to_le_bytes().repeat(n);

    let err = open_error(std::slice::from_ref(&weight), Some(block.clone()));
    assert!(
        err.contains("w.weight") && err.contains("without its scales w.weight_scale_inv"),
        "{err}"
    );

    // 130 rows are two blocks of 128 rows, not one.
    let short = ("w.weight_scale_inv", Dtype::F32, vec![1, 1], f32s(1));
    let err = open_error(&[weight.clone(), short], Some(block.clone()));
    assert!(err.contains("w.weight") && err.contains("[2, 1]"), "{err}");

    let err = open_error(std::slice::from_ref(&weight), None);
    assert!(
        err.contains("w.weight") && err.contains("no quantization_config"),
        "{err}"
    );

    let router = (
        "model.layers.0.mlp.gate.weight",
        Dtype::F8_E4M3,
        vec![8, 64],
        vec![0x38; 8 * 64],
    );
    let router_scales = (
        "model.layers.0.mlp.gate.weight_scale_inv",
        Dtype::F32,
        vec![1, 1],
        f32s(1),
    );
    let err = open_error(&[router, router_scales], Some(block));
    assert!(
        err.contains("mlp.gate.weight") && err.contains("keeps its module unquantized"),
        "{err}"
    );

    // Whole scales of the right shape open.
    let dir = tempfile::tempdir().unwrap();
    let scales = ("w.weight_scale_inv", Dtype::F32, vec![2, 1], f32s(2));
    let q = serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128]});
    checkpoint_with(dir.path(), &[weight, scales], Some(q));
    let checkpoint = Checkpoint::open(dir.path()).unwrap();
    let values = checkpoint.weights.get("w.weight").unwrap().to_f32_vec();
    // 0x38 is 1.0 in E4M3, times scales of one.
    assert!(values.iter().all(|&v| v == 1.0));
}
