//! Progress of loading a model onto its backend, where a large checkpoint spends tens of seconds (uploads,
//! pinning the expert bank, making synthetic weights): a bar on stderr when stderr is a terminal, else a log line
//! at every tenth, so a piped log shows the load advancing too.

use std::io::IsTerminal;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

pub struct LoadProgress {
    bar: Option<ProgressBar>,
    started: Instant,
    /// Tenths already logged (without a terminal).
    logged_tenths: usize,
}

impl LoadProgress {
    /// Progress of loading `what` (the model's name or path).
    pub fn new(what: &str) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(0).with_message(format!("loading {what}"));
            if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} layers, {elapsed}") {
                bar.set_style(style.progress_chars("=> "));
            }
            bar
        });
        LoadProgress {
            bar,
            started: Instant::now(),
            logged_tenths: 0,
        }
    }

    /// `done` of `total` layers are loaded.
    pub fn update(&mut self, done: usize, total: usize) {
        if let Some(bar) = &self.bar {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            if done == total {
                bar.finish_and_clear();
            }
            return;
        }
        let tenths = done * 10 / total.max(1);
        if tenths > self.logged_tenths {
            self.logged_tenths = tenths;
            tracing::info!(
                "loaded {done}/{total} layers ({} %) in {:.1?}",
                100 * done / total.max(1),
                self.started.elapsed()
            );
        }
    }
}
