//! Gated DeltaNet against the CPU: the causal conv1d and the delta rule carry state across calls and sequences,
//! the chunked rule for long slices among short ones.

use super::*;

/// A Gated DeltaNet layer's shapes and inputs, and the calls that feed it: `calls[c][s]` is sequence s's
/// (start_pos, len) in call c.
struct GatedDeltaNetCase {
    k_heads: usize,
    v_heads: usize,
    dk: usize,
    dv: usize,
    /// Added to every `a`: negative values give softplus(a + dt_bias) near 0, weak decays that carry the state far.
    decay_bias: f32,
    calls: &'static [&'static [(usize, usize)]],
}

/// causal_conv1d then gated_delta_rule over `case`'s calls on both backends; each op's outputs of every call
/// compared.
fn check_gated_deltanet(p: &Pair, rng: &mut Rng, what: &str, case: &GatedDeltaNetCase) {
    let GatedDeltaNetCase {
        k_heads,
        v_heads,
        dk,
        dv,
        ..
    } = *case;
    let kernel = 4;
    let channels = 2 * k_heads * dk + v_heads * dv;
    let params = DeltaRuleParams {
        num_k_heads: k_heads,
        num_v_heads: v_heads,
        k_head_dim: dk,
        v_head_dim: dv,
    };
    let conv = rng.bf16("conv1d", &[channels, kernel], 0.5);
    let a_log = rng.bf16("A_log", &[v_heads], 1.0);
    let dt_bias = rng.bf16("dt_bias", &[v_heads], 1.0);
    // Every sequence's tokens, each rounded up to the device cache's 16-token blocks.
    let capacity_tokens = (0..case.calls[0].len())
        .map(|s| {
            case.calls
                .iter()
                .map(|call| call[s].1)
                .sum::<usize>()
                .next_multiple_of(16)
        })
        .sum();
    let spec = || KvSpec {
        layers: vec![KvLayerSpec::heads(1, 2)],
        capacity_tokens,
        recurrent: Some(RecurrentSpec {
            num_layers: 1,
            conv_channels: channels,
            conv_kernel: kernel,
            num_heads: v_heads,
            k_head_dim: dk,
            v_head_dim: dv,
        }),
    };
    let inputs: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = case
        .calls
        .iter()
        .map(|call| {
            let rows: usize = call.iter().map(|(_, l)| l).sum();
            let x = rng.values(rows * channels, 1.0);
            let a = rng.values(rows * v_heads, 2.0);
            (
                x,
                a.iter().map(|a| a + case.decay_bias).collect(),
                rng.values(rows * v_heads, 2.0),
            )
        })
        .collect();
    fn run<B: Backend>(
        be: &B,
        case: &GatedDeltaNetCase,
        spec: KvSpec,
        weights: [&TensorRef; 3],
        inputs: &[(Vec<f32>, Vec<f32>, Vec<f32>)],
        params: &DeltaRuleParams,
    ) -> (Vec<f32>, Vec<f32>) {
        let (channels, v_heads) = (weights[0].shape[0], params.num_v_heads);
        let mut kv = be.new_kv(spec).unwrap();
        let seqs: Vec<_> = case.calls[0].iter().map(|_| kv.alloc_seq()).collect();
        let [conv_w, a_log_w, dt_w] = weights.map(|w| be.weight(w.clone()).unwrap());
        let (mut conv_out, mut delta_out) = (Vec::new(), Vec::new());
        for (call, (x, a, b)) in case.calls.iter().zip(inputs) {
            let slices: Vec<SeqSlice> = call
                .iter()
                .zip(&seqs)
                .map(|(&(start_pos, len), &seq)| SeqSlice { seq, start_pos, len })
                .collect();
            let rows: usize = call.iter().map(|(_, l)| l).sum();
            let batch = be.prepare_batch(&mut kv, &slices).unwrap();
            let mixed = be
                .causal_conv1d(&be.upload(x, rows, channels).unwrap(), &conv_w, &mut kv, 0, &batch)
                .unwrap();
            let (a, b) = (
                be.upload(a, rows, v_heads).unwrap(),
                be.upload(b, rows, v_heads).unwrap(),
            );
            let out = be
                .gated_delta_rule(&mixed, &a, &b, &a_log_w, &dt_w, &mut kv, 0, &batch, params)
                .unwrap();
            conv_out.extend(be.to_host(&mixed).unwrap());
            delta_out.extend(be.to_host(&out).unwrap());
        }
        (conv_out, delta_out)
    }
    let weights = [&conv, &a_log, &dt_bias];
    let (cpu_conv, cpu_delta) = run(&p.cpu, case, spec(), weights, &inputs, &params);
    let (gpu_conv, gpu_delta) = run(&p.gpu, case, spec(), weights, &inputs, &params);
    check(&format!("causal_conv1d, {what}"), gpu_conv, cpu_conv, F32_LIMIT);
    check(&format!("gated_delta_rule, {what}"), gpu_delta, cpu_delta, F32_LIMIT);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn gated_deltanet_ops_carry_state_across_calls_and_sequences() {
    // Sequence A prefills 21 tokens (one partial chunk) with B's 2; then A decodes 1 and B continues with 3.
    let case = GatedDeltaNetCase {
        k_heads: 2,
        v_heads: 4,
        dk: 32,
        dv: 48,
        decay_bias: 0.0,
        calls: &[&[(0, 21), (0, 2)], &[(21, 1), (2, 3)]],
    };
    check_gated_deltanet(&pair(), &mut Rng::new(6), "two calls", &case);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn chunked_delta_rule_for_long_slices_among_short_ones() {
    let p = pair();
    let mut rng = Rng::new(7);
    // Three sequences over three calls, each batch mixing chunked slices (full chunks, partial last chunks, one of
    // exactly 64 tokens) with token-by-token ones (1 token, and 15: one short of the chunked form), and every
    // sequence passing its state from one form to the other: A 300, 150, 1; B 130, 1, 64; C 1, 70, 15. The chunked
    // slices run in gdn.cu's gated_delta_rule_chunked.
    let calls: &[&[(usize, usize)]] = &[
        &[(0, 300), (0, 130), (0, 1)],
        &[(300, 150), (130, 1), (1, 70)],
        &[(450, 1), (131, 64), (71, 15)],
    ];
    // The shortest chunked slices (16, 17) beside a chunk and one token short of two (63 + 64 = 127, from a state
    // the token-by-token form left), then a chunk's worth more each.
    let short_calls: &[&[(usize, usize)]] = &[&[(0, 16), (0, 17), (0, 1)], &[(16, 64), (17, 63), (1, 127)]];
    // The real models' heads (128 x 128), then heads that fill the kernel's blocks partly (dk 64, dv 48: one and a
    // half blocks of 32 columns) with three value heads per key head, then the fixtures' (16 x 16).
    for (k_heads, v_heads, dk, dv, calls) in [
        (2, 4, 128, 128, calls),
        (1, 3, 64, 48, calls),
        (2, 4, 16, 16, short_calls),
        (2, 4, 128, 128, short_calls),
    ] {
        let case = GatedDeltaNetCase {
            k_heads,
            v_heads,
            dk,
            dv,
            decay_bias: -3.0,
            calls,
        };
        check_gated_deltanet(
            &p,
            &mut rng,
            &format!("{k_heads}/{v_heads} heads of {dk} x {dv}, {} calls", calls.len()),
            &case,
        );
    }
}
