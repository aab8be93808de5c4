//! `ferry cache-sim` end to end: the JSON summary of a small trace computed by hand, and bad input, which must end
//! in a non-zero exit with a message naming the file and line at fault, never a panic.

use std::path::Path;
use std::process::{Command, Output};

fn ferry(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .output()
        .expect("run ferry")
}

fn cache_sim(trace: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["cache-sim", "--trace", trace.to_str().unwrap()];
    args.extend_from_slice(extra);
    ferry(&args)
}

/// Writes `text` as a trace file in a fresh directory.
fn trace_file(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.jsonl");
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

fn expect_clean_failure(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "ferry cache-sim succeeded on bad input");
    assert!(!stderr.contains("panicked"), "ferry panicked:\n{stderr}");
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "the error does not mention {needle:?}:\n{stderr}"
        );
    }
}

/// Two MoE layers, top-2; per layer the same experts in both tokens, so keys (0,0) (0,1) (1,2) (1,3) repeat.
const TRACE: &str = "{\"num_layers\": 2, \"num_experts\": 4, \"top_k\": 2}\n[[0, 1], [2, 3]]\n[[0, 1], [2, 3]]\n";

#[test]
fn json_summary_of_a_trace_computed_by_hand() {
    let (_dir, path) = trace_file(TRACE);
    // 3 slots, a cycle of 4 keys: LRU evicts each key just before its reuse.
    let out = cache_sim(&path, &["--slots", "3", "--policy", "lru", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lru: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(lru["policy"], "lru");
    assert_eq!(lru["slots"], 3);
    assert_eq!(lru["accesses"], 8);
    assert_eq!(lru["hits"], 0);
    assert_eq!(lru["misses"], 8);
    assert_eq!(lru["hit_rate"], 0.0);
    // Belady evicts (1,2) at the fourth access, then (0,0) and (0,1) hit, (1,2) misses, (1,3) hits.
    let out = cache_sim(&path, &["--slots", "3", "--policy", "belady", "--json"]);
    let belady: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(belady["hits"], 3);
    assert_eq!(belady["hit_rate"], 3.0 / 8.0);
    assert_eq!(belady["layers"][0]["hit_rate"], 0.5);
    assert_eq!(belady["layers"][1]["hits"], 1);
    assert_eq!(belady["layers"][1]["misses"], 3);
}

#[test]
fn the_table_names_the_hit_rate() {
    let (_dir, path) = trace_file(TRACE);
    let out = cache_sim(&path, &["--slots", "4"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("hit rate  50.00%"), "{stdout}");
    assert!(stdout.contains("lru"), "{stdout}");
}

#[test]
fn bad_input_fails_cleanly() {
    let missing = Path::new("/nonexistent/trace.jsonl");
    expect_clean_failure(&cache_sim(missing, &["--slots", "4"]), &["/nonexistent/trace.jsonl"]);

    let (_dir, path) = trace_file(&format!("{TRACE}[[0, 1], [2, 9]]\n"));
    expect_clean_failure(
        &cache_sim(&path, &["--slots", "4"]),
        &["trace.jsonl", "line 4", "expert 9"],
    );

    let (_dir, path) = trace_file(&format!("{TRACE}[[0, 1], [2, 3\n"));
    expect_clean_failure(&cache_sim(&path, &["--slots", "4", "--json"]), &["line 4"]);

    let (_dir, path) = trace_file("{\"num_layers\": 2, \"num_experts\": 4, \"top_k\": 2}\n");
    expect_clean_failure(&cache_sim(&path, &["--slots", "4"]), &["no tokens"]);

    let (_dir, path) = trace_file(TRACE);
    expect_clean_failure(&cache_sim(&path, &["--slots", "0"]), &["--slots"]);
    expect_clean_failure(&cache_sim(&path, &["--slots", "4", "--policy", "fifo"]), &["fifo"]);
}
