//! `ferry`: run Mixture-of-Experts models larger than the GPU.

mod bench;
mod cache_sim;
mod device;
mod doctor;
mod doctor_lanes;
mod generate;
mod hub;
mod info;
mod progress;
mod serve;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ferry",
    version,
    about = "Mixture-of-Experts inference with experts ferried from host RAM"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt.
    Generate(generate::GenerateArgs),
    /// Describe a checkpoint: family, experts, parameters, expert-bank and KV sizes.
    Info(info::InfoArgs),
    /// Measure prefill and decode speed against the machine's bound.
    Bench(bench::BenchArgs),
    /// Measure the machine's ceilings: memory and copy bandwidths, GEMM throughput.
    Doctor(doctor::DoctorArgs),
    /// Replay a routing trace through an expert cache of N slots: hit rate per policy and layer.
    CacheSim(cache_sim::CacheSimArgs),
    /// Serve the OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("FERRY_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, never into a log file or a pipe.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Info(args) => info::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Doctor(args) => doctor::run(args),
        Command::CacheSim(args) => cache_sim::run(args),
        Command::Serve(args) => serve::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
