//! Whether a loaded engine is fit to serve: /health answers 503 with the reason when the engine thread has ended or
//! has had requests without finishing a step for longer than the stall timeout.

use std::time::{Duration, Instant};

use ferry_core::engine::Heartbeat;

/// Why the engine cannot serve, or None while it can.
pub(crate) fn engine_trouble(heartbeat: &Heartbeat, now: Instant, stall_timeout: Duration) -> Option<String> {
    if !heartbeat.alive {
        return Some("the engine thread has stopped".into());
    }
    let quiet = now.saturating_duration_since(heartbeat.last_beat);
    (heartbeat.working && quiet > stall_timeout).then(|| {
        format!(
            "the engine has made no progress for {:.0} s with requests to serve",
            quiet.as_secs_f64()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALL: Duration = Duration::from_secs(60);

    #[test]
    fn a_dead_engine_or_one_stuck_with_work_is_unhealthy_and_an_idle_one_is_not() {
        let beat = Instant::now();
        let later = beat + Duration::from_secs(3600);
        let heartbeat = |alive, working| Heartbeat {
            alive,
            working,
            last_beat: beat,
        };
        assert_eq!(engine_trouble(&heartbeat(true, true), beat + STALL, STALL), None);
        assert_eq!(
            engine_trouble(&heartbeat(true, false), later, STALL),
            None,
            "idle for an hour"
        );
        let stuck = engine_trouble(&heartbeat(true, true), later, STALL).unwrap();
        assert!(stuck.contains("no progress for 3600 s"), "{stuck}");
        let dead = engine_trouble(&heartbeat(false, false), beat, STALL).unwrap();
        assert!(dead.contains("stopped"), "{dead}");
    }
}
