//! The CPU lane's persistent worker threads: started once, pinned to cores where the OS allows, woken for each job
//! and waited for, with nothing spawned or allocated per job. One job runs at a time, on every worker, while the
//! calling thread does something else (drives the GPU) and then waits for it. Not a general task pool: a job is one
//! function every worker calls with its index and shares out by itself.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// A job as the workers see it: a borrowed closure whose lifetime [`WorkerPool::run_while`] guarantees by waiting.
#[derive(Clone, Copy)]
struct JobPtr(*const (dyn Fn(usize) + Sync + 'static));

// SAFETY: the pointee is `Sync`, and `run_while` keeps it alive until every worker is done with it.
unsafe impl Send for JobPtr {}

#[derive(Default)]
struct State {
    generation: u64,
    job: Option<JobPtr>,
    running: usize,
    /// When the last worker of the current job finished.
    finished_at: Option<Instant>,
    panicked: bool,
    shutdown: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    finished: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub struct WorkerPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl WorkerPool {
    /// Starts `threads` workers (at least one). Worker `i` is pinned to the `i + 1`-th core this process may run
    /// on, so the first is left to the thread that drives the GPU; where pinning fails, the worker runs unpinned.
    pub fn new(threads: usize) -> Result<Self> {
        let shared = Arc::new(Shared::default());
        let cores = allowed_cores();
        let workers = (0..threads.max(1))
            .map(|index| {
                let shared = shared.clone();
                let core = cores.get(index + 1).copied();
                std::thread::Builder::new()
                    .name(format!("ferry-lane-{index}"))
                    .spawn(move || {
                        if let Some(core) = core {
                            pin_to(core);
                        }
                        work(&shared, index);
                    })
                    .map_err(|e| Error::Config(format!("starting a CPU lane thread: {e}")))
            })
            .collect::<Result<_>>()?;
        Ok(WorkerPool { shared, workers })
    }

    pub fn threads(&self) -> usize {
        self.workers.len()
    }

    /// Runs `job(worker)` on every worker while the calling thread runs `during`, then waits for the workers, also
    /// when `during` panics. Returns what `during` returned and the time from the start until the last worker
    /// finished (the job's own time, whether `during` took longer or not); an error if a worker's call panicked.
    pub fn run_while<R>(&mut self, job: &(dyn Fn(usize) + Sync), during: impl FnOnce() -> R) -> Result<(R, Duration)> {
        // SAFETY: only the lifetime is erased. Workers call the job between here and the wait below, which the
        // guard performs even when `during` unwinds, so the job outlives every call.
        let job: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(job) };
        let started = Instant::now();
        {
            let mut state = self.shared.lock();
            state.job = Some(JobPtr(job));
            state.finished_at = None;
            state.generation += 1;
            state.running = self.workers.len();
            state.panicked = false;
            self.shared.wake.notify_all();
        }
        let waiting = WaitOnDrop(&self.shared);
        let result = during();
        drop(waiting);
        let state = self.shared.lock();
        if state.panicked {
            return Err(Error::Shape("a CPU lane thread panicked".into()));
        }
        let busy = state.finished_at.map_or(Duration::ZERO, |at| at - started);
        Ok((result, busy))
    }
}

/// Waits for the running job's workers when dropped.
struct WaitOnDrop<'a>(&'a Shared);

impl Drop for WaitOnDrop<'_> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        while state.running > 0 {
            state = self.0.finished.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        state.job = None;
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.wake.notify_all();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// A worker's loop: wait for a new generation, run its job, report.
fn work(shared: &Shared, index: usize) {
    let mut seen = 0;
    loop {
        let job = {
            let mut state = shared.lock();
            while state.generation == seen && !state.shutdown {
                state = shared.wake.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            if state.shutdown {
                return;
            }
            seen = state.generation;
            state.job
        };
        // SAFETY: the job stays alive until `running` reaches 0 (see `run_while`).
        let ok = job.is_none_or(|job| catch_unwind(AssertUnwindSafe(|| unsafe { (*job.0)(index) })).is_ok());
        let mut state = shared.lock();
        state.panicked |= !ok;
        state.running -= 1;
        if state.running == 0 {
            state.finished_at = Some(Instant::now());
            shared.finished.notify_all();
        }
    }
}

/// The cores this process may run on, in order (empty where the OS does not say).
#[cfg(target_os = "linux")]
fn allowed_cores() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set, and sched_getaffinity writes at most its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&core| libc::CPU_ISSET(core, &set))
            .collect()
    }
}

#[cfg(not(target_os = "linux"))]
fn allowed_cores() -> Vec<usize> {
    Vec::new()
}

/// Pins the calling thread to `core`; a failure leaves it unpinned (pinning is a placement hint, not a need).
#[cfg(target_os = "linux")]
fn pin_to(core: usize) {
    // SAFETY: as in `allowed_cores`; the set names one core.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

#[cfg(not(target_os = "linux"))]
fn pin_to(_: usize) {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_worker_runs_each_job_while_the_caller_works_and_a_panic_is_an_error() {
        let mut pool = WorkerPool::new(3).unwrap();
        let calls = AtomicUsize::new(0);
        for round in 1..=5 {
            let count = |_: usize| {
                calls.fetch_add(1, Ordering::Relaxed);
            };
            let (seen, _) = pool.run_while(&count, || round).unwrap();
            assert_eq!(seen, round);
            // Every worker has finished once run_while returns.
            assert_eq!(calls.load(Ordering::Relaxed), 3 * round);
        }
        let failed = pool.run_while(
            &|worker| {
                if worker == 1 {
                    panic!("a failing worker");
                }
            },
            || (),
        );
        assert!(failed.is_err());
        // The pool still works after a panic.
        pool.run_while(&|_| (), || ()).unwrap();
    }
}
