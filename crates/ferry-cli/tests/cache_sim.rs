//! `ferry cache-sim` end to end: the JSON summary of a small trace computed by hand; on traces that
//! bench/uniform_trace.py and bench/locality_trace.py generate, the default policy never misses more than LRU and
//! Belady never more than any; the locality generator's calibration; and bad input, which must end in a non-zero
//! exit with a message naming the file and line at fault, never a panic.

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

/// The JSON summary of a run that succeeded.
fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn json_summary_of_a_trace_computed_by_hand() {
    let (_dir, path) = trace_file(TRACE);
    // 3 slots, a cycle of 4 keys: LRU evicts each key just before its reuse.
    let summary = json(&cache_sim(&path, &["--slots", "3", "--policy", "lru", "--json"]));
    assert_eq!(summary["tokens"], 2);
    let [belady, lru] = summary["results"].as_array().unwrap().as_slice() else {
        panic!("not Belady and LRU: {summary}");
    };
    assert_eq!(lru["policy"], "lru");
    assert_eq!(lru["default"], false);
    assert_eq!(lru["slots"], 3);
    assert_eq!(lru["accesses"], 8);
    assert_eq!(lru["hits"], 0);
    assert_eq!(lru["misses"], 8);
    assert_eq!(lru["hit_rate"], 0.0);
    assert_eq!(lru["regret"], 3);
    assert_eq!(lru["miss_ratio"], 8.0 / 5.0);
    // Belady evicts (1,2) at the fourth access, then (0,0) and (0,1) hit, (1,2) misses, (1,3) hits.
    assert_eq!(belady["policy"], "belady");
    assert_eq!(belady["regret"], 0);
    assert_eq!(belady["hits"], 3);
    assert_eq!(belady["hit_rate"], 3.0 / 8.0);
    assert_eq!(belady["layers"][0]["hit_rate"], 0.5);
    assert_eq!(belady["layers"][1]["hits"], 1);
    assert_eq!(belady["layers"][1]["misses"], 3);
}

#[test]
fn the_table_names_the_default_and_every_policy() {
    let (_dir, path) = trace_file(TRACE);
    let out = cache_sim(&path, &["--slots", "4", "--policy", "default"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    // 4 slots hold every key: only the first token misses, under any policy.
    let default = stdout.lines().find(|line| line.contains("lrfu+prefill (default)"));
    assert!(default.is_some_and(|line| line.contains("50.00%")), "{stdout}");
    assert!(stdout.contains("belady"), "{stdout}");
    let summary = json(&cache_sim(&path, &["--slots", "4,2", "--json"]));
    let names: Vec<&str> = summary["results"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|row| row["slots"] == 2)
        .map(|row| row["policy"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "belady",
            "lru",
            "lru+floors",
            "lru+prefill",
            "lrfu",
            "lrfu+floors",
            "lrfu+prefill"
        ]
    );
}

/// Runs `bench/SCRIPT` with `args` (python3, as CI has it).
fn bench_script(script: &str, args: &[&str]) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench").join(script);
    let out = Command::new("python3")
        .arg(&path)
        .args(args)
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn q30_config() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../bench/q30.json")
        .to_str()
        .unwrap()
        .to_owned()
}

#[test]
fn the_default_never_misses_more_than_lru_and_belady_never_more_than_any() {
    let dir = tempfile::tempdir().unwrap();
    let config = q30_config();
    // 6144 experts in all: 6 % to 50 % of them; on the locality trace also with a prompt's prefill every 100 tokens.
    for (script, prefill) in [
        ("uniform_trace.py", None),
        ("locality_trace.py", None),
        ("locality_trace.py", Some("100")),
    ] {
        let trace = dir.path().join(format!("{script}.jsonl"));
        let trace = trace.to_str().unwrap();
        bench_script(
            script,
            &["--config", &config, "--tokens", "300", "--seed", "1", "--out", trace],
        );
        let mut args = vec!["--trace", trace, "--slots", "384,1536,3072", "--json"];
        args.extend(prefill.iter().flat_map(|every| ["--prefill-every", every]));
        let summary = json(&ferry(&[&["cache-sim"], &args[..]].concat()));
        for slots in [384, 1536, 3072] {
            let rows: Vec<&serde_json::Value> = summary["results"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|row| row["slots"] == slots)
                .collect();
            let misses = |name: &str| rows.iter().find(|r| r["policy"] == name).unwrap()["misses"].as_u64();
            let default = rows.iter().find(|r| r["default"] == true).unwrap();
            let at = format!("{script}, {slots} slots, prefill every {prefill:?}");
            assert!(
                default["misses"].as_u64() <= misses("lru"),
                "{at}: {default} vs LRU {:?}",
                misses("lru")
            );
            for row in &rows {
                assert!(row["regret"].as_u64().is_some(), "{at}: {row}");
                assert!(row["misses"].as_u64() >= misses("belady"), "{at}: {row}");
            }
        }
    }
}

#[test]
fn the_locality_trace_follows_the_published_lru_curve() {
    let report = bench_script(
        "locality_trace.py",
        &["--config", &q30_config(), "--tokens", "2048", "--calibrate"],
    );
    // Rows: share, slots, mean LRU hit rate, (range), target; each mean within 5 points of its target.
    let rows: Vec<Vec<&str>> = report
        .lines()
        .filter(|line| line.contains('%') && line.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .map(|line| line.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 4, "{report}");
    let percent = |s: &str| s.trim_end_matches('%').parse::<f64>().unwrap();
    for row in rows {
        let (mean, target) = (percent(row[2]), percent(row[row.len() - 1]));
        assert!((mean - target).abs() <= 5.0, "{row:?}\n{report}");
    }
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
    expect_clean_failure(&cache_sim(&path, &["--slots", "4", "--policy", "lru+fast"]), &["fast"]);
    expect_clean_failure(&cache_sim(&path, &["--slots", "4,0"]), &["--slots"]);
}
