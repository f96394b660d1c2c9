//! `tessera._native`: the Rust side of the Python package. It binds the same reader and client
//! code the `tessera` binary uses (no second implementation of the formats): `tessera-archive`'s
//! file reader, `tessera-format`'s event and fragment parsers, `tessera-monitor`'s consumer.
//!
//! Data crosses into Python once per block (a file) or once per batch (the monitor), as one
//! `bytes` object; events and payloads are offsets into it, which the Python layer turns into
//! numpy views without copying.

use pyo3::exceptions::{PyConnectionError, PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;
use std::time::Duration;

use tessera_archive::FileReader;
use tessera_format::event::EventRecordHeader;
use tessera_format::link::Fragments;
use tessera_format::monitor::Wait;
use tessera_monitor::client::{command, ClientOptions, Consumer as RustConsumer};

/// One event's header fields, as a tuple:
/// (offset, size, event_id, trigger_type, flags, fragment_count, builder_id, timestamp, missing).
type EventTuple = (usize, usize, u64, u16, u32, u32, u16, u64, Vec<u32>);

/// One fragment, as a tuple: (source_id, event_id, trigger_type, status, payload_start,
/// payload_len, start, len), offsets into the buffer given.
type FragmentTuple = (u32, u64, u16, u16, usize, usize, usize, usize);

fn event_tuples(raw: &[u8]) -> PyResult<Vec<EventTuple>> {
    let mut out = Vec::new();
    for e in tessera_archive::events_in(raw) {
        let e = e.map_err(|e| PyValueError::new_err(e.to_string()))?;
        let offset = e.bytes.as_ptr() as usize - raw.as_ptr() as usize;
        let h = e.header;
        out.push((
            offset,
            e.bytes.len(),
            h.event_id,
            h.trigger_type,
            h.flags.0,
            h.fragment_count,
            h.builder_id,
            h.timestamp,
            h.missing,
        ));
    }
    Ok(out)
}

/// Reads one recorded file block by block.
#[pyclass(module = "tessera._native", unsendable)]
struct FileReaderPy {
    reader: Option<FileReader<BufReader<File>>>,
    path: PathBuf,
}

#[pymethods]
impl FileReaderPy {
    #[new]
    fn new(path: PathBuf) -> PyResult<Self> {
        let reader = FileReader::open(&path)
            .map_err(|e| PyOSError::new_err(format!("{}: {e}", path.display())))?;
        Ok(FileReaderPy {
            reader: Some(reader),
            path,
        })
    }

    /// The file header as a dict.
    fn header<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self
            .reader
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("file closed"))?;
        let d = PyDict::new(py);
        let h = &r.header;
        d.set_item("run_number", h.run_number)?;
        d.set_item("file_sequence", h.file_sequence)?;
        d.set_item("codec", h.codec.name())?;
        d.set_item("filter", h.filter.name())?;
        d.set_item("start_time_ns", h.start_time_ns)?;
        let digest: String = h.config_digest.iter().map(|b| format!("{b:02x}")).collect();
        d.set_item("config_sha256", digest)?;
        Ok(d)
    }

    /// The next block's raw bytes and its events' header tuples, or None after the trailer.
    fn next_block<'py>(
        &mut self,
        py: Python<'py>,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, Vec<EventTuple>)>> {
        let path = self.path.clone();
        let r = self
            .reader
            .as_mut()
            .ok_or_else(|| PyValueError::new_err("file closed"))?;
        match r.next_block() {
            Ok(Some((_, raw))) => {
                let events = event_tuples(raw)?;
                Ok(Some((PyBytes::new(py, raw), events)))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(PyOSError::new_err(format!("{}: {e}", path.display()))),
        }
    }

    /// The trailer as a dict (after the last block), with whether the file CRC matched.
    fn trailer<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(r) = self.reader.as_ref() else {
            return Ok(None);
        };
        let Some(t) = &r.trailer else { return Ok(None) };
        let d = PyDict::new(py);
        d.set_item("events", t.events)?;
        d.set_item("incomplete_events", t.incomplete_events)?;
        d.set_item("fragments", t.fragments)?;
        d.set_item("record_bytes", t.record_bytes)?;
        d.set_item("blocks", t.blocks)?;
        d.set_item("file_crc32c", t.file_crc)?;
        d.set_item("crc_ok", r.computed_crc == Some(t.file_crc))?;
        Ok(Some(d))
    }

    fn close(&mut self) {
        self.reader = None;
    }
}

/// The fragments of the event record at `offset` (`size` bytes) of `buf`, as tuples
/// (source_id, event_id, trigger_type, status, payload_start, payload_len, start, len), offsets
/// into `buf`.
#[pyfunction]
fn fragments(buf: &[u8], offset: usize, size: usize) -> PyResult<Vec<FragmentTuple>> {
    let rec = buf
        .get(offset..offset.saturating_add(size))
        .ok_or_else(|| PyValueError::new_err("event outside the buffer"))?;
    let (h, n) = match EventRecordHeader::decode_prefix(rec, rec.len()) {
        Ok(Some(x)) => x,
        Ok(None) => return Err(PyValueError::new_err("event record cut short")),
        Err(e) => return Err(PyValueError::new_err(e.to_string())),
    };
    if n != rec.len() {
        return Err(PyValueError::new_err(
            "event record size disagrees with its header",
        ));
    }
    let hs = h.header_size();
    let body = &rec[hs..];
    let base = offset + hs;
    // Bounded by the body: a header's count alone never sizes an allocation.
    let most = body.len() / tessera_format::wire::FRAGMENT_OVERHEAD;
    let mut out = Vec::with_capacity((h.fragment_count as usize).min(most));
    for f in Fragments::new(body) {
        let f = f.map_err(|e| PyValueError::new_err(e.to_string()))?;
        let p = f.payload_range();
        out.push((
            f.header.source_id,
            f.header.event_id,
            f.header.trigger_type,
            f.header.status,
            base + p.start,
            p.len(),
            base + f.start,
            f.len,
        ));
    }
    Ok(out)
}

/// The header tuple of one event record (`record` is exactly one record).
#[pyfunction]
fn event_header(record: &[u8]) -> PyResult<EventTuple> {
    let mut v = event_tuples(record)?;
    if v.len() != 1 || v[0].1 != record.len() {
        return Err(PyValueError::new_err("not exactly one event record"));
    }
    Ok(v.remove(0))
}

fn client_err(e: tessera_monitor::ClientError) -> PyErr {
    PyConnectionError::new_err(e.to_string())
}

/// A consumer attached to a monitor station over TCP (the Rust client: heartbeats, reattach).
#[pyclass(module = "tessera._native")]
struct ConsumerPy {
    inner: Option<RustConsumer>,
    /// Events received and not yet put, by sequence number (blocking stations need them back).
    held: std::collections::HashMap<u64, tessera_monitor::ReceivedEvent>,
}

#[pymethods]
impl ConsumerPy {
    #[new]
    #[pyo3(signature = (addr, station, consumer, create_json=None, reattach=true, token=None))]
    fn new(
        py: Python<'_>,
        addr: String,
        station: String,
        consumer: String,
        create_json: Option<String>,
        reattach: bool,
        token: Option<String>,
    ) -> PyResult<Self> {
        let mut opts = ClientOptions::new(&addr, &station);
        opts.consumer = consumer;
        opts.reattach = reattach;
        // A monitor beyond loopback (the recorder's host of a run over hosts) asks for the run
        // control's token; without one given, TESSERA_TOKEN is used.
        if let Some(t) = token.filter(|t| !t.is_empty()) {
            opts.token = Some(t);
        }
        if let Some(j) = create_json {
            opts.create = Some(
                serde_json::from_str(&j)
                    .map_err(|e| PyValueError::new_err(format!("station settings: {e}")))?,
            );
        }
        let c = py
            .detach(move || RustConsumer::attach(opts))
            .map_err(client_err)?;
        Ok(ConsumerPy {
            inner: Some(c),
            held: Default::default(),
        })
    }

    /// Up to `max` events as (seq, record bytes) pairs. `timeout`: None waits until there is
    /// one, 0 polls, else seconds. The GIL is released while waiting.
    #[pyo3(signature = (max=100, timeout=None))]
    fn get<'py>(
        &mut self,
        py: Python<'py>,
        max: u32,
        timeout: Option<f64>,
    ) -> PyResult<Vec<(u64, Bound<'py, PyBytes>)>> {
        let wait = match timeout {
            None => Wait::Sleep,
            Some(t) if t <= 0.0 => Wait::Poll,
            Some(t) => Wait::Timed((t * 1000.0).min(u32::MAX as f64) as u32),
        };
        let c = self
            .inner
            .as_mut()
            .ok_or_else(|| PyValueError::new_err("consumer closed"))?;
        let events = py.detach(|| c.get(max, wait)).map_err(client_err)?;
        let blocking = c
            .station
            .as_ref()
            .is_some_and(|s| s.mode == tessera_config::StationMode::Blocking);
        let mut out = Vec::with_capacity(events.len());
        for e in events {
            out.push((e.seq, PyBytes::new(py, &e.record)));
            if blocking {
                self.held.insert(e.seq, e);
            }
        }
        Ok(out)
    }

    /// Puts events back by sequence number (a blocking station passes them on only then).
    fn put(&mut self, py: Python<'_>, seqs: Vec<u64>) -> PyResult<()> {
        let c = self
            .inner
            .as_mut()
            .ok_or_else(|| PyValueError::new_err("consumer closed"))?;
        let events: Vec<_> = seqs.iter().filter_map(|s| self.held.remove(s)).collect();
        py.detach(|| c.put(&events)).map_err(client_err)
    }

    /// The station's settings as JSON, as the monitor reported them at attach.
    fn station_json(&self) -> Option<String> {
        self.inner
            .as_ref()
            .and_then(|c| c.station.as_ref())
            .and_then(|s| serde_json::to_string(s).ok())
    }

    /// (instance, reattaches, restarts, connected, refused_puts, stale_puts).
    fn state(&self) -> (u64, u64, u64, bool, u64, u64) {
        match &self.inner {
            Some(c) => (
                c.instance,
                c.reattaches,
                c.restarts,
                c.connected(),
                c.refused_puts,
                c.stale_puts,
            ),
            None => (0, 0, 0, false, 0, 0),
        }
    }

    fn close(&mut self) {
        if let Some(mut c) = self.inner.take() {
            c.close();
        }
        self.held.clear();
    }
}

/// Sends one JSON command to a monitor and returns its JSON answer.
#[pyfunction]
#[pyo3(signature = (addr, command_json, timeout=5.0))]
fn monitor_command(
    py: Python<'_>,
    addr: String,
    command_json: String,
    timeout: f64,
) -> PyResult<String> {
    let cmd: serde_json::Value = serde_json::from_str(&command_json)
        .map_err(|e| PyValueError::new_err(format!("command: {e}")))?;
    let v = py
        .detach(|| command(&addr, &cmd, Duration::from_secs_f64(timeout.max(0.001))))
        .map_err(client_err)?;
    Ok(v.to_string())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<FileReaderPy>()?;
    m.add_class::<ConsumerPy>()?;
    m.add_function(wrap_pyfunction!(fragments, m)?)?;
    m.add_function(wrap_pyfunction!(event_header, m)?)?;
    m.add_function(wrap_pyfunction!(monitor_command, m)?)?;
    m.add("FORMAT_VERSION", tessera_format::event::EVENT_VERSION)?;
    Ok(())
}
