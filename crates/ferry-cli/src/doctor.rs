//! `ferry doctor`: the machine's ceilings, measured: host memory read bandwidth and, with a GPU, pinned
//! host-device copy bandwidth both ways, device copy bandwidth and bf16 GEMM throughput.

use anyhow::{Context, Result};
use ferry_core::backend::cpu::measure_read_bandwidth;
use ferry_core::backend::cuda::CudaBackend;
use serde_json::json;

#[derive(clap::Args)]
pub struct DoctorArgs {
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(args: DoctorArgs) -> Result<()> {
    let threads = rayon::current_num_threads();
    let host_read = measure_read_bandwidth(1 << 30);
    let gpu = match CudaBackend::new(0) {
        Ok(cuda) => Some((
            cuda.device_name().to_string(),
            cuda.measure_ceilings().context("measuring the GPU")?,
        )),
        Err(e) => {
            tracing::info!("no GPU measured: {e}");
            None
        }
    };
    if args.json {
        let out = json!({
            "host_read_gb_s": host_read,
            "host_threads": threads,
            "gpu": gpu.as_ref().map(|(name, c)| json!({"name": name, "ceilings": c})),
        });
        println!("{out}");
        return Ok(());
    }
    println!("{:<36}{host_read:.1} GB/s ({threads} threads)", "host memory read");
    if let Some((name, c)) = gpu {
        println!("{:<36}{name}", "GPU");
        println!("{:<36}{:.1} GB/s", "host -> device, pinned", c.h2d_pinned_gb_s);
        println!("{:<36}{:.1} GB/s", "device -> host, pinned", c.d2h_pinned_gb_s);
        println!("{:<36}{:.0} GB/s", "device copy (read + write)", c.d2d_copy_gb_s);
        println!("{:<36}{:.0} TFLOP/s", "bf16 GEMM 8192^3 (cuBLAS)", c.bf16_gemm_tflop_s);
    }
    Ok(())
}
