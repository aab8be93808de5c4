//! What the engine tests on the CPU fixtures share: running requests through a scheduler to the end.

use std::sync::mpsc;

use ferry_core::engine::{Event, Executor, Request, RequestId, Scheduler};

/// Submits `requests` to `scheduler` (ids 0, 1, ... in order) and steps it until it is idle; the events each
/// request heard, in order.
pub fn run_to_the_end<E: Executor>(
    scheduler: &mut Scheduler<E>,
    requests: impl IntoIterator<Item = Request>,
) -> Vec<Vec<Event>> {
    let receivers: Vec<_> = requests
        .into_iter()
        .enumerate()
        .map(|(i, request)| {
            let (tx, rx) = mpsc::channel();
            scheduler
                .submit(RequestId(i as u64), request, Box::new(move |e| tx.send(e).is_ok()))
                .unwrap();
            rx
        })
        .collect();
    while !scheduler.is_idle() {
        scheduler.step();
    }
    receivers.iter().map(|rx| rx.try_iter().collect()).collect()
}
