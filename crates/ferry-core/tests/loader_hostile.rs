//! The loader on hostile checkpoint directories: an index naming shards outside the directory, a FIFO or a directory
//! in place of any file it reads, tensors stored twice or not where the index says. Each must end in an error naming
//! the entry or file at fault, at once (never a hang), and never a read outside the checkpoint. Also the scan for
//! NaN and infinite weights that `ferry info --check` and loading report.

use std::path::{Path, PathBuf};

use ferry_core::loader::{Checkpoint, NonFinite, WeightStore};

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

/// Replaces the file at `path` by a FIFO; false where mkfifo is not available.
fn replace_with_fifo(path: &Path) -> bool {
    std::fs::remove_file(path).unwrap();
    match std::process::Command::new("mkfifo").arg(path).status() {
        Ok(status) if status.success() => true,
        _ => {
            eprintln!("skipped: mkfifo is not available");
            false
        }
    }
}

/// The error of `open`, which must fail within a few seconds: opening a FIFO blocks until a writer comes, so it runs
/// on a thread that is given up on after a while.
fn fails_at_once(open: impl FnOnce() -> Option<String> + Send + 'static) -> String {
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || sender.send(open()));
    receiver
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("opening a FIFO hangs")
        .expect("the checkpoint opened")
}

#[test]
fn a_fifo_shard_fails_at_once() {
    let dir = copy_fixture();
    let (_, shard) = first_entry(dir.path());
    if !replace_with_fifo(&dir.path().join(&shard)) {
        return;
    }
    let dir_path = dir.path().to_path_buf();
    let message = fails_at_once(move || WeightStore::open(&dir_path).err().map(|e| e.to_string()));
    assert_mentions(&message, &[&shard, "not a regular file"]);
}

#[test]
fn a_fifo_in_place_of_any_file_the_checkpoint_reads_fails_at_once() {
    // chat_template.jinja is read when present, though the fixture has none.
    for name in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        INDEX,
    ] {
        let dir = copy_fixture();
        let path = dir.path().join(name);
        std::fs::write(&path, "").unwrap();
        if !replace_with_fifo(&path) {
            return;
        }
        let dir_path = dir.path().to_path_buf();
        let message = fails_at_once(move || Checkpoint::open(&dir_path).err().map(|e| e.to_string()));
        assert_mentions(&message, &[name, "not a regular file"]);
    }
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

/// Overwrites element `index` of `tensor` (bf16) in its shard of `dir` with `bits`.
fn poke_bf16(dir: &Path, tensor: &str, index: usize, bits: u16) {
    let shard = dir.join(read_index(dir)["weight_map"][tensor].as_str().unwrap());
    let mut bytes = std::fs::read(&shard).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    assert_eq!(header[tensor]["dtype"], "BF16");
    let start = 8 + header_len + header[tensor]["data_offsets"][0].as_u64().unwrap() as usize + 2 * index;
    bytes[start..start + 2].copy_from_slice(&bits.to_le_bytes());
    std::fs::write(&shard, bytes).unwrap();
}

#[test]
fn non_finite_weights_are_counted_by_tensor() {
    let dir = copy_fixture();
    assert_eq!(WeightStore::open(dir.path()).unwrap().non_finite(), vec![]);
    let (nan, inf) = (0x7fc0, 0xff80); // a quiet NaN, -inf
    poke_bf16(dir.path(), "model.norm.weight", 0, nan);
    poke_bf16(dir.path(), "model.norm.weight", 5, nan);
    poke_bf16(dir.path(), "model.embed_tokens.weight", 7, inf);
    poke_bf16(dir.path(), "model.embed_tokens.weight", 8, 0x7f7f); // the largest finite bf16
    let found = WeightStore::open(dir.path()).unwrap().non_finite();
    let expected =
        [("model.embed_tokens.weight", 0, 1), ("model.norm.weight", 2, 0)].map(|(tensor, nan, inf)| NonFinite {
            tensor: tensor.into(),
            nan,
            inf,
        });
    assert_eq!(found, expected);
}
