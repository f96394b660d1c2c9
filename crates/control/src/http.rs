//! The HTTP service of the run control: the JSON API (`docs/openapi.json` describes it), the
//! Prometheus metrics and the dashboard. It runs on its own small runtime, apart from the data
//! path's threads; calls that take long (a stop) run on blocking threads.
//!
//! Access: reading is open to whoever reaches the address (loopback by default). A call that
//! changes state needs the bearer token when one is set, and a token must be set for any address
//! other than loopback. Every state-changing call is logged (and kept in the run database) with
//! who asked: the operator's name from `X-Tessera-Operator`, the peer address, and how it was
//! let in.

use anyhow::{bail, Context, Result};
use axum::extract::{ConnectInfo, Path, Query, State as AxState};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::serve::ListenerExt;
use axum::{Json, Router};
use bytes::Bytes;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use crate::controller::{ControlError, Controller};
use crate::state::Transition;

/// The OpenAPI document of this API, served at `/openapi.json`.
pub const OPENAPI: &str = include_str!("../../../docs/openapi.json");

struct App {
    ctl: Controller,
    token: Option<String>,
    sample: Mutex<SampleTap>,
    /// Host names a request may name besides IP addresses and `localhost`.
    host_names: Vec<String>,
}

/// Whether a request's `Host` names this service: an IP address (a page cannot make a browser
/// send an address as the host of another site's name), `localhost`, or one of `names`. Any
/// other name is a page of another site whose name was made to resolve here (DNS rebinding).
pub fn host_is_ours(host: &str, names: &[String]) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        // [v6]:port
        return rest
            .split_once(']')
            .is_some_and(|(a, _)| a.parse::<std::net::Ipv6Addr>().is_ok());
    } else {
        host.rsplit_once(':')
            .filter(|(_, p)| p.chars().all(|c| c.is_ascii_digit()))
            .map_or(host, |(n, _)| n)
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name.parse::<std::net::Ipv4Addr>().is_ok()
        || name == "localhost"
        || name.ends_with(".localhost")
        || names.iter().any(|n| n.eq_ignore_ascii_case(&name))
}

/// Refuses, before any route, a request whose `Host` is not one of the service's own names.
async fn known_host(
    AxState(app): AxState<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .map(|h| h.to_str().unwrap_or("(not text)"));
    if let Some(host) = host {
        if !host_is_ours(host, &app.host_names) {
            let why = format!(
                "this service does not answer for the host {host:?} (its own names: IP addresses, localhost, {}): a page of another site that made its name resolve here is refused",
                if app.host_names.is_empty() { "this host's name".to_string() } else { app.host_names.join(", ") }
            );
            tracing::warn!(%peer, host, path = %req.uri().path(), "refused a request for another host's name");
            return err(StatusCode::MISDIRECTED_REQUEST, why);
        }
    }
    next.run(req).await
}

/// The dashboard's own sampling station, attached on first use and per run.
#[derive(Default)]
struct SampleTap {
    run: Option<u64>,
    consumer: Option<Tap>,
    last: Option<Sample>,
}

/// The dashboard's consumer: in this process, or on the recorder's host.
enum Tap {
    Local(tessera_monitor::LocalConsumer),
    Remote(Box<tessera_monitor::Consumer>),
}

/// The station the dashboard samples from (sampling: it never holds the data path).
pub const SAMPLE_STATION: &str = "dashboard";

/// A running HTTP service; dropped or [`stop`](Self::stop)ped, it ends.
pub struct HttpServer {
    pub addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HttpServer {
    pub fn stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether `listen` names only this host.
pub fn is_loopback(listen: &str) -> bool {
    tessera_config::is_loopback_listen(listen)
}

/// Starts the service on `listen`. A non-loopback address without a token is refused.
pub fn serve(ctl: Controller, listen: &str, token: Option<String>) -> Result<HttpServer> {
    let token = token.filter(|t| !t.is_empty());
    if !is_loopback(listen) && token.is_none() {
        bail!("control.listen = {listen} is not a loopback address: set control.token (or TESSERA_TOKEN) so that only holders of the token can change the run's state");
    }
    let tls = match ctl
        .resolved()
        .map(|r| (r.topology.control.clone(), r.origin.clone()))
    {
        Some((c, origin)) => match (&c.tls_certificate, &c.tls_key) {
            (Some(cert), Some(key)) => Some(
                tessera_node::tls::server_config(cert, key)
                    .with_context(|| format!("{origin}: control.tls_certificate"))?,
            ),
            (None, None) => None,
            _ => bail!("{origin}: control.tls_certificate and control.tls_key go together: set both, or neither"),
        },
        None => None,
    };
    let std_listener = TcpListener::bind(listen)
        .with_context(|| format!("control.listen: cannot listen on {listen} (another run on this host? --http ADDR sets another address, --http off none)"))?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let mut host_names: Vec<String> = ctl
        .resolved()
        .map(|r| r.topology.control.host_names.clone())
        .unwrap_or_default();
    // This host's own name, as the node agents read it.
    let me = tessera_node::host_name().to_ascii_lowercase();
    if me != "unknown" && !me.is_empty() {
        host_names.push(me);
    }
    let app = Arc::new(App {
        ctl,
        token,
        sample: Mutex::new(SampleTap::default()),
        host_names,
    });
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(4)
        .thread_name("http")
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    let thread = std::thread::Builder::new()
        .name("http".into())
        .spawn(move || {
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(std_listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!(error = %e, "HTTP listener");
                        return;
                    }
                };
                let router = router(app);
                let shutdown = async {
                    let _ = rx.await;
                };
                // (`tap_io` only lends the peer's address to both kinds of listener alike.)
                match tls {
                    None => serve_on(listener.tap_io(|_| ()), router, shutdown).await,
                    Some(config) => {
                        let tls = TlsListener::new(listener, addr, config);
                        serve_on(tls.tap_io(|_| ()), router, shutdown).await
                    }
                }
            });
        })?;
    Ok(HttpServer {
        addr,
        shutdown: Some(tx),
        thread: Some(thread),
    })
}

async fn serve_on<L, F>(
    listener: axum::serve::TapIo<L, F>,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) where
    L: axum::serve::Listener<Addr = SocketAddr>,
    F: FnMut(&mut L::Io) + Send + 'static,
{
    let _ = axum::serve(
        listener,
        router.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await;
}

/// HTTPS: connections whose TLS handshake is done, each handshake in its own task (bounded in
/// time) so that a slow or silent client holds up no one else.
struct TlsListener {
    ready: tokio::sync::mpsc::Receiver<(
        tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
        SocketAddr,
    )>,
    addr: SocketAddr,
}

impl TlsListener {
    fn new(
        tcp: tokio::net::TcpListener,
        addr: SocketAddr,
        config: Arc<tokio_rustls::rustls::ServerConfig>,
    ) -> Self {
        let (tx, ready) = tokio::sync::mpsc::channel(64);
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        tokio::spawn(async move {
            loop {
                let (s, peer) = match tcp.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, "HTTPS: accepting a connection");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(s)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        // Plain HTTP to the HTTPS port, a client that does not trust the
                        // certificate, a scanner: nothing to serve.
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "HTTPS: no TLS session"),
                        Err(_) => tracing::debug!(%peer, "HTTPS: handshake timed out"),
                    }
                });
            }
        });
        TlsListener { ready, addr }
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The accepting task ended: nothing more will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.addr)
    }
}

fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/", get(dashboard::index))
        .route("/assets/{file}", get(dashboard::asset))
        .route("/openapi.json", get(openapi))
        .route("/metrics", get(metrics))
        .route("/api/state", get(state))
        .route("/api/transitions/{name}", post(transition))
        .route("/api/topology", get(topology))
        .route("/api/live", get(live))
        .route("/api/report", get(report))
        .route("/api/runs", get(runs))
        .route("/api/runs/{number}", get(run))
        .route("/api/runs/{number}/comment", put(comment))
        .route("/api/runs/{number}/notes", post(add_note))
        .route("/api/history", get(history))
        .route("/api/histograms", get(histograms))
        .route("/api/faults", get(faults).post(inject_fault))
        .route("/api/actions", get(actions))
        .route("/api/log", get(log))
        .route("/api/alarms", get(alarms))
        .route("/api/alarms/acknowledge", post(acknowledge_alarm))
        .route("/api/alarms/silence", post(silence_alarm))
        .route("/api/prometheus/targets", get(prometheus_targets))
        .route("/api/events/{event_id}/why", get(why))
        .route("/api/sample", get(sample))
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            known_host,
        ))
        .with_state(app)
}

#[derive(Serialize)]
struct ErrorBody {
    error: String,
}

fn err(code: StatusCode, msg: impl ToString) -> Response {
    (
        code,
        Json(ErrorBody {
            error: msg.to_string(),
        }),
    )
        .into_response()
}

use tessera_rundb::MAX_COMMENT;

/// A refused call: logged with the peer and the reason, answered with `code`.
fn refuse(peer: SocketAddr, headers: &HeaderMap, code: StatusCode, why: &str) -> Box<Response> {
    let origin = headers
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-");
    tracing::warn!(%peer, origin, status = code.as_u16(), why, "refused a state-changing call");
    Box::new(err(code, why))
}

/// Who asked, for the log; or the refusal. Every call that changes state passes here: it must
/// come from the service's own page or a non-browser client (a page from another origin is
/// refused even without a token: cross-site request forgery), and carry the token when one is
/// set.
fn who(app: &App, peer: SocketAddr, headers: &HeaderMap) -> Result<String, Box<Response>> {
    if let Some(why) = cross_origin(headers) {
        return Err(refuse(peer, headers, StatusCode::FORBIDDEN, &why));
    }
    let how = match &app.token {
        Some(t) => {
            let given = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            if given.is_none_or(|g| !constant_time_eq(g.as_bytes(), t.as_bytes())) {
                return Err(refuse(
                    peer,
                    headers,
                    StatusCode::UNAUTHORIZED,
                    "this call changes state: it needs `Authorization: Bearer <token>`",
                ));
            }
            "token"
        }
        None => "loopback",
    };
    let name: String = headers
        .get("x-tessera-operator")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("anonymous")
        .chars()
        .filter(|c| !c.is_control())
        .take(64)
        .collect();
    Ok(format!("{name} from {peer} ({how})"))
}

/// Why a request comes from a page of another origin, if it does. Browsers name the page's
/// origin in `Origin` (and say `Sec-Fetch-Site`) on every state-changing request; command-line
/// clients send neither.
fn cross_origin(headers: &HeaderMap) -> Option<String> {
    let get = |h: &str| headers.get(h).and_then(|v| v.to_str().ok());
    if let Some(site) = get("sec-fetch-site") {
        if site != "same-origin" && site != "none" {
            return Some(format!(
                "a page of another site may not change state here (Sec-Fetch-Site: {site})"
            ));
        }
    }
    let origin = get("origin")?;
    let host = get("host").unwrap_or("");
    let same = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
        .is_some_and(|o| !host.is_empty() && o.eq_ignore_ascii_case(host));
    (!same).then(|| format!("a page of another origin ({origin}) may not change state here"))
}

/// A body must say it is JSON: a `text/plain` or form body is what a page of another origin can
/// send without asking the browser first.
fn json_body(peer: SocketAddr, headers: &HeaderMap, body: &[u8]) -> Result<(), Box<Response>> {
    if body.is_empty() {
        return Ok(());
    }
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if ct
        .split(';')
        .next()
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
    {
        Ok(())
    } else {
        Err(refuse(
            peer,
            headers,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "a body must be sent as `Content-Type: application/json`",
        ))
    }
}

/// A state-changing call's JSON body, once the caller is let in: who asked and what.
fn guarded<T: serde::de::DeserializeOwned>(
    app: &App,
    peer: SocketAddr,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(String, T), Box<Response>> {
    let who = who(app, peer, headers)?;
    json_body(peer, headers, body)?;
    let t = serde_json::from_slice(body)
        .map_err(|e| Box::new(err(StatusCode::BAD_REQUEST, format!("body: {e}"))))?;
    Ok((who, t))
}

/// Comments are bounded: they go into the run database and into one log line.
fn comment_ok(c: &str) -> Result<(), String> {
    if c.len() > MAX_COMMENT {
        Err(format!("comment: {} bytes, at most {MAX_COMMENT}", c.len()))
    } else {
        Ok(())
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn openapi() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI)
}

async fn metrics(AxState(app): AxState<Arc<App>>, headers: HeaderMap) -> Response {
    let ctl = app.ctl.clone();
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    match tokio::task::spawn_blocking(move || crate::metrics::render(&ctl)).await {
        Ok(text) => {
            let (content_type, text) = tessera_metrics::negotiate(text, accept.as_deref());
            ([(header::CONTENT_TYPE, content_type)], text).into_response()
        }
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

async fn state(AxState(app): AxState<Arc<App>>) -> Response {
    Json(app.ctl.view()).into_response()
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct TransitionBody {
    #[serde(default)]
    comment: String,
}

async fn transition(
    AxState(app): AxState<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let who = match who(&app, peer, &headers)
        .and_then(|w| json_body(peer, &headers, &body).map(|()| w))
    {
        Ok(w) => w,
        Err(r) => return *r,
    };
    let Some(t) = Transition::parse(&name) else {
        return err(
            StatusCode::NOT_FOUND,
            format!("no transition `{name}`: configure, start, pause, resume, stop or reset"),
        );
    };
    let body: TransitionBody = if body.is_empty() {
        TransitionBody::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(b) => b,
            Err(e) => return err(StatusCode::BAD_REQUEST, format!("body: {e}")),
        }
    };
    if let Err(e) = comment_ok(&body.comment) {
        return err(StatusCode::BAD_REQUEST, e);
    }
    let ctl = app.ctl.clone();
    let r = tokio::task::spawn_blocking(move || {
        ctl.request(
            t,
            &who,
            Some(body.comment.as_str()).filter(|c| !c.is_empty()),
        )
    })
    .await;
    match r {
        Ok(Ok(view)) => Json(view).into_response(),
        Ok(Err(
            e @ (ControlError::Illegal { .. } | ControlError::Busy(_) | ControlError::NoRun),
        )) => err(StatusCode::CONFLICT, e),
        Ok(Err(e @ ControlError::BadRequest(_))) => err(StatusCode::BAD_REQUEST, e),
        // Tried and failed: not a fault of the HTTP service; the system is now in error.
        Ok(Err(e)) => err(StatusCode::UNPROCESSABLE_ENTITY, e),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

async fn topology(AxState(app): AxState<Arc<App>>) -> Response {
    let Some(r) = app.ctl.resolved() else {
        return err(StatusCode::NOT_FOUND, "not configured");
    };
    let t = &r.topology;
    let readout_units: Vec<serde_json::Value> = t
        .readout_units
        .iter()
        .zip(&r.ru_sources)
        .map(|(u, s)| serde_json::json!({"id": u.id, "listen": u.listen, "sources": s}))
        .collect();
    Json(serde_json::json!({
        "origin": r.origin,
        "config_sha256": hex::encode(r.digest),
        "mode": match t.run.mode { tessera_config::Mode::Push => "push", tessera_config::Mode::Request => "request" },
        "sources": r.all_sources(),
        "emulated_sources": r.emulated_sources().collect::<Vec<_>>(),
        "external_sources": t.sources.external,
        "readout_units": readout_units,
        "builders": t.builders.iter().map(|b| serde_json::json!({"id": b.id, "listen": b.listen})).collect::<Vec<_>>(),
        "recorder": {"enabled": t.recorder.enabled, "listen": t.recorder.listen},
        "config": t,
    }))
    .into_response()
}

async fn live(AxState(app): AxState<Arc<App>>) -> Response {
    let ctl = app.ctl.clone();
    let token_required = app.token.is_some();
    let r = tokio::task::spawn_blocking(move || {
        let mut live = ctl.session().map(|s| s.live());
        // The histograms have their own call: the live view stays small at every poll.
        if let Some(r) = live.as_mut().and_then(|l| l.recorder.as_mut()) {
            r.histograms = None;
        }
        let alarms: Vec<_> = ctl.shared.alarms.lock().active().cloned().collect();
        // Between runs too: files drain after the run that wrote them.
        let shipper = live
            .as_ref()
            .and_then(|l| l.shipper.clone())
            .or_else(|| ctl.shipper().map(|s| s.status()));
        let s = ctl.shared.sampler.lock();
        // Dead time by the one rule of the status line, `/metrics` and the report.
        let dead_time = live.as_ref().map(|l| {
            serde_json::json!({
                "run_fraction": l.dead_time_fraction(),
                "interval_fraction": s.rates.as_ref().map(|r| r.dead_time_fraction),
                "per_source_interval": s.rates.as_ref().map(|r| &r.per_source_dead_fraction),
            })
        });
        // The last run's totals stay on screen after it stops.
        let last_run = ctl.last_report().map(|r| {
            serde_json::json!({
                "run_number": r.run_number,
                "duration_s": r.duration_s,
                "events": r.events_complete + r.events_incomplete,
                "events_incomplete": r.events_incomplete,
                "bytes_built": r.bytes_built,
                "events_per_s": r.events_per_s,
                "built_bytes_per_s": r.built_bytes_per_s,
                "dead_time_fraction": r.dead_time_fraction,
                "rejected": r.balance.rejected_total,
                "balance_holds": r.balance.holds,
                "stop_reason": r.stop_reason,
            })
        });
        serde_json::json!({
            "state": ctl.view(),
            "live": live,
            "shipper": shipper,
            "rates": s.rates,
            "history": s.history,
            "dead_time": dead_time,
            "last_run": last_run,
            "alarms": alarms,
            "faults": ctl.faults(),
            "token_required": token_required,
        })
    })
    .await;
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

async fn report(AxState(app): AxState<Arc<App>>) -> Response {
    let ctl = app.ctl.clone();
    let r = tokio::task::spawn_blocking(move || match ctl.session() {
        Some(s) => serde_json::to_value(s.report("running", false)).ok(),
        None => ctl
            .last_report()
            .and_then(|r| serde_json::to_value(&*r).ok()),
    })
    .await;
    match r {
        Ok(Some(v)) => Json(v).into_response(),
        Ok(None) => err(StatusCode::NOT_FOUND, "no run yet"),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Limit {
    limit: Option<usize>,
}

fn db_call<T: Serialize>(
    app: &App,
    f: impl FnOnce(&tessera_rundb::RunDb) -> Result<T, tessera_rundb::DbError>,
) -> Response {
    let Some(db) = app.ctl.db() else {
        return err(StatusCode::NOT_FOUND, "not configured: no run database yet");
    };
    match f(&db) {
        Ok(v) => Json(v).into_response(),
        Err(e @ tessera_rundb::DbError::NoRun(_)) => err(StatusCode::NOT_FOUND, e),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

async fn runs(AxState(app): AxState<Arc<App>>, Query(q): Query<Limit>) -> Response {
    let limit = q.limit.unwrap_or(50).min(10_000);
    db_call(&app, |db| db.list(limit))
}

async fn run(AxState(app): AxState<Arc<App>>, Path(number): Path<u64>) -> Response {
    db_call(&app, |db| db.get(number))
}

async fn actions(AxState(app): AxState<Arc<App>>, Query(q): Query<Limit>) -> Response {
    let limit = q.limit.unwrap_or(50).min(10_000);
    db_call(&app, |db| db.actions(limit))
}

async fn prometheus_targets(AxState(app): AxState<Arc<App>>) -> Response {
    Json(app.ctl.prometheus_targets()).into_response()
}

async fn alarms(AxState(app): AxState<Arc<App>>) -> Response {
    Json(app.ctl.shared.alarms.lock().view()).into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoteBody {
    text: String,
}

/// Adds a note to a run: kept with the time and who wrote it.
async fn add_note(
    AxState(app): AxState<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    Path(number): Path<u64>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let (who, body): (String, NoteBody) = match guarded(&app, peer, &headers, &body) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    if body.text.is_empty() {
        return err(StatusCode::BAD_REQUEST, "an empty note");
    }
    if let Err(e) = comment_ok(&body.text) {
        return err(StatusCode::BAD_REQUEST, e);
    }
    let Some(db) = app.ctl.db() else {
        return err(StatusCode::NOT_FOUND, "not configured: no run database yet");
    };
    let note = tessera_rundb::NoteRow {
        unix_ns: crate::controller::unix_ns(),
        who,
        kind: "note".into(),
        text: body.text,
    };
    match db.add_note(number, &note) {
        Ok(()) => {
            tracing::info!(who = note.who, run = number, "note: {}", note.text);
            (StatusCode::CREATED, Json(note)).into_response()
        }
        Err(e @ tessera_rundb::DbError::NoRun(_)) => err(StatusCode::NOT_FOUND, e),
        Err(e @ tessera_rundb::DbError::TooManyNotes(_)) => err(StatusCode::CONFLICT, e),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HistoryQuery {
    /// Runs from this one.
    first_run: Option<u64>,
    /// Runs up to this one.
    last_run: Option<u64>,
    /// The last this many seconds (default: every point of the runs asked for).
    last_s: Option<u64>,
    /// At most this many points, the newest (default 4000, at most 100 000).
    limit: Option<usize>,
}

/// The headline series kept across runs (1 s for the last hour, coarser beyond).
async fn history(AxState(app): AxState<Arc<App>>, Query(q): Query<HistoryQuery>) -> Response {
    let runs = match (q.first_run, q.last_run) {
        (None, None) => None,
        (a, b) => Some((a.unwrap_or(0), b.unwrap_or(u64::MAX))),
    };
    let since = q.last_s.map_or(0, |s| {
        crate::controller::unix_ns().saturating_sub(s.saturating_mul(1_000_000_000))
    });
    let limit = q.limit.unwrap_or(4000).min(100_000);
    db_call(&app, |db| db.history(runs, since, u64::MAX, limit))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HistogramsQuery {
    /// A finished run's, from the run database (default: the open run's, or the last run's).
    run: Option<u64>,
}

/// The recorder's histograms (event size, fragment size and payload word per source, time
/// between triggers, events by trigger type) and each builder's build latency: the open run's
/// so far, the last run's after it stops, or those kept with run `run`.
async fn histograms(AxState(app): AxState<Arc<App>>, Query(q): Query<HistogramsQuery>) -> Response {
    let ctl = app.ctl.clone();
    let r = tokio::task::spawn_blocking(move || -> Result<serde_json::Value, Box<Response>> {
        let report = |rep: &serde_json::Value| {
            serde_json::json!({
                "run_number": rep["run_number"],
                "running": false,
                "recorder": rep["recorder"]["histograms"],
                "build_latency": serde_json::Value::Null,
            })
        };
        if let Some(n) = q.run {
            let Some(db) = ctl.db() else {
                return Err(Box::new(err(StatusCode::NOT_FOUND, "no run database yet")));
            };
            return match db.get(n) {
                Ok(r) => Ok(report(&r.report.unwrap_or_default())),
                Err(e @ tessera_rundb::DbError::NoRun(_)) => {
                    Err(Box::new(err(StatusCode::NOT_FOUND, e)))
                }
                Err(e) => Err(Box::new(err(StatusCode::INTERNAL_SERVER_ERROR, e))),
            };
        }
        if let Some(s) = ctl.session() {
            let l = s.live();
            return Ok(serde_json::json!({
                "run_number": l.run_number,
                "running": true,
                "recorder": l.recorder.as_ref().and_then(|r| r.histograms.as_ref()),
                "build_latency": l.builders.iter().map(|b| serde_json::json!({"builder": b.id, "latency": b.latency})).collect::<Vec<_>>(),
            }));
        }
        match ctl.last_report() {
            Some(r) => Ok(report(&serde_json::to_value(&*r).unwrap_or_default())),
            None => Err(Box::new(err(StatusCode::NOT_FOUND, "no run yet"))),
        }
    })
    .await;
    match r {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(e)) => *e,
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

/// The fault rehearsals under way.
async fn faults(AxState(app): AxState<Arc<App>>) -> Response {
    Json(serde_json::json!({ "active": app.ctl.faults() })).into_response()
}

/// Injects a fault into the running run (docs/run-control.md, "Fault rehearsal").
async fn inject_fault(
    AxState(app): AxState<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let (who, f): (String, tessera_run::fault::Fault) = match guarded(&app, peer, &headers, &body) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    let ctl = app.ctl.clone();
    match tokio::task::spawn_blocking(move || ctl.fault(&who, &f)).await {
        Ok(Ok(row)) => Json(row).into_response(),
        Ok(Err(e @ ControlError::Conflict(_))) => err(StatusCode::CONFLICT, e),
        Ok(Err(e)) => err(StatusCode::BAD_REQUEST, e),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AlarmBody {
    alarm: String,
    subject: String,
    /// A silence: for how long, in whole seconds (0 ends one); JSON may write it `60.0`.
    seconds: Option<f64>,
}

async fn acknowledge_alarm(
    AxState(app): AxState<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    alarm_action(&app, peer, &headers, &body, "acknowledge")
}

async fn silence_alarm(
    AxState(app): AxState<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    alarm_action(&app, peer, &headers, &body, "silence")
}

/// An operator's call on an alarm, kept in the run database with who made it.
fn alarm_action(
    app: &App,
    peer: SocketAddr,
    headers: &HeaderMap,
    body: &[u8],
    action: &str,
) -> Response {
    let (who, b): (String, AlarmBody) = match guarded(app, peer, headers, body) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    let now = crate::controller::unix_ns();
    let (result, until, action) = {
        let mut alarms = app.ctl.shared.alarms.lock();
        if action == "acknowledge" {
            (
                alarms
                    .acknowledge(&b.alarm, &b.subject, &who, now)
                    .map(|a| serde_json::to_value(a).unwrap_or_default()),
                None,
                "acknowledge",
            )
        } else {
            let seconds = match b.seconds {
                Some(x)
                    if x.is_finite() && x >= 0.0 && x.fract() == 0.0 && x <= u64::MAX as f64 =>
                {
                    x as u64
                }
                Some(x) => {
                    return err(
                        StatusCode::BAD_REQUEST,
                        format!("seconds: {x} is not a whole number of seconds"),
                    )
                }
                None => return err(StatusCode::BAD_REQUEST, "a silence needs `seconds`"),
            };
            let r = alarms.silence(&b.alarm, &b.subject, &who, seconds, now);
            let until = r.as_ref().ok().copied().flatten();
            (
                r.map(|u| serde_json::json!({ "until_unix_ns": u })),
                until,
                if seconds == 0 { "unsilence" } else { "silence" },
            )
        }
    };
    match result {
        Ok(v) => {
            if let Some(db) = app.ctl.db() {
                let row = tessera_rundb::AlarmActionRow {
                    unix_ns: now,
                    who,
                    action: action.into(),
                    alarm: b.alarm,
                    subject: b.subject,
                    until_unix_ns: until,
                    run: app.ctl.view().run_number,
                };
                if let Err(e) = db.log_alarm_action(&row) {
                    tracing::error!(error = %e, "cannot keep an alarm action in the run database");
                }
            }
            Json(v).into_response()
        }
        Err(e @ crate::alarms::AlarmActionError::NotRaised { .. }) => err(StatusCode::NOT_FOUND, e),
        Err(e @ crate::alarms::AlarmActionError::TooManySilences) => err(StatusCode::CONFLICT, e),
        Err(e) => err(StatusCode::BAD_REQUEST, e),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LogQuery {
    /// Lines numbered above this one.
    after: Option<u64>,
    limit: Option<usize>,
}

/// The message log: what every role and agent said (INFO and above), oldest first, from the
/// line after `after`; `next` is what to ask from next time.
async fn log(Query(q): Query<LogQuery>) -> Response {
    let (lines, next) =
        tessera_node::logbook::LOG.since(q.after.unwrap_or(0), q.limit.unwrap_or(500).min(10_000));
    Json(serde_json::json!({
        "lines": lines,
        "next": next,
        "forgotten": tessera_node::logbook::LOG.forgotten(),
    }))
    .into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CommentBody {
    comment: String,
}

async fn comment(
    AxState(app): AxState<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    Path(number): Path<u64>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let (who, body): (String, CommentBody) = match guarded(&app, peer, &headers, &body) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    if let Err(e) = comment_ok(&body.comment) {
        return err(StatusCode::BAD_REQUEST, e);
    }
    let Some(db) = app.ctl.db() else {
        return err(StatusCode::NOT_FOUND, "not configured: no run database yet");
    };
    let r = db.set_comment(number, &body.comment);
    tracing::info!(who, run = number, comment = body.comment, "run comment set");
    let _ = db.log_action(&tessera_rundb::ActionRow {
        unix_ns: crate::controller::unix_ns(),
        who,
        action: "comment".into(),
        from_state: "-".into(),
        to_state: "-".into(),
        result: match &r {
            Ok(()) => "ok".into(),
            Err(e) => e.to_string(),
        },
        run: Some(number),
    });
    match r {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e @ tessera_rundb::DbError::NoRun(_)) => err(StatusCode::NOT_FOUND, e),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

async fn why(AxState(app): AxState<Arc<App>>, Path(event_id): Path<u64>) -> Response {
    match app.ctl.session() {
        Some(s) => Json(s.why_incomplete(event_id)).into_response(),
        None => err(
            StatusCode::NOT_FOUND,
            "no run is open: for a finished run, `tessera dump --from N` shows the event's missing sources",
        ),
    }
}

/// A sampled event: its header and the first bytes of its record in hex.
#[derive(Clone, Serialize)]
struct Sample {
    run_number: u64,
    seq: u64,
    event_id: u64,
    trigger_type: u16,
    builder_id: u16,
    fragment_count: u32,
    record_size: u32,
    flags: Vec<&'static str>,
    missing: Vec<u32>,
    /// `tessera monitor tail`'s view of it: header line, then one line per fragment with hex.
    text: String,
    /// The record's first bytes, hex, 16 per line.
    hex: Vec<String>,
    /// The trigger time (ns since the run started for emulated sources).
    timestamp: u64,
    /// What each fragment's payload is read as (`[histograms] payload_type`).
    word_type: tessera_config::PayloadWord,
    /// Each fragment (the first 256), with its payload as words (the first 1 024), for the
    /// dashboard's plot.
    fragments: Vec<SampleFragment>,
}

#[derive(Clone, Serialize)]
struct SampleFragment {
    source: u32,
    status: u16,
    payload_size: u32,
    words: Vec<f64>,
}

/// Fragments and words a sampled event shows: enough to see a pulse, bounded per call.
const SAMPLE_FRAGMENTS: usize = 256;
const SAMPLE_WORDS: usize = 1024;

fn sample_fragments(
    rec: &[u8],
    h: &tessera_format::event::EventRecordHeader,
    word: tessera_config::PayloadWord,
) -> Vec<SampleFragment> {
    let Some(body) = rec.get(h.header_size()..(h.record_size as usize).min(rec.len())) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for f in tessera_format::link::Fragments::new(body).take(SAMPLE_FRAGMENTS) {
        let Ok(f) = f else { break };
        let Some(p) = body.get(f.payload_range()) else {
            break;
        };
        out.push(SampleFragment {
            source: f.header.source_id,
            status: f.header.status,
            payload_size: f.header.payload_size,
            words: p
                .chunks_exact(word.size())
                .take(SAMPLE_WORDS)
                .filter_map(|w| word.read(w))
                .collect(),
        });
    }
    out
}

/// Reading the sample attaches a monitor consumer the first time: a state change, so it is
/// guarded like one.
async fn sample(
    AxState(app): AxState<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = who(&app, peer, &headers) {
        return *r;
    }
    let a = app.clone();
    let r = tokio::task::spawn_blocking(move || take_sample(&a)).await;
    match r {
        Ok(Ok(Some(s))) => Json(s).into_response(),
        Ok(Ok(None)) => err(StatusCode::NOT_FOUND, "no event sampled yet"),
        Ok(Err(e)) => err(StatusCode::NOT_FOUND, e),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

fn take_sample(app: &App) -> Result<Option<Sample>, String> {
    let Some(session) = app.ctl.session() else {
        return Ok(app.sample.lock().last.clone());
    };
    let run = session.run_number();
    let mut tap = app.sample.lock();
    if tap.run != Some(run) {
        tap.consumer = None;
        tap.last = None;
        tap.run = Some(run);
    }
    let station = tessera_config::StationSection {
        name: SAMPLE_STATION.into(),
        queue: 4,
        ..Default::default()
    };
    if tap.consumer.is_none() {
        tap.consumer = Some(if let Some(monitor) = session.monitor() {
            let exists = monitor
                .status()
                .stations
                .iter()
                .any(|s| s.config.name == SAMPLE_STATION);
            if !exists {
                monitor.create_station(station).map_err(|e| e.to_string())?;
            }
            Tap::Local(
                monitor
                    .attach(SAMPLE_STATION, "dashboard")
                    .map_err(|e| e.to_string())?,
            )
        } else if let Some(addr) = session.monitor_address() {
            // The monitor runs on the recorder's host: attach over its protocol, with the
            // token the run control and its agents share.
            let mut o = tessera_monitor::ClientOptions::new(&addr, SAMPLE_STATION);
            o.consumer = "dashboard".into();
            o.create = Some(station);
            o.reattach = false;
            if let Some(t) = app
                .ctl
                .resolved()
                .and_then(|r| r.topology.control.effective_token())
            {
                o.token = Some(t);
            }
            Tap::Remote(Box::new(
                tessera_monitor::Consumer::attach(o)
                    .map_err(|e| format!("the monitor at {addr}: {e}"))?,
            ))
        } else {
            return Err("this run has no monitor (monitor.enabled = false, or no recorder)".into());
        });
    }
    let tap = &mut *tap;
    let c = tap.consumer.as_mut().expect("attached above");
    // Events as (arrival number, record); a remote station's are parsed here.
    let events: Vec<(u64, Bytes)> = match c {
        Tap::Local(c) => {
            let events = c
                .get(16, tessera_monitor::Wait::Timed(200))
                .map_err(|e| e.to_string())?;
            let out = events.iter().map(|e| (e.seq, e.bytes.clone())).collect();
            if !events.is_empty() {
                let _ = c.put(events);
            }
            out
        }
        Tap::Remote(c) => match c.get(16, tessera_monitor::Wait::Timed(200)) {
            Ok(events) => {
                let out = events.iter().map(|e| (e.seq, e.record.clone())).collect();
                let _ = c.put(&events);
                out
            }
            Err(e) => {
                // Attach again on the next look (the monitor's host may come back).
                tap.consumer = None;
                return Err(format!("the monitor: {e}"));
            }
        },
    };
    if let Some((seq, bytes)) = events.last() {
        let Ok(Some((h, _))) =
            tessera_format::event::EventRecordHeader::decode_prefix(bytes, bytes.len())
        else {
            return Err(format!(
                "sampled event {seq} has no valid event record header"
            ));
        };
        let hex = bytes
            .chunks(16)
            .take(16)
            .map(|row| {
                row.iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        let word = app
            .ctl
            .resolved()
            .map_or(tessera_config::PayloadWord::U16, |r| {
                r.topology.histograms.payload_type
            });
        tap.last = Some(Sample {
            timestamp: h.timestamp,
            word_type: word,
            fragments: sample_fragments(bytes, &h, word),
            run_number: run,
            seq: *seq,
            event_id: h.event_id,
            trigger_type: h.trigger_type,
            builder_id: h.builder_id,
            fragment_count: h.fragment_count,
            record_size: h.record_size,
            flags: h.flags.names(),
            missing: h.missing.clone(),
            text: tessera_monitor::console::describe(*seq, bytes, 16),
            hex,
        });
    }
    Ok(tap.last.clone())
}

mod dashboard {
    use axum::extract::Path;
    use axum::http::{header, StatusCode};
    use axum::response::{IntoResponse, Response};

    const INDEX: &str = include_str!("../../../web/index.html");
    const APP_JS: &str = include_str!("../../../web/dashboard.js");
    const APP_CSS: &str = include_str!("../../../web/dashboard.css");
    // uPlot, pinned from npm by web/package-lock.json and shipped built in web/vendor, so that
    // a host without npm or network access (an experiment's air-gapped network) builds Tessera;
    // scripts/check-vendored checks the copy against the package the lock file names.
    const UPLOT_JS: &str = include_str!("../../../web/vendor/uplot/uPlot.iife.min.js");
    const UPLOT_CSS: &str = include_str!("../../../web/vendor/uplot/uPlot.min.css");

    pub async fn index() -> Response {
        ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], INDEX).into_response()
    }

    pub async fn asset(Path(file): Path<String>) -> Response {
        let (ct, body) = match file.as_str() {
            "dashboard.js" => ("text/javascript; charset=utf-8", APP_JS),
            "dashboard.css" => ("text/css; charset=utf-8", APP_CSS),
            "uPlot.iife.min.js" => ("text/javascript; charset=utf-8", UPLOT_JS),
            "uPlot.min.css" => ("text/css; charset=utf-8", UPLOT_CSS),
            _ => return (StatusCode::NOT_FOUND, "no such asset").into_response(),
        };
        ([(header::CONTENT_TYPE, ct)], body).into_response()
    }
}
