//! CUDA graphs of decode steps on the GPU (ignored unless asked for: scripts/device/gpu-tests.sh runs them on the
//! GPU machine).
//!
//! A replayed step runs the kernels the eager step launches, with the same launch shapes (attention's splits are
//! sized by the batch's key span on both paths), over inputs uploaded into persistent buffers: its logits must
//! equal the eager path's bit for bit, at every row count a graph serves, while the batch shrinks, and across a
//! key span boundary (a new graph captured as the sequences grow).

use std::path::{Path, PathBuf};

use ferry_core::backend::cuda::CudaBackend;
use ferry_core::backend::{Backend, SeqSlice};
use ferry_core::engine::{argmax, Executor, ModelExecutor};
use ferry_core::kv::SeqId;
use ferry_core::loader::Checkpoint;
use ferry_core::model::Model;

fn fixtures() -> PathBuf {
    match std::env::var_os("FERRY_FIXTURES") {
        Some(dir) => dir.into(),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
}

/// Prompt tokens of sequence `i` (sequences differ in content and length, so their rows sit at other positions).
fn prompt(i: usize, len: usize, vocab: usize) -> Vec<u32> {
    (0..len + 3 * i)
        .map(|t| ((t * 7 + i * 13 + 1) % vocab) as u32)
        .collect()
}

/// Every decode step's logits of `seqs` sequences decoded greedily together for `steps` steps after prompts of
/// about `prompt_len` tokens (the last sequence leaves the batch halfway), with CUDA graphs on or off; and how many
/// steps the backend captured.
fn decode(family: &str, graphs: bool, seqs: usize, prompt_len: usize, steps: usize) -> (Vec<Vec<f32>>, usize) {
    let backend = CudaBackend::builder(0).unwrap().cuda_graphs(graphs).build().unwrap();
    let checkpoint = Checkpoint::open(&fixtures().join(family)).unwrap();
    let model = Model::load(&backend, &checkpoint).unwrap();
    let kv = backend
        .new_kv(model.kv_spec(seqs * (prompt_len + 3 * seqs + steps)))
        .unwrap();
    let mut executor = ModelExecutor::<CudaBackend, &CudaBackend>::new(&backend, model, kv);
    let vocab = executor.vocab_size();
    let ids: Vec<SeqId> = (0..seqs).map(|_| executor.kv_mut().alloc_seq()).collect();
    let mut next = Vec::new();
    let mut lens = Vec::new();
    for (i, &seq) in ids.iter().enumerate() {
        let tokens = prompt(i, prompt_len, vocab);
        let slice = SeqSlice {
            seq,
            start_pos: 0,
            len: tokens.len(),
        };
        next.push(argmax(&executor.forward(&tokens, &[slice]).unwrap()) as u32);
        lens.push(tokens.len());
    }
    let mut all = Vec::new();
    for step in 0..steps {
        let running = if seqs > 1 && step >= steps / 2 { seqs - 1 } else { seqs };
        let batch: Vec<SeqSlice> = (0..running)
            .map(|i| SeqSlice {
                seq: ids[i],
                start_pos: lens[i],
                len: 1,
            })
            .collect();
        let logits = executor.forward(&next[..running], &batch).unwrap();
        for i in 0..running {
            next[i] = argmax(&logits[i * vocab..(i + 1) * vocab]) as u32;
            lens[i] += 1;
        }
        all.push(logits);
    }
    drop(executor);
    (all, backend.captured_steps())
}

fn check_graphs_equal_eager(family: &str, seqs: usize, prompt_len: usize, steps: usize) {
    let (eager, none) = decode(family, false, seqs, prompt_len, steps);
    assert_eq!(none, 0, "{family}: graphs off captured steps");
    let (graphed, captured) = decode(family, true, seqs, prompt_len, steps);
    assert!(captured > 0, "{family}: no step was captured");
    for (step, (a, b)) in eager.iter().zip(&graphed).enumerate() {
        let differing = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        assert_eq!(
            differing, 0,
            "{family}, {seqs} sequences: step {step}'s logits differ in {differing} values"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn graphs_give_the_eager_logits_at_every_row_count() {
    for seqs in 1..=8 {
        check_graphs_equal_eager("qwen3_moe", seqs, 5, 6);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn graphs_give_the_eager_logits_across_a_key_span() {
    // Prompts of 250 and 253 tokens decoded for 12 steps cross 256 keys, where the key span (and so attention's
    // splits and the graph) changes; the KV blocks grow along the way.
    check_graphs_equal_eager("qwen3_moe", 2, 250, 12);
    check_graphs_equal_eager("deepseek_v3", 1, 250, 12);
    check_graphs_equal_eager("mixtral", 3, 20, 6);
}
