//! Memory-mapped safetensors: one file or shards named by `model.safetensors.index.json`, opened into the
//! [`WeightStore`] of a checkpoint's tensors by name (or seeded synthetic weights).
//!
//! Tensors are never copied here: a [`TensorRef`] (`tensor.rs`) is a shared handle on the mapped shard plus a byte
//! range, so a loaded model holds one copy of its weights (the page cache's) whatever the backend does with them
//! later.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use serde::Deserialize;

use super::fp8::{f32_to_fp8_e4m3, quantize_fp8, Fp8Config, Fp8Layout, Fp8Scheme, FP8_E4M3_MAX};
use super::{read_text, regular_file};
use crate::{Error, Result};

mod scales;
mod tensor;

pub use scales::Fp8Scales;
use tensor::Storage;
pub use tensor::{DType, TensorRef};

/// A stored tensor with values that are not finite.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct NonFinite {
    pub tensor: String,
    pub nan: u64,
    pub inf: u64,
}

/// Every tensor of a checkpoint, by name, across its shards; or, for benchmarks at full size without files,
/// seeded random weights made when asked for.
pub struct WeightStore {
    tensors: HashMap<String, TensorRef>,
    /// Where the text model's `model.*` weights live: `model.` or, in multimodal checkpoints,
    /// `model.language_model.`.
    text_prefix: &'static str,
    synthetic_seed: Option<u64>,
    /// Routed experts stored unquantized are quantized to FP8 in this scheme as they are read
    /// ([`WeightStore::quantize_experts`]).
    quantize_experts: Option<Fp8Scheme>,
    /// Dense linear weights stored unquantized are quantized to FP8 as they are read, where this configuration
    /// does not keep them unquantized ([`WeightStore::quantize_dense_linears`]).
    quantize_dense: Option<Fp8Config>,
}

/// The name endings of the dense linear weights an FP8 checkpoint stores in FP8 (attention projections, latent
/// attention's low-rank ones, dense MLPs and shared experts): outside `.experts.`, the weights the model reads
/// in either format. Embeddings, the output head, routers and norms stay unquantized.
const DENSE_LINEARS: [&str; 11] = [
    ".q_proj.weight",
    ".k_proj.weight",
    ".v_proj.weight",
    ".o_proj.weight",
    ".q_a_proj.weight",
    ".q_b_proj.weight",
    ".kv_a_proj_with_mqa.weight",
    ".kv_b_proj.weight",
    ".gate_proj.weight",
    ".up_proj.weight",
    ".down_proj.weight",
];

/// Whether tensor `name` is a dense linear weight (see [`DENSE_LINEARS`]).
fn is_dense_linear(name: &str) -> bool {
    !name.contains(".experts.") && DENSE_LINEARS.iter().any(|end| name.ends_with(end))
}

const SHARD_INDEX: &str = "model.safetensors.index.json";
const SINGLE_WEIGHTS: &str = "model.safetensors";

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

impl WeightStore {
    /// Maps `model.safetensors`, or every shard listed in `model.safetensors.index.json`. A hostile directory is
    /// refused, never followed: an index naming a shard outside the directory, a shard that is not a regular file,
    /// a tensor stored in two shards or not in the shard the index names.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join(SHARD_INDEX);
        let index = if index_path.exists() {
            let text = read_text(&index_path)?;
            let index: ShardIndex = serde_json::from_str(&text)
                .map_err(|e| Error::file(&index_path, format!("invalid shard index: {e}")))?;
            Some(index.weight_map)
        } else if dir.join(SINGLE_WEIGHTS).exists() {
            None
        } else {
            return Err(Error::file(
                dir,
                format!("no {SINGLE_WEIGHTS} or {SHARD_INDEX} in the checkpoint directory"),
            ));
        };
        // Each shard with the first index entry that names it, which the errors about the shard quote.
        let mut shards: BTreeMap<&str, Option<&str>> = BTreeMap::new();
        match &index {
            Some(weight_map) => {
                for (tensor, shard) in weight_map {
                    shards.entry(shard).or_insert(Some(tensor));
                }
            }
            None => {
                shards.insert(SINGLE_WEIGHTS, None);
            }
        }

        let inside = Confinement::of(dir)?;
        let mut tensors = HashMap::new();
        let mut stored_in: HashMap<String, &str> = HashMap::new();
        for (&shard, &entry) in &shards {
            if let Some(tensor) = entry {
                inside
                    .check(shard)
                    .map_err(|why| Error::file(&index_path, format!("entry {tensor:?} -> {shard:?}: {why}")))?;
            }
            for t in map_shard(&dir.join(shard))? {
                if let Some(first) = stored_in.insert(t.name.clone(), shard) {
                    return Err(Error::tensor(
                        &t.name,
                        format!("stored twice, in {first} and in {shard}"),
                    ));
                }
                tensors.insert(t.name.clone(), t);
            }
        }
        for (tensor, listed_in) in index.iter().flatten() {
            match stored_in.get(tensor.as_str()) {
                Some(&shard) if shard == listed_in => {}
                Some(&shard) => {
                    return Err(Error::tensor(
                        tensor,
                        format!("{SHARD_INDEX} puts it in {listed_in}, but it is stored in {shard}"),
                    ))
                }
                None => {
                    return Err(Error::tensor(
                        tensor,
                        format!("{SHARD_INDEX} puts it in {listed_in}, which does not hold it"),
                    ))
                }
            }
        }
        let text_prefix = if tensors.keys().any(|k| k.starts_with("model.language_model.")) {
            "model.language_model."
        } else {
            "model."
        };
        Ok(WeightStore {
            tensors,
            text_prefix,
            synthetic_seed: None,
            quantize_experts: None,
            quantize_dense: None,
        })
    }

    /// Attaches to every FP8 tensor its scales as `fp8` names them (the scale tensors leave the store). An FP8
    /// tensor without scales, or without an FP8 configuration, is an error naming it; so is one the configuration
    /// keeps unquantized.
    pub fn attach_fp8_scales(&mut self, fp8: Option<&Fp8Config>) -> Result<()> {
        let quantized: Vec<String> = self
            .tensors
            .values()
            .filter(|t| t.dtype == DType::F8E4M3)
            .map(|t| t.name.clone())
            .collect();
        for name in quantized {
            let Some(fp8) = fp8 else {
                return Err(Error::tensor(
                    &name,
                    "stored as FP8, but config.json has no quantization_config",
                ));
            };
            let scale_name = fp8.scale_name(&name);
            let scales = self
                .tensors
                .remove(&scale_name)
                .ok_or_else(|| Error::tensor(&name, format!("stored as FP8 without its scales {scale_name}")))?;
            let weight = self.tensors.remove(&name).expect("listed above");
            self.tensors.insert(name, fp8.attach(weight, scales)?);
        }
        Ok(())
    }

    /// A store of seeded random bf16 weights of whatever shape is asked for: matrices scaled by 1/sqrt(fan-in)
    /// so activations stay of order one, norm weights of one. Optional tensors (biases) are absent.
    pub fn synthetic(seed: u64) -> Self {
        WeightStore {
            tensors: HashMap::new(),
            text_prefix: "model.",
            synthetic_seed: Some(seed),
            quantize_experts: None,
            quantize_dense: None,
        }
    }

    /// From now on, routed experts (tensors under `.experts.`) that are not FP8 are quantized to FP8 in `scheme`
    /// as they are read: `--expert-dtype fp8`, and the FP8 experts of synthetic checkpoints.
    pub fn quantize_experts(&mut self, scheme: Fp8Scheme) {
        self.quantize_experts = Some(scheme);
    }

    /// The scheme routed experts are quantized in as they are read, if they are.
    pub fn experts_quantized_to(&self) -> Option<Fp8Scheme> {
        self.quantize_experts
    }

    /// From now on, dense linear weights (attention projections, dense MLPs, shared experts) that are not FP8 and
    /// that `fp8` does not keep unquantized are quantized to FP8 in its scheme as they are read: a synthetic
    /// checkpoint of an FP8 config is laid out as the hub's FP8 checkpoints are.
    pub fn quantize_dense_linears(&mut self, fp8: Fp8Config) {
        self.quantize_dense = Some(fp8);
    }

    /// Whether every dense linear weight is read as FP8 (stored so, or quantized as read), with at least one there
    /// to read: what the GPU then holds in one byte a weight. A synthetic store quantizing them holds them all so.
    pub fn dense_linears_are_fp8(&self) -> bool {
        if self.synthetic_seed.is_some() {
            return self.quantize_dense.is_some();
        }
        let mut linears = self.tensors.values().filter(|t| is_dense_linear(&t.name)).peekable();
        linears.peek().is_some()
            && linears.all(|t| {
                t.dtype == DType::F8E4M3
                    || self
                        .quantize_dense
                        .as_ref()
                        .is_some_and(|f| !f.keeps_unconverted(&t.name))
            })
    }

    /// The scheme tensor `name` of `dtype` and `shape` is quantized in as it is read, if it is: a routed expert
    /// under [`Self::quantize_experts`], a dense linear weight under [`Self::quantize_dense_linears`].
    fn quantized_to(&self, name: &str, dtype: DType, shape: &[usize]) -> Option<Fp8Scheme> {
        if dtype == DType::F8E4M3 || shape.len() < 2 {
            return None;
        }
        if name.contains(".experts.") {
            return self.quantize_experts;
        }
        self.quantize_dense
            .as_ref()
            .filter(|fp8| is_dense_linear(name) && !fp8.keeps_unconverted(name))
            .map(|fp8| fp8.scheme)
    }

    /// The tensor called `name`, which must have shape `shape` (synthetic stores make it so).
    pub fn get_shaped(&self, name: &str, shape: &[usize]) -> Result<TensorRef> {
        let tensor = match self.synthetic_seed {
            Some(seed) => match self.quantized_to(name, DType::BF16, shape) {
                // A synthetic weight that would be drawn in bf16 and quantized is drawn in FP8 at once.
                Some(scheme) if !name.ends_with("_blocks") && !name.ends_with("_scales") => {
                    return synthetic_fp8_tensor(seed, name, shape, scheme)
                }
                _ => synthetic_tensor(seed, name, shape)?,
            },
            None => self.get(name)?.expect_shape(shape)?,
        };
        match self.quantized_to(name, tensor.dtype, shape) {
            Some(scheme) => quantize_fp8(&tensor, scheme),
            None => Ok(tensor),
        }
    }

    /// The tensor called `name`, where a name under `model.` is looked up under the text model's prefix.
    pub fn get(&self, name: &str) -> Result<TensorRef> {
        self.find(name)
            .ok_or_else(|| Error::tensor(name, "missing from the checkpoint"))
    }

    /// Like [`get`](Self::get), for tensors a checkpoint may leave out (biases, tied heads).
    pub fn find(&self, name: &str) -> Option<TensorRef> {
        let key = match name.strip_prefix("model.") {
            Some(rest) => format!("{}{rest}", self.text_prefix),
            None => name.to_string(),
        };
        self.tensors.get(&key).cloned()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.find(name).is_some()
    }

    /// Every stored tensor holding NaN or infinite values, by name, with their counts; tensors are scanned in
    /// parallel. This reads every byte of the checkpoint.
    pub fn non_finite(&self) -> Vec<NonFinite> {
        use rayon::prelude::*;
        let mut found: Vec<NonFinite> = self
            .tensors
            .par_iter()
            .filter_map(|(name, tensor)| {
                let (nan, inf) = tensor.count_non_finite();
                (nan + inf > 0).then(|| NonFinite {
                    tensor: name.clone(),
                    nan,
                    inf,
                })
            })
            .collect();
        found.sort_by(|a, b| a.tensor.cmp(&b.tensor));
        found
    }

    /// Tensors outside the text model of `decoder_layers` layers, counted by the prefix that names their part: a
    /// multimodal checkpoint's vision tower (`model.visual.`), a multi-token-prediction head (`mtp.`), or the
    /// multi-token-prediction layers that DeepSeek-V3 and GLM-4.5 store after the decoder's own
    /// (`model.layers.{decoder_layers + i}.`). Text serving never reads them.
    pub fn outside_text_model(&self, decoder_layers: usize) -> BTreeMap<String, usize> {
        let layers = format!("{}layers.", self.text_prefix);
        let mut parts = BTreeMap::new();
        for name in self.tensors.keys() {
            let part: String = match name.strip_prefix(&layers).and_then(|rest| rest.split_once('.')) {
                Some((index, _)) if index.parse().is_ok_and(|i: usize| i >= decoder_layers) => {
                    format!("{layers}{index}.")
                }
                _ if name.starts_with(self.text_prefix) || name.starts_with("lm_head.") => continue,
                _ => {
                    let depth = if name.starts_with("model.") { 2 } else { 1 };
                    name.split('.').take(depth).map(|p| format!("{p}.")).collect()
                }
            };
            *parts.entry(part).or_insert(0) += 1;
        }
        parts
    }
}

/// The generator of one 64 Ki-element chunk of a synthetic tensor, keyed by (seed, name, chunk) so that the values
/// do not depend on threads: xorshift64*, fast, and plenty for weights nobody trains.
struct ChunkRng(u64);

const SYNTHETIC_CHUNK: usize = 1 << 16;

impl ChunkRng {
    fn new(key: u64, chunk: usize) -> Self {
        ChunkRng(key ^ (chunk as u64).wrapping_mul(0xd6e8_feb8_6659_fd93) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in [-1, 1).
    fn signed_unit(&mut self) -> f32 {
        let unit = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        2.0 * unit - 1.0
    }
}

/// The key of synthetic tensor `name`'s generators.
fn synthetic_key(seed: u64, name: &str) -> u64 {
    name.bytes().fold(seed ^ 0x9e37_79b9_7f4a_7c15, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// The half-width of a synthetic matrix's uniform values: a standard deviation of 1/sqrt(fan-in).
fn synthetic_bound(fan_in: usize) -> f32 {
    3f32.sqrt() / (fan_in as f32).sqrt()
}

/// Seeded bf16 values, uniform with the standard deviation of 1/sqrt(fan-in) (norm vectors: ones; the embedding
/// table: one, so each token's embedding stays the largest part of the residual stream and routing varies from
/// token to token as a trained model's does; smaller embeddings let the attention's average over a long context
/// dominate, and every token then routes to the same experts). Each chunk has its own generator ([`ChunkRng`]).
fn synthetic_tensor(seed: u64, name: &str, shape: &[usize]) -> Result<TensorRef> {
    use rayon::prelude::*;
    let numel: usize = shape.iter().product();
    if name.ends_with("_scales") {
        // MXFP4 scales: e2m1 values (|v| <= 6) times 2^-(log2(fan-in) / 2 + 2) keep activations of order one.
        let fan_in = (*shape.last().unwrap_or(&1) * super::mxfp4::MXFP4_BLOCK) as f32;
        let exponent = (fan_in.log2() / 2.0).round() as u8 + 2;
        return TensorRef::from_bytes(name, DType::U8, shape.to_vec(), vec![127 - exponent; numel]);
    }
    let key = synthetic_key(seed, name);
    if name.ends_with("_blocks") {
        // MXFP4 blocks: any byte is two e2m1 values.
        let mut bytes = vec![0u8; numel];
        bytes
            .par_chunks_mut(SYNTHETIC_CHUNK * 2)
            .enumerate()
            .for_each(|(chunk, out)| {
                let mut rng = ChunkRng::new(key, chunk);
                for b in out {
                    *b = (rng.next() >> 56) as u8;
                }
            });
        return TensorRef::from_bytes(name, DType::U8, shape.to_vec(), bytes);
    }
    let mut bytes = vec![0u8; numel * 2];
    if shape.len() == 1 {
        let one = half::bf16::ONE.to_le_bytes();
        bytes.chunks_exact_mut(2).for_each(|b| b.copy_from_slice(&one));
    } else {
        let fan_in = if name.ends_with("embed_tokens.weight") {
            1
        } else {
            *shape.last().unwrap_or(&1)
        };
        let bound = synthetic_bound(fan_in);
        bytes
            .par_chunks_mut(SYNTHETIC_CHUNK * 2)
            .enumerate()
            .for_each(|(chunk, out)| {
                let mut rng = ChunkRng::new(key, chunk);
                for b in out.chunks_exact_mut(2) {
                    b.copy_from_slice(&half::bf16::from_f32(rng.signed_unit() * bound).to_le_bytes());
                }
            });
    }
    TensorRef::from_bytes(name, DType::BF16, shape.to_vec(), bytes)
}

/// A synthetic routed expert's weights drawn in FP8 under `scheme`: uniform values of the same spread as
/// [`synthetic_tensor`]'s (a standard deviation of 1/sqrt(fan-in)), each the nearest E4M3 value in units of its
/// block's scale, every block scaled by the values' bound / 448, which is what quantizing such bf16 values gives
/// but for which values come out, without the bf16 tensor, its widening to f32 or the search for each block's
/// largest value: the FP8 shapes of 70-100 GiB of experts (issue 21's) load within a call of the GPU machine.
fn synthetic_fp8_tensor(seed: u64, name: &str, shape: &[usize], scheme: Fp8Scheme) -> Result<TensorRef> {
    use rayon::prelude::*;
    let layout = Fp8Layout::of(name, shape, scheme)?;
    let key = synthetic_key(seed, name);
    let mut bytes = vec![0u8; layout.matrices * layout.rows * layout.cols];
    bytes
        .par_chunks_mut(SYNTHETIC_CHUNK)
        .enumerate()
        .for_each(|(chunk, out)| {
            let mut rng = ChunkRng::new(key, chunk);
            for b in out {
                *b = f32_to_fp8_e4m3(rng.signed_unit() * FP8_E4M3_MAX);
            }
        });
    let scales = vec![synthetic_bound(layout.cols) / FP8_E4M3_MAX; layout.scale_count()];
    layout.tensor(name, bytes, &scales)
}

/// Where an index may send the loader: inside the checkpoint directory, or, for a snapshot in a Hugging Face cache
/// (`models--OWNER--NAME/snapshots/REVISION`), also into that repository's `blobs/`, where the hub keeps the files
/// a snapshot's symlinks point at. Paths are compared canonical, so `..` and symlinks cannot leave unseen.
struct Confinement {
    dir: PathBuf,
    roots: Vec<PathBuf>,
}

impl Confinement {
    fn of(dir: &Path) -> Result<Self> {
        let canonical = dir.canonicalize().map_err(|e| Error::io(dir, e))?;
        let hub_blobs = canonical
            .parent()
            .filter(|snapshots| snapshots.file_name().is_some_and(|n| n == "snapshots"))
            .and_then(Path::parent)
            .and_then(|repo| repo.join("blobs").canonicalize().ok());
        Ok(Confinement {
            dir: dir.to_path_buf(),
            roots: std::iter::once(canonical).chain(hub_blobs).collect(),
        })
    }

    /// Why the file an index calls `name` lies outside, if it does: an absolute name or one with `..` is refused
    /// before anything outside is looked at. A name that does not exist is let through for the open to report.
    fn check(&self, name: &str) -> std::result::Result<(), String> {
        if !Path::new(name)
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
        {
            return Err("an absolute path or one with `..`, outside the checkpoint directory".to_string());
        }
        match self.dir.join(name).canonicalize() {
            Ok(resolved) if !self.roots.iter().any(|root| resolved.starts_with(root)) => Err(format!(
                "resolves to {}, outside the checkpoint directory",
                resolved.display()
            )),
            _ => Ok(()),
        }
    }
}

fn map_shard(path: &Path) -> Result<Vec<TensorRef>> {
    let file = File::open(regular_file(path)?).map_err(|e| Error::io(path, e))?;
    // SAFETY: the checkpoint is read-only for the life of the process; ferry never writes to it. A file truncated
    // under us is the one hazard, which is the same for every mmap-based loader.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    let (header_len, metadata) = safetensors::SafeTensors::read_metadata(&mmap).map_err(|e| {
        Error::file(
            path,
            format!("not a valid safetensors file (truncated or corrupt?): {e}"),
        )
    })?;
    let data_start = 8 + header_len;
    let shard = Arc::new(Storage::Mapped(mmap));
    let mut out = Vec::new();
    for (name, info) in metadata.tensors() {
        let dtype = match info.dtype {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::BF16 => DType::BF16,
            safetensors::Dtype::F8_E4M3 => DType::F8E4M3,
            safetensors::Dtype::U8 => DType::U8,
            other => {
                return Err(Error::tensor(
                    &name,
                    format!("unsupported dtype {other:?} in {}", path.display()),
                ))
            }
        };
        let (s, e) = info.data_offsets;
        out.push(TensorRef {
            name,
            dtype,
            shape: info.shape.clone(),
            shard: shard.clone(),
            start: data_start + s,
            len: e - s,
            scales: None,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Mean and standard deviation.
    fn spread(values: &[f32]) -> (f64, f64) {
        let n = values.len() as f64;
        let mean = values.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = values.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        (mean, var.sqrt())
    }

    #[test]
    fn synthetic_experts_are_drawn_in_fp8_with_the_spread_of_the_bf16_ones() {
        let name = "model.layers.0.mlp.experts.0.gate_proj.weight";
        let shape = [256, 384];
        let mut store = WeightStore::synthetic(7);
        let bf16 = store.get_shaped(name, &shape).unwrap();
        store.quantize_experts(Fp8Scheme::BLOCK_128);
        let fp8 = store.get_shaped(name, &shape).unwrap();
        assert_eq!(fp8.dtype, DType::F8E4M3);
        assert_eq!(
            fp8.bytes(),
            store.get_shaped(name, &shape).unwrap().bytes(),
            "the same every time"
        );
        let (drawn, quantized) = (
            fp8.to_f32_vec(),
            quantize_fp8(&bf16, Fp8Scheme::BLOCK_128).unwrap().to_f32_vec(),
        );
        let bound = synthetic_bound(384) as f64;
        assert!(drawn.iter().all(|v| (v.abs() as f64) <= bound * 1.0001));
        let ((mean, std), (_, quantized_std)) = (spread(&drawn), spread(&quantized));
        assert!(mean.abs() < 0.01 * bound, "{mean}");
        assert!(
            (std / (bound / 3f64.sqrt()) - 1.0).abs() < 0.02,
            "{std} against {}",
            bound / 3f64.sqrt()
        );
        assert!(
            (std / quantized_std - 1.0).abs() < 0.02,
            "{std} against quantized bf16's {quantized_std}"
        );
        // Per channel, and a stack of experts: one scale a row.
        store.quantize_experts(Fp8Scheme::PerChannel);
        let stacked = store
            .get_shaped("model.layers.0.mlp.experts.gate_up_proj", &[2, 8, 32])
            .unwrap();
        assert_eq!(stacked.dtype, DType::F8E4M3);
        assert_eq!(stacked.to_f32_vec().len(), 2 * 8 * 32);
        // What is not a routed expert stays bf16.
        let dense = store
            .get_shaped("model.layers.0.self_attn.q_proj.weight", &shape)
            .unwrap();
        assert_eq!(dense.dtype, DType::BF16);
    }

    #[test]
    fn dense_linears_are_quantized_where_the_fp8_config_does_not_keep_them() {
        let config = serde_json::json!({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "model.layers.1.self_attn"]}});
        let fp8 = Fp8Config::from_config(&config).unwrap().unwrap();
        let mut store = WeightStore::synthetic(7);
        assert!(!store.dense_linears_are_fp8());
        store.quantize_dense_linears(fp8);
        assert!(store.dense_linears_are_fp8());
        let dtype = |name: &str, shape: &[usize]| store.get_shaped(name, shape).unwrap().dtype;
        for linear in [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.kv_b_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.mlp.shared_experts.up_proj.weight",
        ] {
            let weight = store.get_shaped(linear, &[256, 384]).unwrap();
            assert_eq!(weight.dtype, DType::F8E4M3, "{linear}");
            assert_eq!(weight.scales().map(|s| s.block), Some([128, 128]), "{linear}");
        }
        // The config's own exceptions, the router, the embeddings, the head, norms and routed experts (which
        // quantize_experts decides) stay as drawn.
        for (name, shape) in [
            ("model.layers.1.self_attn.q_proj.weight", &[256, 384][..]),
            ("model.layers.0.mlp.gate.weight", &[8, 384]),
            ("model.embed_tokens.weight", &[100, 384]),
            ("lm_head.weight", &[100, 384]),
            ("model.layers.0.input_layernorm.weight", &[384]),
            ("model.layers.0.mlp.experts.0.gate_proj.weight", &[256, 384]),
        ] {
            assert_eq!(dtype(name, shape), DType::BF16, "{name}");
        }
    }
}
