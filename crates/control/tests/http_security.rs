//! Issue 11, items 11 and 16: the HTTP service refuses state changes from pages of other origins
//! even without a token, needs the token where one is set (reads that change state included),
//! bounds comments, and never shows the token. Plain HTTP/1.1 over a real socket, as a browser
//! or curl would send it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use tessera_control::controller::{ControlOptions, Controller};
use tessera_control::state::{State, Transition};

fn controller(dir: &Path) -> Controller {
    let p = dir.join("t.toml");
    std::fs::write(
        &p,
        "[sources]\ncount = 2\nfragment_size = 256\ntrigger = \"periodic\"\nrate_hz = 100\n\
         [control]\ntoken = \"s3cret-token\"\n",
    )
    .unwrap();
    Controller::new(
        ControlOptions {
            config: Some(p),
            output: Some(dir.join("out")),
            ..Default::default()
        },
        Arc::new(AtomicBool::new(false)),
    )
}

/// Sends one request (naming the service's own address as its host) and returns (status, body).
fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let host = addr.to_string();
    let mut all = vec![("Host", host.as_str())];
    all.extend_from_slice(headers);
    call_as(addr, method, path, &all, body)
}

#[test]
fn state_changes_need_same_origin_json_and_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let c = controller(dir.path());
    let server =
        tessera_control::http::serve(c.clone(), "127.0.0.1:0", Some("s3cret-token".into()))
            .unwrap();
    let a = server.addr;
    let auth = ("Authorization", "Bearer s3cret-token");
    // No token: refused.
    assert_eq!(
        call(a, "POST", "/api/transitions/configure", &[], "").0,
        401
    );
    // A page of another origin, even with the token (a stolen one in a script): refused.
    let evil = ("Origin", "http://evil.example");
    assert_eq!(
        call(a, "POST", "/api/transitions/configure", &[auth, evil], "").0,
        403
    );
    let site = ("Sec-Fetch-Site", "cross-site");
    assert_eq!(
        call(a, "POST", "/api/transitions/configure", &[auth, site], "").0,
        403
    );
    // A text/plain body (what a form or a no-preflight fetch can send): refused.
    let plain = ("Content-Type", "text/plain");
    assert_eq!(
        call(
            a,
            "POST",
            "/api/transitions/configure",
            &[auth, plain],
            "{\"comment\":\"x\"}"
        )
        .0,
        415
    );
    assert_eq!(
        c.view().state,
        State::Initial,
        "nothing above changed the state"
    );
    // The service's own page, with the token and JSON: accepted.
    let own = format!("http://{a}");
    let origin = ("Origin", own.as_str());
    let json = ("Content-Type", "application/json");
    let (st, body) = call(
        a,
        "POST",
        "/api/transitions/configure",
        &[auth, origin, json],
        "{}",
    );
    assert_eq!(st, 200, "{body}");
    // The topology never shows the token.
    let (st, body) = call(a, "GET", "/api/topology", &[], "");
    assert_eq!(st, 200);
    assert!(!body.contains("s3cret"), "{body}");
    // A comment past the limit is refused, not stored and not logged whole.
    let long = format!(
        "{{\"comment\":\"{}\"}}",
        "x".repeat(tessera_rundb::MAX_COMMENT + 1)
    );
    let (st, body) = call(a, "POST", "/api/transitions/start", &[auth, json], &long);
    assert_eq!(st, 400, "{body}");
    assert_eq!(c.view().state, State::Configured);
    // The sampled event attaches a consumer: it needs the token.
    assert_eq!(call(a, "GET", "/api/sample", &[], "").0, 401);
    c.request(Transition::Start, "test", None).unwrap();
    let (st, body) = call(a, "GET", "/api/runs/1", &[], "");
    assert_eq!(st, 200, "{body}");
    assert!(!body.contains("s3cret"), "{body}");
    c.request(Transition::Stop, "test", None).unwrap();
    drop(server);
    c.close();
}

/// Issue 50, item 7: DNS rebinding. A page of another site whose name was made to resolve to the
/// service's address sends its own name as `Host` (and, being same-origin to the browser, passes
/// the Origin and Sec-Fetch-Site checks): refused for reading and for acting, on the default
/// token-less loopback service. IP addresses, localhost and configured names still answer.
#[test]
fn requests_for_another_sites_name_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.toml");
    std::fs::write(
        &p,
        "[sources]\ncount = 2\nfragment_size = 256\n[control]\nhost_names = [\"daq-control.example.org\"]\n",
    )
    .unwrap();
    let c = Controller::new(
        ControlOptions {
            config: Some(p),
            output: Some(dir.path().join("out")),
            ..Default::default()
        },
        Arc::new(AtomicBool::new(false)),
    );
    // Configured first, as `tessera run` does: the service reads its names then.
    c.request(Transition::Configure, "test", None).unwrap();
    let server = tessera_control::http::serve(c.clone(), "127.0.0.1:0", None).unwrap();
    let a = server.addr;
    let port = a.port();
    let evil_host = format!("evil.example:{port}");
    let evil_origin = format!("http://evil.example:{port}");
    let rebound = [
        ("Host", evil_host.as_str()),
        ("Origin", evil_origin.as_str()),
        ("Sec-Fetch-Site", "same-origin"),
        ("Content-Type", "application/json"),
    ];
    for (method, path) in [
        ("POST", "/api/transitions/start"),
        ("GET", "/api/state"),
        ("GET", "/api/topology"),
        ("GET", "/metrics"),
        ("GET", "/"),
    ] {
        let (st, body) = call_as(a, method, path, &rebound, "{}");
        assert_eq!(st, 421, "{method} {path}: {body}");
        assert!(body.contains("evil.example"), "{body}");
    }
    assert_eq!(
        c.view().state,
        State::Configured,
        "the rebound page changed the state"
    );
    for host in [
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        format!("DAQ-Control.example.org:{port}"),
        "[::1]".to_string(),
    ] {
        let (st, body) = call_as(a, "GET", "/api/state", &[("Host", host.as_str())], "");
        assert_eq!(st, 200, "{host}: {body}");
    }
    drop(server);
    c.close();
}

/// Sends one request with exactly the headers given, `Host` included, and returns (status, body).
fn call_as(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req += &format!("{k}: {v}\r\n");
    }
    req += "\r\n";
    req += body;
    s.write_all(req.as_bytes()).unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status = resp[9..12].parse().unwrap();
    let body = resp
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_string();
    (status, body)
}
