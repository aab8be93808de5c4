//! The accept loop in front of the router: HTTP/1.1 connections with a cap on how many are open, a keep-alive idle
//! timeout, a header read timeout, and a shutdown that closes every connection not serving a request at once.
//!
//! Each connection is in one of three phases: idle (no request under way: a fresh connection or one kept alive
//! after a response), reading a head (a request's first bytes arrived, the handler has not been called yet), or
//! busy (from the handler's call until its response body is done). Idle connections are closed after the
//! keep-alive timeout, a head must arrive in full within the header timeout of its first byte, and a busy one is
//! never cut here: its body has its own timeout (body_timeout.rs) and a generation ends by itself.
//!
//! At the cap, a new connection makes room by closing the connection that has been idle (or reading a head) the
//! longest; when every connection is busy it waits for one to finish. So idle or half-sent sockets can never keep
//! /health from answering. Not here: anything about requests (the router's layers).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, Response};
use axum::Router;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tower_service::Service;

use crate::conn_io::WatchedIo;

/// What the operator chose for connections (`ferry serve` flags).
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    /// Connections open at once.
    pub max_connections: usize,
    /// A request's head must arrive in full within this long of its first byte.
    pub header_read_timeout: Duration,
    /// A connection with no request under way is closed after this long.
    pub keep_alive_timeout: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// `answered`: a response went out on this connection, whose last bytes hyper may still be writing.
    Idle {
        since: Instant,
        answered: bool,
    },
    ReadingHead {
        since: Instant,
    },
    Busy,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum CloseReason {
    /// Make room for a new connection: only while not busy.
    Evict,
    /// The server is stopping: not busy, at once; busy, after the current response.
    Shutdown,
}

struct Status {
    phase: Phase,
    close: Option<CloseReason>,
}

/// One connection's phase, shared by its socket wrapper (first bytes of a head), its service (handler called,
/// response done), its task (timeouts) and the acceptor (eviction, shutdown).
pub(crate) struct Connection {
    status: Mutex<Status>,
    /// Wakes the connection's task to look at its status again.
    changed: Notify,
    /// Wakes an acceptor waiting at the cap: a connection turned idle and may be evicted.
    turned_idle: Arc<Notify>,
}

/// What a connection's task does next.
#[derive(Debug, PartialEq)]
enum Verdict {
    /// `flush`: let hyper finish writing the last response first.
    Close { flush: bool },
    /// Finish the response under way, then close.
    Drain,
    /// Serve on; look again at this deadline (None: when the status changes).
    Serve(Option<Instant>),
}

impl Connection {
    fn new(turned_idle: Arc<Notify>) -> Self {
        Connection {
            status: Mutex::new(Status {
                phase: Phase::Idle {
                    since: Instant::now(),
                    answered: false,
                },
                close: None,
            }),
            changed: Notify::new(),
            turned_idle,
        }
    }

    fn update(&self, f: impl FnOnce(&mut Status)) {
        f(&mut self.status.lock().unwrap_or_else(|e| e.into_inner()));
        self.changed.notify_one();
    }

    /// Bytes arrived: an idle connection starts reading a head.
    pub(crate) fn on_bytes_read(&self) {
        let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        if let Phase::Idle { .. } = status.phase {
            status.phase = Phase::ReadingHead { since: Instant::now() };
            drop(status);
            self.changed.notify_one();
        }
    }

    /// Whether a request's head is being read and no handler was called for it: anything hyper writes now is its
    /// own answer to a head it could not parse.
    pub(crate) fn is_reading_head(&self) -> bool {
        matches!(
            self.status.lock().unwrap_or_else(|e| e.into_inner()).phase,
            Phase::ReadingHead { .. }
        )
    }

    fn on_request(&self) {
        self.update(|s| s.phase = Phase::Busy);
    }

    fn on_response_done(&self) {
        self.update(|s| {
            s.phase = Phase::Idle {
                since: Instant::now(),
                answered: true,
            }
        });
        self.turned_idle.notify_waiters();
    }

    fn close(&self, reason: CloseReason) {
        self.update(|s| s.close = Some(reason));
    }

    /// Since when the connection has not been serving a request (None while busy).
    fn unserved_since(&self) -> Option<Instant> {
        match self.status.lock().unwrap_or_else(|e| e.into_inner()).phase {
            Phase::Idle { since, .. } | Phase::ReadingHead { since } => Some(since),
            Phase::Busy => None,
        }
    }

    fn verdict(&self, limits: &ConnectionLimits, now: Instant) -> Verdict {
        let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        let deadline = match (status.phase, status.close) {
            (Phase::Busy, Some(CloseReason::Shutdown)) => return Verdict::Drain,
            (Phase::Busy, Some(CloseReason::Evict)) => {
                // The eviction lost the race with a new request: serve it, and let the acceptor pick again.
                status.close = None;
                None
            }
            (phase, Some(_)) => return Verdict::close(phase),
            (Phase::Idle { since, .. }, None) => Some(since + limits.keep_alive_timeout),
            (Phase::ReadingHead { since }, None) => Some(since + limits.header_read_timeout),
            (Phase::Busy, None) => None,
        };
        match deadline {
            Some(deadline) if deadline <= now => Verdict::close(status.phase),
            deadline => Verdict::Serve(deadline),
        }
    }
}

impl Verdict {
    fn close(phase: Phase) -> Self {
        Verdict::Close {
            flush: matches!(phase, Phase::Idle { answered: true, .. }),
        }
    }
}

/// The open connections, for eviction and shutdown.
#[derive(Default)]
struct Registry {
    open: Mutex<HashMap<u64, Arc<Connection>>>,
    next_id: AtomicU64,
}

impl Registry {
    fn add(&self, connection: Arc<Connection>) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(id, connection);
        id
    }

    fn remove(&self, id: u64) {
        self.lock().remove(&id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Connection>>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Closes the connection that has gone unserved the longest; false if every connection is busy.
    fn evict_one(&self) -> bool {
        let open = self.lock();
        let oldest = open
            .values()
            .filter_map(|c| Some((c.unserved_since()?, c)))
            .min_by_key(|(since, _)| *since);
        match oldest {
            Some((_, connection)) => {
                connection.close(CloseReason::Evict);
                true
            }
            None => false,
        }
    }

    fn shut_down_all(&self) {
        for connection in self.lock().values() {
            connection.close(CloseReason::Shutdown);
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then closes every connection not serving a request at
/// once and waits for the responses under way (streams included) to finish.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let registry = Arc::new(Registry::default());
    let turned_idle = Arc::new(Notify::new());
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors (or another resource): free one held by an idle connection.
                    tracing::warn!("cannot accept a connection: {e}");
                    registry.evict_one();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let slot = tokio::select! {
            () = &mut shutdown => break,
            slot = take_slot(&slots, &registry, &turned_idle) => slot,
        };
        let connection = Arc::new(Connection::new(turned_idle.clone()));
        let id = registry.add(connection.clone());
        let registry = registry.clone();
        let app = app.clone();
        tokio::spawn(async move {
            run_connection(stream, connection, app, limits).await;
            registry.remove(id);
            drop(slot);
        });
    }
    registry.shut_down_all();
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = slots.acquire_many(all).await;
    Ok(())
}

/// A free connection slot: one at once if the cap is not reached; else the longest-unserved connection is closed to
/// make room, or, every connection being busy, the first one to finish or turn idle gives its place.
async fn take_slot(slots: &Arc<Semaphore>, registry: &Registry, turned_idle: &Notify) -> OwnedSemaphorePermit {
    loop {
        if let Ok(slot) = slots.clone().try_acquire_owned() {
            return slot;
        }
        let idle = turned_idle.notified();
        // The evicted connection's slot comes back as soon as it closes; if it took a request meanwhile, the next
        // connection to turn idle is tried.
        registry.evict_one();
        tokio::select! {
            slot = slots.clone().acquire_owned() => if let Ok(slot) = slot { return slot },
            () = idle => {}
        }
    }
}

/// How long a closing connection may take to write out the end of its last response (a client that does not read
/// it could hold the socket otherwise).
const FLUSH_GRACE: Duration = Duration::from_secs(1);

async fn run_connection(stream: TcpStream, connection: Arc<Connection>, app: Router, limits: ConnectionLimits) {
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(WatchedIo::new(stream, connection.clone()));
    let service = ConnectionService {
        app,
        connection: connection.clone(),
    };
    let http = hyper::server::conn::http1::Builder::new()
        // The timeouts are this module's (hyper's own would also close a kept-alive connection between requests).
        .header_read_timeout(None)
        // A response head in one write, so that conn_io.rs sees hyper's own error answers whole.
        .writev(false)
        .serve_connection(io, service);
    tokio::pin!(http);
    loop {
        let deadline = match connection.verdict(&limits, Instant::now()) {
            Verdict::Close { flush: false } => return,
            Verdict::Close { flush: true } => {
                // An idle hyper connection closes at once on a graceful shutdown, once its writes are flushed.
                http.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(FLUSH_GRACE, http).await;
                return;
            }
            Verdict::Drain => {
                http.as_mut().graceful_shutdown();
                if let Err(e) = http.await {
                    tracing::debug!("connection ended: {e}");
                }
                return;
            }
            Verdict::Serve(deadline) => deadline,
        };
        let sleep = async {
            match deadline {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            served = http.as_mut() => {
                if let Err(e) = served {
                    tracing::debug!("connection ended: {e}");
                }
                return;
            }
            () = connection.changed.notified() => {}
            () = sleep => {}
        }
    }
}

/// The router, told of each request's start and its response's end.
#[derive(Clone)]
struct ConnectionService {
    app: Router,
    connection: Arc<Connection>,
}

impl hyper::service::Service<Request<Incoming>> for ConnectionService {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        self.connection.on_request();
        let connection = self.connection.clone();
        let mut app = self.app.clone();
        Box::pin(async move {
            let response = app.call(request).await?;
            Ok(response.map(|body| Body::new(SignalsDone { body, connection })))
        })
    }
}

/// A response body that tells its connection when it is done: hyper drops it once written (or the client left).
struct SignalsDone {
    body: Body,
    connection: Arc<Connection>,
}

impl HttpBody for SignalsDone {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for SignalsDone {
    fn drop(&mut self) {
        self.connection.on_response_done();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: ConnectionLimits = ConnectionLimits {
        max_connections: 4,
        header_read_timeout: Duration::from_secs(10),
        keep_alive_timeout: Duration::from_secs(30),
    };

    #[test]
    fn each_phase_has_its_deadline_and_close_reasons_respect_busy_connections() {
        let connection = Connection::new(Arc::new(Notify::new()));
        let opened = connection.unserved_since().unwrap();
        assert_eq!(
            connection.verdict(&LIMITS, opened),
            Verdict::Serve(Some(opened + LIMITS.keep_alive_timeout))
        );
        assert_eq!(
            connection.verdict(&LIMITS, opened + LIMITS.keep_alive_timeout),
            Verdict::Close { flush: false }
        );

        std::thread::sleep(Duration::from_millis(2));
        connection.on_bytes_read();
        let head = connection.unserved_since().unwrap();
        assert!(head > opened && connection.is_reading_head());
        // More bytes of the same head do not restart its clock.
        std::thread::sleep(Duration::from_millis(2));
        connection.on_bytes_read();
        assert_eq!(
            connection.verdict(&LIMITS, Instant::now()),
            Verdict::Serve(Some(head + LIMITS.header_read_timeout))
        );

        connection.on_request();
        assert_eq!(
            connection.verdict(&LIMITS, head + Duration::from_secs(3600)),
            Verdict::Serve(None)
        );
        connection.close(CloseReason::Evict);
        assert_eq!(connection.verdict(&LIMITS, Instant::now()), Verdict::Serve(None));
        connection.close(CloseReason::Shutdown);
        assert_eq!(connection.verdict(&LIMITS, Instant::now()), Verdict::Drain);

        connection.on_response_done();
        assert!(!connection.is_reading_head());
        assert_eq!(
            connection.verdict(&LIMITS, Instant::now()),
            Verdict::Close { flush: true }
        );
    }

    #[test]
    fn eviction_picks_the_longest_unserved_connection_and_never_a_busy_one() {
        let registry = Registry::default();
        let turned_idle = Arc::new(Notify::new());
        let busy = Arc::new(Connection::new(turned_idle.clone()));
        registry.add(busy.clone());
        std::thread::sleep(Duration::from_millis(2));
        let older = Arc::new(Connection::new(turned_idle.clone()));
        registry.add(older.clone());
        std::thread::sleep(Duration::from_millis(2));
        let newer = Arc::new(Connection::new(turned_idle));
        registry.add(newer.clone());
        busy.on_request();

        assert!(registry.evict_one());
        let now = Instant::now();
        assert_eq!(older.verdict(&LIMITS, now), Verdict::Close { flush: false });
        assert!(matches!(newer.verdict(&LIMITS, now), Verdict::Serve(Some(_))));
        assert_eq!(busy.verdict(&LIMITS, now), Verdict::Serve(None));

        newer.on_request();
        registry.remove(1);
        assert!(!registry.evict_one(), "every remaining connection is busy");
    }
}
