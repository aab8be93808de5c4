//! `--model` as a Hugging Face repo id: the checkpoint's files are fetched with hf-hub into the standard Hugging
//! Face cache (HF_HOME, else ~/.cache/huggingface/hub), only those ferry reads (config, tokenizer, chat template,
//! generation config, safetensors shards), with a progress bar, resuming partial downloads. With HF_HUB_OFFLINE=1,
//! or when the hub cannot be reached, the cached copy is used, and an error lists what the cache lacks.

use std::path::{Component, Path, PathBuf};

use anyhow::{bail, Context, Result};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo};

const WEIGHT_INDEX: &str = "model.safetensors.index.json";
const SINGLE_WEIGHTS: &str = "model.safetensors";
/// Files read when present; config.json, tokenizer.json and the weights are required.
const OPTIONAL_FILES: [&str; 3] = ["generation_config.json", "tokenizer_config.json", "chat_template.jinja"];

/// Where the hub is, whether to ask it, and the token for gated repos.
pub struct HubAccess {
    pub cache: Cache,
    pub endpoint: Option<String>,
    pub offline: bool,
    /// HF_TOKEN, else the token `huggingface-cli login` saved beside the cache.
    pub token: Option<String>,
}

impl HubAccess {
    pub fn from_env() -> Self {
        let offline = std::env::var("HF_HUB_OFFLINE")
            .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"));
        let cache = Cache::from_env();
        let token = std::env::var("HF_TOKEN")
            .ok()
            .filter(|t| !t.is_empty())
            .or_else(|| cache.token());
        HubAccess {
            cache,
            endpoint: std::env::var("HF_ENDPOINT").ok(),
            offline,
            token,
        }
    }
}

/// Whether `model` names a hub repository (`owner/name`) rather than a local directory.
pub fn is_repo_id(model: &str) -> bool {
    let mut parts = model.split('/');
    let valid = |s: &str| {
        !s.is_empty() && !s.starts_with('.') && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    matches!((parts.next(), parts.next(), parts.next()), (Some(owner), Some(name), None) if valid(owner) && valid(name))
}

/// The checkpoint directory `model` names: a directory as it is; otherwise, when it reads as `owner/name`, that hub
/// repository fetched into the cache (`progress(stage, fraction)` hears each file). Anything else is returned as a
/// path, for opening it to report.
pub fn resolve(model: &str, progress: &mut dyn FnMut(String, f64)) -> Result<PathBuf> {
    if Path::new(model).is_dir() || !is_repo_id(model) {
        return Ok(PathBuf::from(model));
    }
    fetch(model, &HubAccess::from_env(), progress)
        .with_context(|| format!("{model} is not a directory, so it was taken as a Hugging Face repo id"))
}

/// The shard files an index names, each a relative path that stays inside the snapshot: no `..`, no absolute
/// path, no backslash (a separator on some systems), so a hostile index cannot make the download write elsewhere.
fn shards_of(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).with_context(|| index.display().to_string())?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", index.display()))?;
    let map = json["weight_map"]
        .as_object()
        .with_context(|| format!("{}: no weight_map", index.display()))?;
    let mut shards = Vec::with_capacity(map.len());
    for (tensor, shard) in map {
        let shard = shard
            .as_str()
            .with_context(|| format!("{}: entry {tensor:?} is not a file name", index.display()))?;
        let inside = !shard.is_empty()
            && !shard.contains('\\')
            && Path::new(shard).components().all(|c| matches!(c, Component::Normal(_)));
        if !inside {
            bail!(
                "{}: entry {tensor:?} -> {shard:?} would leave the snapshot (an absolute path, `..` or a backslash)",
                index.display()
            );
        }
        shards.push(shard.to_string());
    }
    shards.sort();
    shards.dedup();
    Ok(shards)
}

/// The checkpoint directory (a snapshot in the cache) for `repo_id`. `progress(stage, fraction)` hears about
/// each file.
pub fn fetch(repo_id: &str, access: &HubAccess, progress: &mut dyn FnMut(String, f64)) -> Result<PathBuf> {
    if access.offline {
        return cached(repo_id, &access.cache, "HF_HUB_OFFLINE is set");
    }
    let mut builder = ApiBuilder::from_cache(access.cache.clone())
        .with_progress(true)
        .with_token(access.token.clone());
    if let Some(endpoint) = &access.endpoint {
        builder = builder.with_endpoint(endpoint.clone());
    }
    let api = builder.build().context("cannot set up the Hugging Face hub client")?;
    let repo = api.repo(Repo::model(repo_id.to_string()));
    let listing = match repo.info() {
        Ok(info) => info.siblings.into_iter().map(|s| s.rfilename).collect::<Vec<_>>(),
        Err(e) => {
            tracing::warn!("cannot reach the Hugging Face hub for {repo_id} ({e}); using the cached copy");
            return cached(repo_id, &access.cache, &format!("the hub could not be reached: {e}"));
        }
    };
    let has = |name: &str| listing.iter().any(|f| f == name);
    let mut wanted: Vec<String> = ["config.json", "tokenizer.json"]
        .into_iter()
        .chain(OPTIONAL_FILES.into_iter().filter(|f| has(f)))
        .map(str::to_string)
        .collect();
    if has(WEIGHT_INDEX) {
        let index = repo
            .get(WEIGHT_INDEX)
            .with_context(|| format!("downloading {WEIGHT_INDEX} of {repo_id}"))?;
        wanted.extend(shards_of(&index)?);
    } else if has(SINGLE_WEIGHTS) {
        wanted.push(SINGLE_WEIGHTS.into());
    } else {
        bail!("{repo_id} has no safetensors weights ({SINGLE_WEIGHTS} or {WEIGHT_INDEX})");
    }
    let mut snapshot = None;
    for (i, file) in wanted.iter().enumerate() {
        progress(
            format!("downloading {file} ({}/{})", i + 1, wanted.len()),
            i as f64 / wanted.len() as f64,
        );
        let path = repo
            .get(file)
            .with_context(|| format!("downloading {file} of {repo_id}"))?;
        snapshot = snapshot.or_else(|| path.parent().map(Path::to_path_buf));
    }
    snapshot.context("no files downloaded")
}

/// The cached snapshot of `repo_id`, or an error naming the cache and every missing file.
fn cached(repo_id: &str, cache: &Cache, why_offline: &str) -> Result<PathBuf> {
    let repo = cache.repo(Repo::model(repo_id.to_string()));
    let Some(config) = repo.get("config.json") else {
        bail!(
            "{repo_id} is not in the Hugging Face cache at {} ({why_offline}); download it once with network \
             access, or pass --model with a checkpoint directory",
            cache.path().display()
        );
    };
    let snapshot = config
        .parent()
        .context("cached config.json has no folder")?
        .to_path_buf();
    let mut missing = vec![];
    if repo.get("tokenizer.json").is_none() {
        missing.push("tokenizer.json".to_string());
    }
    match repo.get(WEIGHT_INDEX) {
        Some(index) => missing.extend(shards_of(&index)?.into_iter().filter(|s| repo.get(s).is_none())),
        None if repo.get(SINGLE_WEIGHTS).is_none() => {
            missing.push(format!("{SINGLE_WEIGHTS} (or {WEIGHT_INDEX} and its shards)"))
        }
        None => {}
    }
    if !missing.is_empty() {
        bail!(
            "the cached copy of {repo_id} at {} is incomplete ({why_offline}): missing {}",
            snapshot.display(),
            missing.join(", ")
        );
    }
    Ok(snapshot)
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

    /// A cache laid out as the hub's: models--OWNER--NAME/{refs/main, snapshots/COMMIT/...}, holding the
    /// qwen3_moe fixture.
    fn fake_cache(root: &Path) -> PathBuf {
        let repo = root.join("models--tiny--qwen3-moe");
        let snapshot = repo.join("snapshots").join(COMMIT);
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), COMMIT).unwrap();
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe");
        for entry in std::fs::read_dir(fixture).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), snapshot.join(entry.file_name())).unwrap();
        }
        snapshot
    }

    fn access(root: &Path, offline: bool) -> HubAccess {
        HubAccess {
            cache: Cache::new(root.to_path_buf()),
            // Nothing listens there: the hub is unreachable, as in CI.
            endpoint: Some("http://127.0.0.1:9".into()),
            offline,
            token: None,
        }
    }

    #[test]
    fn repo_ids_and_paths_are_told_apart() {
        assert!(is_repo_id("Qwen/Qwen3-30B-A3B"));
        assert!(is_repo_id("allenai/OLMoE-1B-7B-0924"));
        for not_id in ["tests/fixtures/qwen3_moe", "/abs/path", "./x/y", "name", "a/b/", "../x"] {
            assert!(!is_repo_id(not_id), "{not_id}");
        }
    }

    #[test]
    fn index_entries_that_would_leave_the_snapshot_are_refused() {
        let root = tempfile::tempdir().unwrap();
        let snapshot = fake_cache(root.path());
        let index_path = snapshot.join(WEIGHT_INDEX);
        let index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
        for shard in [
            "../../outside.safetensors",
            "/etc/passwd",
            "..\\x.safetensors",
            "a/../../b",
            "",
        ] {
            let mut hostile = index.clone();
            hostile["weight_map"]["model.norm.weight"] = shard.into();
            std::fs::write(&index_path, hostile.to_string()).unwrap();
            let err = fetch("tiny/qwen3-moe", &access(root.path(), true), &mut |_, _| {}).unwrap_err();
            let message = err.to_string();
            assert!(message.contains("would leave the snapshot"), "{shard}: {message}");
            assert!(message.contains("model.norm.weight"), "{shard}: {message}");
        }
    }

    #[test]
    fn offline_uses_the_cached_snapshot() {
        let root = tempfile::tempdir().unwrap();
        let snapshot = fake_cache(root.path());
        let dir = fetch("tiny/qwen3-moe", &access(root.path(), true), &mut |_, _| {}).unwrap();
        assert_eq!(dir, snapshot);
        ferry_core::loader::Checkpoint::open(&dir).unwrap();
    }

    #[test]
    fn an_unreachable_hub_falls_back_to_the_cache() {
        let root = tempfile::tempdir().unwrap();
        let snapshot = fake_cache(root.path());
        let dir = fetch("tiny/qwen3-moe", &access(root.path(), false), &mut |_, _| {}).unwrap();
        assert_eq!(dir, snapshot);
    }

    #[test]
    fn a_missing_or_incomplete_cache_says_what_is_missing() {
        let root = tempfile::tempdir().unwrap();
        let err = fetch("tiny/absent", &access(root.path(), true), &mut |_, _| {}).unwrap_err();
        let message = err.to_string();
        assert!(
            message.contains("tiny/absent is not in the Hugging Face cache"),
            "{message}"
        );
        assert!(message.contains("HF_HUB_OFFLINE"), "{message}");

        let snapshot = fake_cache(root.path());
        std::fs::remove_file(snapshot.join("model-00002-of-00003.safetensors")).unwrap();
        std::fs::remove_file(snapshot.join("tokenizer.json")).unwrap();
        let err = fetch("tiny/qwen3-moe", &access(root.path(), false), &mut |_, _| {}).unwrap_err();
        let message = err.to_string();
        assert!(message.contains("incomplete"), "{message}");
        assert!(
            message.contains("tokenizer.json, model-00002-of-00003.safetensors"),
            "{message}"
        );
        assert!(message.contains("could not be reached"), "{message}");
    }
}
