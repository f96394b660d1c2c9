//! An agent's own `/metrics` (`tessera node --metrics ADDR`): its host's part of the run, every
//! series labelled with the host's `[hosts]` name, for a Prometheus that scrapes every host (the
//! run control lists the agents in Prometheus's file-based discovery format). The part's
//! counters are those of the last status the run control asked for (five times a second), so a
//! scrape never touches the data path.

use anyhow::{Context, Result};
use axum::routing::get;
use axum::Router;
use parking_lot::Mutex;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;

use tessera_run::live::Live;

/// What the agent shows on `/metrics`.
#[derive(Debug, Default)]
pub struct Published {
    /// The `[hosts]` name this agent was configured as.
    pub host: Option<String>,
    /// Its part of the open run, as last asked for.
    pub live: Option<Live>,
    /// A run control drives the agent now.
    pub driven: bool,
    /// `[shipper]`, where this host runs the recorder: the agent keeps it across runs and run
    /// controls.
    pub shipper: Option<tessera_run::shipping::HeldShipper>,
}

pub type Shared = Arc<Mutex<Published>>;

/// The `/metrics` text now.
pub fn render(p: &Published) -> String {
    let here = p.host.clone().unwrap_or_else(tessera_metrics::host_name);
    tessera_metrics::render_part(
        &here,
        vec![
            ("tessera_node_up", "1 while the node agent serves", 1.0),
            (
                "tessera_node_driven",
                "1 while a run control drives this agent",
                p.driven as u8 as f64,
            ),
            (
                "tessera_node_run_open",
                "1 while this host takes part in an open run",
                p.live.is_some() as u8 as f64,
            ),
        ],
        p.live.clone(),
        p.shipper.as_ref().map(|h| h.service.status()),
    )
}

/// A running `/metrics` service; dropped, it ends.
pub struct MetricsServer {
    pub addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serves `GET /metrics` on `listener` from `published`.
pub fn serve(listener: TcpListener, published: Shared) -> Result<MetricsServer> {
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the metrics runtime")?;
    let thread = std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!(error = %e, "metrics listener");
                        return;
                    }
                };
                let router = Router::new().route(
                    "/metrics",
                    get(move |headers: axum::http::HeaderMap| {
                        let accept = headers
                            .get(axum::http::header::ACCEPT)
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_string);
                        let (content_type, text) = tessera_metrics::negotiate(
                            render(&published.lock()),
                            accept.as_deref(),
                        );
                        async move { ([(axum::http::header::CONTENT_TYPE, content_type)], text) }
                    }),
                );
                let _ = axum::serve(listener, router)
                    .with_graceful_shutdown(async {
                        let _ = rx.await;
                    })
                    .await;
            });
        })?;
    Ok(MetricsServer {
        addr,
        shutdown: Some(tx),
        thread: Some(thread),
    })
}
