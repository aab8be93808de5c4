//! The weight loader on hostile checkpoint directories: an index naming shards outside the directory, shards that
//! are not regular files, tensors stored twice or not where the index says. Each must end in an error naming the
//! entry or file at fault, at once (never a hang), and never a read outside the checkpoint.

use std::path::{Path, PathBuf};

use ferry_core::loader::WeightStore;

const INDEX: &str = "model.safetensors.index.json";

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe")
}

/// A private copy of the sharded fixture, laid out under `dir`.
fn copy_fixture_to(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for entry in std::fs::read_dir(fixture()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
}

fn copy_fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    copy_fixture_to(dir.path());
    dir
}

fn read_index(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX)).unwrap()).unwrap()
}

fn write_index(dir: &Path, index: &serde_json::Value) {
    std::fs::write(dir.join(INDEX), serde_json::to_string_pretty(index).unwrap()).unwrap();
}

/// The first tensor the index lists (by name) and the shard it puts it in.
fn first_entry(dir: &Path) -> (String, String) {
    let index = read_index(dir);
    let (tensor, shard) = index["weight_map"].as_object().unwrap().iter().next().unwrap();
    (tensor.clone(), shard.as_str().unwrap().to_string())
}

/// Points the index's first entry at `shard`.
fn redirect_first_entry(dir: &Path, shard: &str) -> String {
    let (tensor, _) = first_entry(dir);
    let mut index = read_index(dir);
    index["weight_map"][&tensor] = shard.into();
    write_index(dir, &index);
    tensor
}

/// Opens the weights of `dir`, which must fail; the message is returned.
fn open_error(dir: &Path) -> String {
    match WeightStore::open(dir) {
        Ok(_) => panic!("{} opened", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_mentions(message: &str, needles: &[&str]) {
    for needle in needles {
        assert!(message.contains(needle), "{message:?} does not mention {needle:?}");
    }
}

#[test]
fn the_fixture_opens() {
    let dir = copy_fixture();
    WeightStore::open(dir.path()).unwrap();
}

#[test]
fn a_shard_path_climbing_out_of_the_directory_is_refused() {
    let dir = copy_fixture();
    // A real shard beside the checkpoint, so only the path check can stop it.
    let outside = tempfile::tempdir_in(dir.path().parent().unwrap()).unwrap();
    let (_, shard) = first_entry(dir.path());
    std::fs::copy(dir.path().join(&shard), outside.path().join("stolen.safetensors")).unwrap();
    let climb = format!(
        "../{}/stolen.safetensors",
        outside.path().file_name().unwrap().to_str().unwrap()
    );
    for shard in ["../../etc/passwd", "/etc/passwd", climb.as_str()] {
        let tensor = redirect_first_entry(dir.path(), shard);
        let message = open_error(dir.path());
        assert_mentions(&message, &[&tensor, shard, "outside the checkpoint directory"]);
    }
}

#[test]
fn a_symlinked_shard_leading_outside_is_refused() {
    let dir = copy_fixture();
    let outside = tempfile::tempdir().unwrap();
    let (tensor, shard) = first_entry(dir.path());
    let moved = outside.path().join(&shard);
    std::fs::rename(dir.path().join(&shard), &moved).unwrap();
    std::os::unix::fs::symlink(&moved, dir.path().join(&shard)).unwrap();
    let message = open_error(dir.path());
    assert_mentions(&message, &[&tensor, &shard, "outside the checkpoint directory"]);
}

#[test]
fn symlinks_inside_the_directory_or_into_a_hub_cache_blob_store_are_followed() {
    // A Hugging Face cache snapshot: models--X/snapshots/REV/FILE -> ../../blobs/HASH.
    let root = tempfile::tempdir().unwrap();
    let snapshot = root.path().join("models--tiny--qwen3-moe/snapshots/0123abcd");
    let blobs = root.path().join("models--tiny--qwen3-moe/blobs");
    copy_fixture_to(&snapshot);
    std::fs::create_dir_all(&blobs).unwrap();
    let (_, first) = first_entry(&snapshot);
    std::fs::rename(snapshot.join(&first), blobs.join("blob-of-the-first-shard")).unwrap();
    std::os::unix::fs::symlink("../../blobs/blob-of-the-first-shard", snapshot.join(&first)).unwrap();
    // And one shard reached through a link inside the snapshot.
    let other = shards(&snapshot).into_iter().find(|s| *s != first).unwrap();
    std::fs::create_dir(snapshot.join("stored")).unwrap();
    std::fs::rename(snapshot.join(&other), snapshot.join("stored").join(&other)).unwrap();
    std::os::unix::fs::symlink(Path::new("stored").join(&other), snapshot.join(&other)).unwrap();
    WeightStore::open(&snapshot).unwrap();
}

#[test]
fn a_missing_shard_is_named() {
    let dir = copy_fixture();
    let (_, shard) = first_entry(dir.path());
    std::fs::remove_file(dir.path().join(&shard)).unwrap();
    assert_mentions(&open_error(dir.path()), &[&shard]);
}

#[test]
fn a_fifo_shard_fails_at_once() {
    let dir = copy_fixture();
    let (_, shard) = first_entry(dir.path());
    let path = dir.path().join(&shard);
    std::fs::remove_file(&path).unwrap();
    match std::process::Command::new("mkfifo").arg(&path).status() {
        Ok(status) if status.success() => {}
        _ => {
            eprintln!("skipped: mkfifo is not available");
            return;
        }
    }
    // Opening a FIFO blocks until a writer comes: run the open on a thread and give up on it after a while.
    let (sender, receiver) = std::sync::mpsc::channel();
    let dir_path = dir.path().to_path_buf();
    std::thread::spawn(move || sender.send(open_error(&dir_path)));
    let message = receiver
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("opening a FIFO shard hangs");
    assert_mentions(&message, &[&shard, "not a regular file"]);
}

#[test]
fn a_directory_shard_is_named() {
    let dir = copy_fixture();
    let (_, shard) = first_entry(dir.path());
    std::fs::remove_file(dir.path().join(&shard)).unwrap();
    std::fs::create_dir(dir.path().join(&shard)).unwrap();
    assert_mentions(&open_error(dir.path()), &[&shard, "is a directory"]);
}

#[test]
fn a_directory_named_like_the_single_weights_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("model.safetensors")).unwrap();
    assert_mentions(&open_error(dir.path()), &["model.safetensors", "is a directory"]);
}

/// Adds a copy of `tensor`, stored in shard `from` of `dir`, to shard `to`.
fn copy_tensor(dir: &Path, tensor: &str, from: &str, to: &str) {
    let source = std::fs::read(dir.join(from)).unwrap();
    let target = std::fs::read(dir.join(to)).unwrap();
    let source = safetensors::SafeTensors::deserialize(&source).unwrap();
    let target = safetensors::SafeTensors::deserialize(&target).unwrap();
    let mut views = target.tensors();
    views.push((tensor.to_string(), source.tensor(tensor).unwrap()));
    let bytes = safetensors::serialize(views, None).unwrap();
    std::fs::write(dir.join(to), bytes).unwrap();
}

fn shards(dir: &Path) -> Vec<String> {
    let index = read_index(dir);
    let mut shards: Vec<String> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    shards.sort();
    shards.dedup();
    shards
}

#[test]
fn a_tensor_stored_in_two_shards_is_refused() {
    let dir = copy_fixture();
    let shards = shards(dir.path());
    let (tensor, first) = first_entry(dir.path());
    let second = shards.iter().find(|s| **s != first).unwrap();
    copy_tensor(dir.path(), &tensor, &first, second);
    assert_mentions(&open_error(dir.path()), &[&tensor, &first, second]);
}

#[test]
fn a_tensor_its_listed_shard_does_not_hold_is_refused() {
    let dir = copy_fixture();
    let shards = shards(dir.path());
    let (tensor, stored_in) = first_entry(dir.path());
    let listed_in = shards.iter().find(|s| **s != stored_in).unwrap();
    redirect_first_entry(dir.path(), listed_in);
    assert_mentions(&open_error(dir.path()), &[&tensor, listed_in, &stored_in]);
}

#[test]
fn a_tensor_listed_in_no_shard_that_holds_it_is_refused() {
    let dir = copy_fixture();
    let mut index = read_index(dir.path());
    let (_, shard) = first_entry(dir.path());
    index["weight_map"]["model.layers.99.nowhere.weight"] = shard.clone().into();
    write_index(dir.path(), &index);
    assert_mentions(&open_error(dir.path()), &["model.layers.99.nowhere.weight", &shard]);
}
