//! The CPU lane's persistent worker threads: started once, pinned to cores where the OS allows, woken for each job
//! and waited for, with nothing spawned or allocated per job. One job runs at a time, on every worker and on the
//! calling thread, which first does something else of its own, then takes its share of the job (the last worker's
//! index), then waits for the others by polling, so that the end of a job wakes no sleeping thread. Not a general
//! task pool: a job is one function every worker calls with its index and shares out by itself.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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
    shutdown: bool,
}

/// How long an idle thread polls for the next job (or the caller for the workers' end) before it sleeps on a
/// condition variable: long enough to catch the workers' end and a job that follows at once, short enough that
/// the workers sleep between decode's jobs (one per MoE layer, about every half millisecond) instead of taking
/// their cores from the GPU-driving thread. Polling 2 ms kept every worker spinning through the whole step.
pub const POLL_BEFORE_SLEEP: Duration = Duration::from_micros(50);

#[derive(Default)]
struct Shared {
    /// `State::generation`, readable without the lock, for polling workers.
    generation: AtomicU64,
    /// Spawned workers still running the current job, and whether one of them panicked.
    running: AtomicUsize,
    panicked: AtomicBool,
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
    /// A pool of `threads` workers (at least one), the calling thread of each job included: `threads - 1` are
    /// started. Worker `i` is pinned to the `i + 1`-th core this process may run on, so the first is left to the
    /// thread that drives the GPU (and the last to the caller); where pinning fails, the worker runs unpinned.
    pub fn new(threads: usize) -> Result<Self> {
        let shared = Arc::new(Shared::default());
        let cores = allowed_cores();
        let workers = (0..threads.max(1) - 1)
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

    /// The workers a job runs on, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `job(worker)` on every started worker while the calling thread runs `during`, then on the calling
    /// thread (as worker `threads() - 1`), then waits for the workers, also when `during` or the caller's share
    /// panics. Returns what `during` returned and the time from the start until every worker was done; an error if
    /// a call of the job panicked.
    pub fn run_while<R>(&mut self, job: &(dyn Fn(usize) + Sync), during: impl FnOnce() -> R) -> Result<(R, Duration)> {
        let own = job;
        // SAFETY: only the lifetime is erased. Workers call the job between here and the wait below, which the
        // guard performs even when `during` unwinds, so the job outlives every call.
        let job: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(job) };
        let started = Instant::now();
        {
            let mut state = self.shared.lock();
            state.job = Some(JobPtr(job));
            state.generation += 1;
            self.shared.running.store(self.workers.len(), Ordering::Release);
            self.shared.panicked.store(false, Ordering::Relaxed);
            self.shared.generation.store(state.generation, Ordering::Release);
            self.shared.wake.notify_all();
        }
        let waiting = WaitOnDrop(&self.shared);
        let result = during();
        let own_share = catch_unwind(AssertUnwindSafe(|| own(self.workers.len())));
        drop(waiting);
        if own_share.is_err() || self.shared.panicked.load(Ordering::Acquire) {
            return Err(Error::Shape("a CPU lane thread panicked".into()));
        }
        Ok((result, started.elapsed()))
    }
}

/// Waits for the running job's started workers when dropped: polls, then sleeps.
struct WaitOnDrop<'a>(&'a Shared);

impl Drop for WaitOnDrop<'_> {
    fn drop(&mut self) {
        let polling = Instant::now();
        while self.0.running.load(Ordering::Acquire) > 0 && polling.elapsed() < POLL_BEFORE_SLEEP {
            std::hint::spin_loop();
        }
        let mut state = self.0.lock();
        // The last worker notifies under the lock after its count reaches 0, so this wait cannot miss it.
        while self.0.running.load(Ordering::Acquire) > 0 {
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
        let polling = Instant::now();
        while shared.generation.load(Ordering::Acquire) == seen && polling.elapsed() < POLL_BEFORE_SLEEP {
            std::hint::spin_loop();
        }
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
        if !ok {
            shared.panicked.store(true, Ordering::Relaxed);
        }
        if shared.running.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _state = shared.lock();
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
        assert_eq!(pool.threads(), 3);
        let calls: [AtomicUsize; 3] = Default::default();
        let caller = std::thread::current().id();
        for round in 1..=5 {
            let count = |worker: usize| {
                calls[worker].fetch_add(1, Ordering::Relaxed);
                // The last index is the caller's share, run on the calling thread.
                assert_eq!(worker == 2, std::thread::current().id() == caller);
            };
            let (seen, _) = pool.run_while(&count, || round).unwrap();
            assert_eq!(seen, round);
            // Every worker has finished, each once per job, once run_while returns.
            assert!(calls.iter().all(|c| c.load(Ordering::Relaxed) == round));
        }
        for failing in [1, 2] {
            let failed = pool.run_while(
                &|worker| {
                    if worker == failing {
                        panic!("a failing worker");
                    }
                },
                || (),
            );
            assert!(failed.is_err(), "worker {failing}");
        }
        // The pool still works after a panic.
        pool.run_while(&|_| (), || ()).unwrap();
        // A pool of one is its caller.
        let mut alone = WorkerPool::new(1).unwrap();
        let ran = AtomicUsize::new(0);
        alone
            .run_while(
                &|worker| {
                    ran.fetch_add(worker + 1, Ordering::Relaxed);
                },
                || (),
            )
            .unwrap();
        assert_eq!(ran.load(Ordering::Relaxed), 1);
    }
}
