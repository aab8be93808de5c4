//! `ferry doctor`: the machine's ceilings, measured: host memory read bandwidth and, with a GPU, pinned
//! host-device copy bandwidth both ways, device copy bandwidth, bf16 GEMM throughput, and the expert offload's two
//! lanes measured at once (the link while the CPU lane computes, and the reverse), which it caches for
//! `--moe-strategy hybrid|auto`.

use anyhow::{Context, Result};
use ferry_core::backend::cpu::measure_read_bandwidth;
use ferry_core::backend::cuda::CudaBackend;
use serde_json::json;

use crate::doctor_lanes::{store, DOCTOR_EXPERTS, DOCTOR_ROUNDS};

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
        Ok(cuda) => {
            let name = cuda.device_name().to_string();
            let ceilings = cuda.measure_ceilings().context("measuring the GPU")?;
            let lanes = cuda
                .measure_lanes(DOCTOR_EXPERTS, DOCTOR_ROUNDS)
                .context("measuring the offload lanes")?;
            let cached = store(&name, &lanes)?;
            tracing::info!("lane rates cached in {}", cached.display());
            Some((name, ceilings, lanes))
        }
        Err(e) => {
            tracing::info!("no GPU measured: {e}");
            None
        }
    };
    if args.json {
        let out = json!({
            "host_read_gb_s": host_read,
            "host_threads": threads,
            "gpu": gpu.as_ref().map(|(name, c, lanes)| json!({"name": name, "ceilings": c, "lanes": lanes})),
        });
        println!("{out}");
        return Ok(());
    }
    println!("{:<36}{host_read:.1} GB/s ({threads} threads)", "host memory read");
    if let Some((name, c, lanes)) = gpu {
        println!("{:<36}{name}", "GPU");
        println!("{:<36}{:.1} GB/s", "host -> device, pinned", c.h2d_pinned_gb_s);
        println!("{:<36}{:.1} GB/s", "device -> host, pinned", c.d2h_pinned_gb_s);
        println!("{:<36}{:.0} GB/s", "device copy (read + write)", c.d2d_copy_gb_s);
        println!("{:<36}{:.0} TFLOP/s", "bf16 GEMM 8192^3 (cuBLAS)", c.bf16_gemm_tflop_s);
        println!(
            "{:<36}{:.1} GB/s",
            "kernel reading pinned host memory", c.zero_copy_read_gb_s
        );
        println!(
            "{:<36}{:.1} GB/s link + CPU lane {:.0} us a call + {:.1} GB/s ({} threads; +{:.0} % a row)",
            "expert lanes at once",
            lanes.link_gb_s,
            lanes.cpu_fixed_us,
            lanes.cpu_gb_s,
            lanes.cpu_threads,
            lanes.cpu_row_cost * 100.0
        );
    }
    Ok(())
}
