//! `ferry bench` and routing traces end to end on the bundled fixture: speeds and the bound on the CPU, each routing
//! trace measured on one load (with next-layer guesses when asked), and a recorded trace replayed by `ferry
//! cache-sim`.

mod common;

use std::path::Path;

use common::{ferry, fixture, FIXTURE};

#[test]
fn bench_on_the_cpu_reports_speeds_and_the_bound() {
    let model = fixture(FIXTURE);
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("bench.json");
    let out = ferry(&[
        "bench",
        "--model",
        model.to_str().unwrap(),
        "--device",
        "cpu",
        "--prompt-tokens",
        "40",
        "--decode-tokens",
        "3",
        "--concurrency",
        "2",
        "--long-prompt-tokens",
        "70",
        "--max-batch-tokens",
        "32",
        "--output",
        output.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&output).unwrap()).unwrap();
    assert_eq!(report["long_prefill"]["prompt_tokens"], 70, "{report}");
    // Both prompts prefilled in chunks of the asked step.
    assert_eq!(report["step_tokens"], 32, "{report}");
    assert!(
        report["long_prefill"]["ttft_seconds"].as_f64().unwrap() > 0.0,
        "{report}"
    );
    for field in [
        "prefill_tok_s",
        "ttft_seconds",
        "decode_tok_s_batch1",
        "decode_tok_s_aggregate",
        "decode_bound_tok_s",
    ] {
        assert!(report[field].as_f64().unwrap() > 0.0, "{field} in {report}");
    }
    // A token's time: issuing its step, waiting for it, and the scheduling around it.
    let issue = report["decode_host_seconds_per_token"].as_f64().unwrap();
    let wait = report["decode_wait_seconds_per_token"].as_f64().unwrap();
    let token = 1.0 / report["decode_tok_s_batch1"].as_f64().unwrap();
    assert!(issue > 0.0 && wait >= 0.0 && issue + wait <= token, "{report}");
    // One token reads the dense weights plus top-k experts per MoE layer, in bf16.
    let info = &report["model_info"];
    assert_eq!(
        report["bytes_per_token"],
        info["params_active_per_token"].as_u64().unwrap() * 2
    );
    assert!(report["peak_gpu_memory_bytes"].is_null());
}

/// Records the fixture's routing for the prompt `ids` into `trace`.
fn record_routing(ids: &str, trace: &Path) {
    let model = fixture(FIXTURE);
    let out = ferry(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        ids,
        "--max-tokens",
        "4",
        "--ignore-eos",
        "--device",
        "cpu",
        "--record-routing",
        trace.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn bench_measures_each_routing_trace_on_one_load() {
    let model = fixture(FIXTURE);
    let dir = tempfile::tempdir().unwrap();
    let (near, far) = (dir.path().join("near.jsonl"), dir.path().join("far.jsonl"));
    record_routing("1,2,3,4,5", &near);
    record_routing("90,80,70", &far);
    let output = dir.path().join("bench.json");
    let bench = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "--model",
            model.to_str().unwrap(),
            "--device",
            "cpu",
            "--prompt-tokens",
            "20",
            "--decode-tokens",
            "3",
            "--concurrency",
            "2",
            "--routing-trace",
            near.to_str().unwrap(),
            "--routing-trace",
            far.to_str().unwrap(),
            "--output",
            output.to_str().unwrap(),
        ];
        args.extend(extra);
        ferry(&args)
    };
    let out = bench(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        stderr.matches("loaded qwen3_moe").count(),
        1,
        "one load for both traces: {stderr}"
    );
    for trace in [&near, &far] {
        let stem = trace.file_stem().unwrap().to_str().unwrap();
        let path = dir.path().join(format!("bench-{stem}.json"));
        let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(
            report["routing"],
            format!("replayed from {}", trace.display()),
            "{report}"
        );
        assert!(report["decode_tok_s_batch1"].as_f64().unwrap() > 0.0, "{report}");
    }
    assert!(!output.exists(), "with two traces each report is named after its trace");
    // The CPU has no misses to split: a strategy other than offload is refused, whichever variant names it.
    let out = bench(&["--moe-strategy", "offload,hybrid"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("--moe-strategy Hybrid needs a GPU"), "{stderr}");
    // Next layers guessed from the trace (for the GPU offload's prefetch; the CPU asks for none): the report says
    // how well, and a precision outside 0 to 1 is refused cleanly.
    let out = bench(&["--routing-guess-precision", "0.9"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("bench-near.json")).unwrap()).unwrap();
    assert_eq!(
        report["routing"],
        format!("replayed from {}, each next layer guessed 90 % right", near.display())
    );
    let out = bench(&["--routing-guess-precision", "1.5"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("guess precision of 1.5"), "{stderr}");
}

#[test]
fn recorded_routing_replays_in_the_cache_simulator() {
    let model = fixture(FIXTURE);
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("routing.jsonl");
    let out = ferry(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3,4,5",
        "--max-tokens",
        "4",
        "--ignore-eos",
        "--device",
        "cpu",
        "--json",
        "--record-routing",
        trace.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&trace).unwrap();
    let header: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(header["top_k"], 2);
    // One line per forwarded token: the 5 prompt tokens and the 3 generated tokens fed back.
    assert_eq!(text.lines().count(), 1 + 5 + 3);
    let sim = ferry(&[
        "cache-sim",
        "--trace",
        trace.to_str().unwrap(),
        "--slots",
        "8",
        "--policy",
        "lru",
        "--json",
    ]);
    assert!(sim.status.success(), "{}", String::from_utf8_lossy(&sim.stderr));
    let report: serde_json::Value = serde_json::from_slice(&sim.stdout).unwrap();
    let layers = header["num_layers"].as_u64().unwrap();
    // Belady's row, then LRU's.
    assert_eq!(report["results"][1]["accesses"].as_u64().unwrap(), 8 * layers * 2);
}
