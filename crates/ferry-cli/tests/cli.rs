//! The `ferry` binary end to end: generate and info on the bundled fixture, and bad input of every kind, which
//! must end in a non-zero exit with a message naming the file or tensor at fault, never a panic.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{ferry, fixture, FIXTURE};

/// A private copy of a fixture to break.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

fn first_shard(dir: &Path) -> PathBuf {
    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    shards.sort();
    shards.remove(0)
}

/// Runs `generate` on a broken checkpoint: it must fail cleanly and mention `needle`.
fn expect_clean_failure(model: &Path, needle: &str) {
    let out = ferry(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "2",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "ferry succeeded on a broken checkpoint");
    assert!(!stderr.contains("panicked"), "ferry panicked:\n{stderr}");
    assert!(
        stderr.contains(needle),
        "the error does not mention {needle:?}:\n{stderr}"
    );
}

fn reference_case(name: &str, case: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
    let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
    reference["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == case)
        .unwrap()
        .clone()
}

#[test]
fn generate_json_matches_the_reference_continuation() {
    let case = reference_case(FIXTURE, "short");
    let ids: Vec<String> = case["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    let model = fixture(FIXTURE);
    let out = ferry(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        &ids.join(","),
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    let expected = &case["generated_ids"].as_array().unwrap()[..8];
    assert_eq!(json["token_ids"].as_array().unwrap(), expected);
    assert_eq!(json["prompt_tokens"], ids.len());
    assert_eq!(json["completion_tokens"], 8);
    assert!(json["text"].is_string());
}

#[test]
fn generate_from_text_and_chat_prompts() {
    let model = fixture(FIXTURE);
    for chat in [false, true] {
        let case = reference_case(FIXTURE, if chat { "chat" } else { "short" });
        let prompt = if chat {
            case["messages"][0]["content"].as_str().unwrap().to_string()
        } else {
            case["prompt_text"].as_str().unwrap().to_string()
        };
        let mut args = vec!["generate", "--model", model.to_str().unwrap(), "--prompt", &prompt];
        args.extend(["--max-tokens", "4", "--temperature", "0", "--ignore-eos", "--json"]);
        if chat {
            args.push("--chat");
        }
        let out = ferry(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["prompt_tokens"], case["prompt_ids"].as_array().unwrap().len());
        assert_eq!(
            json["token_ids"].as_array().unwrap(),
            &case["generated_ids"].as_array().unwrap()[..4]
        );
    }
}

#[test]
fn info_describes_the_experts() {
    let model = fixture(FIXTURE);
    let out = ferry(&["info", "--model", model.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    assert_eq!(info["model_type"], "qwen3_moe");
    assert_eq!(info["num_experts"], config["num_experts"]);
    assert_eq!(info["experts_per_token"], config["num_experts_per_tok"]);
    let h = config["hidden_size"].as_u64().unwrap();
    let inter = config["moe_intermediate_size"].as_u64().unwrap();
    assert_eq!(info["bytes_per_expert"], 3 * h * inter * 2);
    let moe_layers = info["num_moe_layers"].as_u64().unwrap();
    let experts = config["num_experts"].as_u64().unwrap();
    assert_eq!(info["expert_bank_bytes"], moe_layers * experts * 3 * h * inter * 2);
    // The whole checkpoint is the bank plus the dense part, byte for byte.
    assert_eq!(
        info["expert_bank_bytes"].as_u64().unwrap() + info["dense_bytes"].as_u64().unwrap(),
        stored_weight_bytes(&model)
    );
}

/// The tensor bytes of a checkpoint's safetensors shards (without their headers).
fn stored_weight_bytes(model: &Path) -> u64 {
    std::fs::read_dir(model)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| {
            let bytes = std::fs::read(p).unwrap();
            let header = u64::from_le_bytes(bytes[..8].try_into().unwrap());
            bytes.len() as u64 - 8 - header
        })
        .sum()
}

#[test]
fn info_describes_a_hybrid_model() {
    let model = fixture("qwen3_next");
    let out = ferry(&["info", "--model", model.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let get = |key: &str| config[key].as_u64().unwrap();
    // Every fourth layer attends; the others are Gated DeltaNet layers, which keep no keys and values.
    assert_eq!(info["num_attention_layers"], 1);
    assert_eq!(info["num_gated_delta_net_layers"], 3);
    assert_eq!(
        info["kv_bytes_per_token_bf16"],
        2 * get("num_key_value_heads") * get("head_dim") * 2
    );
    let conv_dim = 2 * get("linear_num_key_heads") * get("linear_key_head_dim")
        + get("linear_num_value_heads") * get("linear_value_head_dim");
    let conv_state = (get("linear_conv_kernel_dim") - 1) * conv_dim;
    let delta_state = get("linear_num_value_heads") * get("linear_key_head_dim") * get("linear_value_head_dim");
    assert_eq!(
        info["recurrent_state_bytes_per_seq"],
        3 * (conv_state + delta_state) * 4
    );
    assert_eq!(
        info["expert_bank_bytes"].as_u64().unwrap() + info["dense_bytes"].as_u64().unwrap(),
        stored_weight_bytes(&model),
        "the checkpoint is the bank plus the dense part, byte for byte"
    );
    let table = ferry(&["info", "--model", model.to_str().unwrap()]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("1 attention + 3 Gated DeltaNet"), "{table}");
}

#[test]
fn a_multimodal_checkpoint_ties_its_head_as_its_top_level_config_says() {
    let info = |dir: &Path| -> serde_json::Value {
        let out = ferry(&["info", "--model", dir.to_str().unwrap(), "--json"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let untied = info(&fixture("qwen3_5_moe"));
    let dir = copy_fixture("qwen3_5_moe");
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["tie_word_embeddings"] = true.into();
    config["text_config"]
        .as_object_mut()
        .unwrap()
        .remove("tie_word_embeddings");
    std::fs::write(&path, config.to_string()).unwrap();
    let tied = info(dir.path());
    let head = untied["vocab_size"].as_u64().unwrap() * untied["hidden_size"].as_u64().unwrap() * 2;
    assert_eq!(
        untied["dense_bytes"].as_u64().unwrap() - tied["dense_bytes"].as_u64().unwrap(),
        head,
        "a tied model has no separate lm_head"
    );
    // A token reads the head whole and one embedding row: the same bytes tied or not, but for that row.
    let active = |info: &serde_json::Value| info["bytes_active_per_token"].as_u64().unwrap();
    assert_eq!(
        active(&untied) - active(&tied),
        untied["hidden_size"].as_u64().unwrap() * 2,
        "a token looks up one embedding row"
    );
}

#[test]
fn missing_directory() {
    expect_clean_failure(Path::new("/nonexistent/ferry-model"), "/nonexistent/ferry-model");
}

#[test]
fn missing_config() {
    let dir = copy_fixture(FIXTURE);
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    expect_clean_failure(dir.path(), "config.json");
}

#[test]
fn garbage_config() {
    let dir = copy_fixture(FIXTURE);
    std::fs::write(dir.path().join("config.json"), "{ this is not json").unwrap();
    expect_clean_failure(dir.path(), "config.json");
}

#[test]
fn config_missing_a_field() {
    let dir = copy_fixture(FIXTURE);
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("num_experts");
    std::fs::write(&path, config.to_string()).unwrap();
    expect_clean_failure(dir.path(), "num_experts");
}

/// The qwen3_next fixture with `edit` applied to its config.json.
fn edited_hybrid(edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let dir = copy_fixture("qwen3_next");
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    dir
}

#[test]
fn hybrid_configs_that_cannot_run_say_why() {
    let dir = edited_hybrid(|c| c["layer_types"] = serde_json::json!(vec!["linear_attention"; 4]));
    expect_clean_failure(dir.path(), "no full_attention layer");
    let dir = edited_hybrid(|c| c["layer_types"] = serde_json::json!(["full_attention"]));
    expect_clean_failure(dir.path(), "layer_types has 1 entries for 4 layers");
    let dir = edited_hybrid(|c| c["linear_num_value_heads"] = 3.into());
    expect_clean_failure(dir.path(), "linear_num_value_heads (3)");
    // A Qwen3-Next checkpoint whose qkvz projection does not fit its config names the tensor.
    let dir = edited_hybrid(|c| c["linear_value_head_dim"] = 8.into());
    expect_clean_failure(dir.path(), "in_proj_qkvz.weight");
}

#[test]
fn unknown_model_type_names_the_supported_ones() {
    let dir = copy_fixture(FIXTURE);
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["model_type"] = "llama4_moe".into();
    std::fs::write(&path, config.to_string()).unwrap();
    expect_clean_failure(dir.path(), "llama4_moe");
    expect_clean_failure(dir.path(), "qwen3_moe, qwen2_moe, mixtral, olmoe");
}

#[test]
fn missing_shard() {
    let dir = copy_fixture(FIXTURE);
    let shard = first_shard(dir.path());
    std::fs::remove_file(&shard).unwrap();
    expect_clean_failure(dir.path(), shard.file_name().unwrap().to_str().unwrap());
}

#[test]
fn truncated_shard() {
    let dir = copy_fixture(FIXTURE);
    let shard = first_shard(dir.path());
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    expect_clean_failure(dir.path(), shard.file_name().unwrap().to_str().unwrap());
}

#[test]
fn shard_index_pointing_outside_the_checkpoint() {
    let dir = copy_fixture(FIXTURE);
    let index_path = dir.path().join("model.safetensors.index.json");
    let mut index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    index["weight_map"]["model.embed_tokens.weight"] = "../../etc/passwd".into();
    std::fs::write(&index_path, index.to_string()).unwrap();
    expect_clean_failure(dir.path(), "outside the checkpoint directory");
}

#[test]
fn tensor_of_the_wrong_shape() {
    let dir = copy_fixture(FIXTURE);
    let shard = first_shard(dir.path());
    let bytes = std::fs::read(&shard).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut views: Vec<(String, safetensors::tensor::TensorView)> = tensors.tensors();
    views.sort_by(|a, b| a.0.cmp(&b.0));
    // Drop the last row of the first matrix in the shard.
    let (name, view) = views.iter().find(|(_, v)| v.shape().len() == 2).unwrap().clone();
    let mut shape = view.shape().to_vec();
    let row_bytes = view.data().len() / shape[0];
    shape[0] -= 1;
    let data = view.data()[..row_bytes * shape[0]].to_vec();
    let shrunk = safetensors::tensor::TensorView::new(view.dtype(), shape, &data).unwrap();
    let replaced = views
        .into_iter()
        .map(|(n, v)| if n == name { (n, shrunk.clone()) } else { (n, v) });
    safetensors::serialize_to_file(replaced, None, &shard).unwrap();
    expect_clean_failure(dir.path(), &name);
}

/// CI has no GPU: asking for one must fail cleanly and say why.
#[test]
fn cuda_without_a_gpu_says_so() {
    let model = fixture(FIXTURE);
    let out = ferry(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        "1",
        "--device",
        "cuda",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if Path::new("/dev/nvidia0").exists() {
        return assert!(out.status.success(), "{stderr}");
    }
    assert!(!out.status.success() && !stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("CUDA"), "{stderr}");
}

#[test]
fn token_id_outside_the_vocabulary_is_refused() {
    let model = fixture(FIXTURE);
    let out = ferry(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        "1,999999",
        "--max-tokens",
        "1",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("999999"), "{stderr}");
}

#[test]
fn synthetic_models_need_no_files() {
    let config = fixture(FIXTURE).join("config.json");
    let continuation = || synthetic_continuation(config.to_str().unwrap());
    let first = continuation();
    assert_eq!(first["completion_tokens"], 3);
    assert_eq!(
        first["token_ids"],
        continuation()["token_ids"],
        "seeded weights give the same continuation"
    );
}

/// `ferry generate`'s JSON for 3 tokens after ids 1, 2, 3 of the synthetic model of `config`, on the CPU.
fn synthetic_continuation(config: &str) -> serde_json::Value {
    let out = ferry(&[
        "generate",
        "--synthetic",
        config,
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "3",
        "--ignore-eos",
        "--json",
        "--device",
        "cpu",
    ]);
    assert!(
        out.status.success(),
        "{config}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn synthetic_fp8_models_are_laid_out_as_the_hubs_fp8_checkpoints() {
    // Each family's FP8 fixture config: its dense linears are drawn in FP8 with its experts, and the model runs.
    for family in ["qwen3_moe_fp8", "glm4_moe_fp8", "deepseek_v3_fp8"] {
        let config = fixture(family).join("config.json");
        let config = config.to_str().unwrap();
        let out = ferry(&["info", "--synthetic", config, "--json"]);
        assert!(
            out.status.success(),
            "{family}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let format = info["weight_dtype"].as_str().unwrap();
        assert!(
            format.starts_with("bf16, dense linears and experts fp8 e4m3, "),
            "{family}: {format}"
        );
        let stored = ferry(&["info", "--model", fixture(family).to_str().unwrap(), "--json"]);
        let stored: serde_json::Value = serde_json::from_slice(&stored.stdout).unwrap();
        assert_eq!(
            info["dense_bytes"], stored["dense_bytes"],
            "{family}: the stored checkpoint's dense bytes"
        );
        let generated = synthetic_continuation(config);
        assert_eq!(generated["completion_tokens"], 3, "{family}");
    }
}

/// `ferry info --json` of the fixture under a 1 GiB GPU budget, with `extra` arguments.
fn info_under_a_budget(extra: &[&str]) -> Output {
    let model = fixture(FIXTURE);
    let mut args = vec![
        "info",
        "--model",
        model.to_str().unwrap(),
        "--json",
        "--gpu-memory-budget",
        "1GiB",
    ];
    args.extend(extra);
    ferry(&args)
}

#[test]
fn info_divides_a_gpu_memory_budget() {
    let model = fixture(FIXTURE);
    let plan_for = |extra: &[&str]| {
        let out = info_under_a_budget(extra);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let fits = plan_for(&[]);
    assert_eq!(fits["memory_plan"]["offload"], false, "a tiny model fits 1 GiB whole");
    assert_eq!(fits["memory_plan"]["expert_bytes"], fits["expert_bank_bytes"]);
    let cached = plan_for(&["--moe-cache-slots", "8"]);
    assert_eq!(cached["memory_plan"]["offload"], true);
    assert_eq!(cached["memory_plan"]["slots"], 8);
    let bank_share = cached["cached_share_of_bank"].as_f64().unwrap();
    assert!(
        (bank_share - 8.0 / 16.0).abs() < 1e-9,
        "8 slots of 2 MoE layers x 8 experts: {bank_share}"
    );
    let out = ferry(&[
        "info",
        "--model",
        model.to_str().unwrap(),
        "--gpu-memory-budget",
        "lots",
    ]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("lots"));
}

#[test]
fn info_plans_each_gpu_of_an_expert_parallel_group() {
    let out = info_under_a_budget(&["--gpus", "2", "--offload", "experts"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let plans = info["memory_plans"].as_array().unwrap();
    assert_eq!(plans.len(), 2);
    // 8 experts a layer, 4 on each GPU: each cache holds its own 2 x 4, and together the whole bank.
    for plan in plans {
        assert_eq!(
            (plan["offload"].as_bool(), plan["slots"].as_u64()),
            (Some(true), Some(8))
        );
        assert_eq!(
            plan["kv_tokens"], plans[0]["kv_tokens"],
            "every GPU keeps the same KV blocks"
        );
    }
    assert_eq!(info["memory_plan"], plans[0]);
    assert_eq!(info["cached_share_of_bank"], 1.0);
    let one = info_under_a_budget(&["--offload", "experts"]);
    let one: serde_json::Value = serde_json::from_slice(&one.stdout).unwrap();
    assert!(one.get("memory_plans").is_none());
    assert_eq!(one["memory_plan"]["slots"], 16);
    // More GPUs than experts a layer, and none, are refused by name.
    let too_many = info_under_a_budget(&["--gpus", "9"]);
    let stderr = String::from_utf8_lossy(&too_many.stderr);
    assert!(!too_many.status.success() && stderr.contains("9 GPUs"), "{stderr}");
    let none = info_under_a_budget(&["--gpus", "0"]);
    assert!(!none.status.success() && String::from_utf8_lossy(&none.stderr).contains("--gpus"));
}

#[test]
fn several_gpus_need_a_gpu_device() {
    let model = fixture(FIXTURE);
    let out = ferry(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "hi",
        "--max-tokens",
        "1",
        "--device",
        "cpu",
        "--gpus",
        "2",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--gpus 2 runs on GPUs"),
        "{stderr}"
    );
}

#[test]
fn one_offload_flag_says_where_experts_live() {
    let plan = |extra: &[&str]| {
        let out = info_under_a_budget(extra);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["memory_plan"].clone()
    };
    // `experts` offloads even a model that fits, its cache sized from the budget: here all 2 x 8 experts.
    let sized = plan(&["--offload", "experts"]);
    assert_eq!(
        (sized["offload"].as_bool(), sized["slots"].as_u64()),
        (Some(true), Some(16))
    );
    let exact = plan(&["--offload", "experts", "--moe-cache-slots", "8"]);
    assert_eq!(
        (exact["offload"].as_bool(), exact["slots"].as_u64()),
        (Some(true), Some(8))
    );
    assert_eq!(plan(&["--offload", "none"])["offload"], false);
    let contradiction = info_under_a_budget(&["--offload", "none", "--moe-cache-slots", "8"]);
    assert!(!contradiction.status.success());
    assert!(String::from_utf8_lossy(&contradiction.stderr).contains("--offload none contradicts --moe-cache-slots"));
    // The flag `--offload experts` replaced is refused by name.
    let retired = info_under_a_budget(&["--moe-cache-auto"]);
    let stderr = String::from_utf8_lossy(&retired.stderr);
    assert!(
        !retired.status.success() && stderr.contains("unexpected argument '--moe-cache-auto'"),
        "{stderr}"
    );
}

/// Overwrites the first element of `tensor` (bf16) in its shard of `dir` with a NaN.
fn poison_with_nan(dir: &Path, tensor: &str) {
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    let shard = dir.join(index["weight_map"][tensor].as_str().unwrap());
    let mut bytes = std::fs::read(&shard).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let start = 8 + header_len + header[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[start..start + 2].copy_from_slice(&0x7fc0u16.to_le_bytes());
    std::fs::write(&shard, bytes).unwrap();
}

#[test]
fn info_check_names_the_tensors_that_are_not_finite_and_loading_warns() {
    let clean = ferry(&["info", "--model", fixture(FIXTURE).to_str().unwrap(), "--check"]);
    assert!(clean.status.success(), "{}", String::from_utf8_lossy(&clean.stderr));
    assert!(String::from_utf8_lossy(&clean.stdout).contains("all finite"));

    let dir = copy_fixture(FIXTURE);
    poison_with_nan(dir.path(), "model.layers.1.mlp.down_proj.weight");
    let model = dir.path().to_str().unwrap();
    let out = ferry(&["info", "--model", model, "--check"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout.contains("model.layers.1.mlp.down_proj.weight: 1 NaN, 0 infinite"),
        "{stdout}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("1 tensors hold NaN or infinite values"));
    let json = ferry(&["info", "--model", model, "--check", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(
        report["non_finite"],
        serde_json::json!([{"tensor": "model.layers.1.mlp.down_proj.weight", "nan": 1, "inf": 0}])
    );

    let out = ferry(&["generate", "--model", model, "--prompt-ids", "1,2", "--max-tokens", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("model.layers.1.mlp.down_proj.weight holds 1 NaN and 0 infinite values"),
        "{stderr}"
    );
}

#[test]
fn every_command_takes_a_hub_repo_id() {
    // A Hugging Face cache holding the fixture as the hub lays it out, used offline.
    let home = tempfile::tempdir().unwrap();
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let repo = home.path().join("hub/models--tiny--qwen3-moe");
    let snapshot = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    for entry in std::fs::read_dir(fixture(FIXTURE)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), snapshot.join(entry.file_name())).unwrap();
    }
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(args)
            .env("HF_HOME", home.path())
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .expect("run ferry");
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let model = ["--model", "tiny/qwen3-moe"];
    assert!(run(&[&["info"][..], &model].concat()).contains("qwen3_moe"));
    let generated = run(&[
        &["generate", "--prompt-ids", "1,2", "--max-tokens", "2", "--json"][..],
        &model,
    ]
    .concat());
    assert!(generated.contains("\"completion_tokens\":2"), "{generated}");
    let bench = [
        "bench",
        "--device",
        "cpu",
        "--prompt-tokens",
        "4",
        "--decode-tokens",
        "1",
        "--concurrency",
        "1",
    ];
    run(&[&bench[..], &model].concat());
}
