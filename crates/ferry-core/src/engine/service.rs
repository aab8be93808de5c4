//! The engine on its own thread: callers submit and cancel requests through a channel and hear back through each
//! request's [`EventSink`]; between steps the thread takes in new commands, so requests join and leave the batch
//! without waiting for each other. A [`Heartbeat`] says whether the thread is alive and when it last made progress.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::executor::Executor;
use super::request::{Event, EventSink, Request, RequestId};
use super::scheduler::{Scheduler, SchedulerStats};

enum Command {
    Submit {
        id: RequestId,
        /// Boxed: a request is large next to a cancel.
        request: Box<Request>,
        sink: EventSink,
    },
    Cancel(RequestId),
}

/// The engine's state as a metrics exporter sees it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStatus {
    pub scheduler: SchedulerStats,
    /// Decode tokens per second over recent steps (smoothed); 0 while the engine is idle.
    pub decode_tokens_per_s: f64,
    /// Expert cache hits, misses and bytes copied, when experts are offloaded.
    pub offload: Option<crate::moe::OffloadStats>,
}

/// Whether the engine thread lives and moves: what a health check needs to tell a dead or stuck engine from a busy
/// one.
#[derive(Clone, Copy, Debug)]
pub struct Heartbeat {
    /// False once the thread has ended, a panic included.
    pub alive: bool,
    /// The thread has requests to step (false while it waits for one).
    pub working: bool,
    /// When the thread last finished a step or took in a command.
    pub last_beat: Instant,
}

impl Heartbeat {
    fn new() -> Self {
        Heartbeat {
            alive: true,
            working: false,
            last_beat: Instant::now(),
        }
    }
}

/// Marks the heartbeat dead when the engine thread ends, however it ends.
struct ThreadEnd(Arc<Mutex<Heartbeat>>);

impl Drop for ThreadEnd {
    fn drop(&mut self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).alive = false;
    }
}

fn beat(heartbeat: &Mutex<Heartbeat>, working: bool) {
    let mut heartbeat = heartbeat.lock().unwrap_or_else(|e| e.into_inner());
    heartbeat.working = working;
    heartbeat.last_beat = Instant::now();
}

/// A handle to the engine thread; cloning shares the same engine. The thread ends once every handle is dropped
/// and its last request is done.
#[derive(Clone)]
pub struct EngineHandle {
    commands: Sender<Command>,
    next_id: Arc<AtomicU64>,
    status: Arc<Mutex<EngineStatus>>,
    heartbeat: Arc<Mutex<Heartbeat>>,
}

impl EngineHandle {
    pub fn spawn<E: Executor + 'static>(scheduler: Scheduler<E>) -> std::io::Result<Self> {
        let (commands, receiver) = mpsc::channel();
        let status = Arc::new(Mutex::new(EngineStatus {
            scheduler: scheduler.stats(),
            decode_tokens_per_s: 0.0,
            offload: scheduler.offload_stats(),
        }));
        let shared = status.clone();
        let heartbeat = Arc::new(Mutex::new(Heartbeat::new()));
        let beats = heartbeat.clone();
        std::thread::Builder::new().name("ferry-engine".into()).spawn(move || {
            let _end = ThreadEnd(beats.clone());
            run(scheduler, receiver, shared, &beats)
        })?;
        Ok(EngineHandle {
            commands,
            next_id: Arc::new(AtomicU64::new(0)),
            status,
            heartbeat,
        })
    }

    /// Queues a request; its events go to `sink` (a refused request gets one `Failed` event).
    pub fn submit(&self, request: Request, sink: EventSink) -> RequestId {
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        if let Err(mpsc::SendError(Command::Submit { mut sink, .. })) = self.commands.send(Command::Submit {
            id,
            request: Box::new(request),
            sink,
        }) {
            sink(Event::Failed {
                message: "the engine has stopped".into(),
            });
        }
        id
    }

    /// Cancels a request and frees its KV before the next step.
    pub fn cancel(&self, id: RequestId) {
        let _ = self.commands.send(Command::Cancel(id));
    }

    pub fn status(&self) -> EngineStatus {
        self.status.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn heartbeat(&self) -> Heartbeat {
        *self.heartbeat.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn apply<E: Executor>(scheduler: &mut Scheduler<E>, command: Command) {
    match command {
        Command::Submit { id, request, sink } => {
            if let Err(e) = scheduler.submit(id, *request, sink) {
                tracing::debug!("request {} refused: {e}", id.0);
            }
        }
        Command::Cancel(id) => scheduler.cancel(id),
    }
}

fn run<E: Executor>(
    mut scheduler: Scheduler<E>,
    commands: Receiver<Command>,
    status: Arc<Mutex<EngineStatus>>,
    heartbeat: &Mutex<Heartbeat>,
) {
    let mut decode_rate = 0.0;
    loop {
        if scheduler.is_idle() {
            beat(heartbeat, false);
            let command = commands.recv();
            beat(heartbeat, true);
            match command {
                Ok(command) => apply(&mut scheduler, command),
                Err(_) => return,
            }
        }
        loop {
            match commands.try_recv() {
                Ok(command) => apply(&mut scheduler, command),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) if scheduler.is_idle() => return,
                Err(TryRecvError::Disconnected) => break,
            }
        }
        let started = Instant::now();
        let report = scheduler.step();
        if report.decode_tokens > 0 {
            let rate = report.decode_tokens as f64 / started.elapsed().as_secs_f64().max(1e-9);
            decode_rate = match decode_rate {
                0.0 => rate,
                previous => 0.8 * previous + 0.2 * rate,
            };
        }
        if scheduler.is_idle() {
            decode_rate = 0.0;
        }
        *status.lock().unwrap_or_else(|e| e.into_inner()) = EngineStatus {
            scheduler: scheduler.stats(),
            decode_tokens_per_s: decode_rate,
            offload: scheduler.offload_stats(),
        };
        beat(heartbeat, !scheduler.is_idle());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_that_panics_leaves_a_dead_heartbeat() {
        let heartbeat = Arc::new(Mutex::new(Heartbeat::new()));
        let beats = heartbeat.clone();
        let thread = std::thread::spawn(move || {
            let _end = ThreadEnd(beats.clone());
            beat(&beats, true);
            panic!("the engine broke");
        });
        assert!(thread.join().is_err());
        let heartbeat = *heartbeat.lock().unwrap_or_else(|e| e.into_inner());
        assert!(!heartbeat.alive && heartbeat.working);
    }
}
