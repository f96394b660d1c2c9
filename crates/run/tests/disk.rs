//! Issue 11, item 3: a disk that fills. A real small file system (tmpfs, mounted by the test:
//! it needs root, as CI has; elsewhere it says so and does nothing) and a run that would fill it:
//! below the soft watermark the recorder slows and raises the alarm, below the hard one the run
//! stops cleanly with every built event recorded in finished files and room to spare. The hard
//! watermark is far above the configured buffers: what is in flight includes the kernel's socket
//! buffers, several MiB per connection.

#[path = "support/small_disk.rs"]
mod small_disk;
mod support;
use small_disk::SmallDisk;
use support::drill;
use tessera_config::Topology;
use tessera_run::{Options, StatusMode};

#[test]
fn a_filling_disk_stops_the_run_cleanly_at_its_watermark() {
    let Some(disk) = SmallDisk::mount(256) else {
        return;
    };
    let t = Topology::parse(
        r#"
[run]
duration_s = 300
max_fragment_size = "16 KiB"
[sources]
count = 4
fragment_size = 4096
trigger = "unlimited"
[[readout]]
id = 0
buffer = "2 MiB"
read_chunk = "64 KiB"
[[builder]]
id = 0
buffer = "2 MiB"
read_chunk = "128 KiB"
[recorder]
fsync = false
block_size = "256 KiB"
queue = "2 MiB"
max_file_size = "8 MiB"
disk_soft_free = "160 MiB"
disk_hard_free = "128 MiB"
"#,
        "test.toml",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let opts = Options {
        output: Some(disk.path().to_path_buf()),
        status: StatusMode::Off,
        ..Default::default()
    };
    let rep = tessera_run::run(&t, &opts).unwrap();
    assert_eq!(rep.stop_reason, "disk full", "{}", rep.summary());
    assert!(rep.ok(), "{}", rep.summary());
    let rec = rep.recorder.as_ref().unwrap();
    assert!(rec.error.is_none(), "{}", rep.summary());
    let built = rep.events_complete + rep.events_incomplete;
    assert!(built > 0);
    assert_eq!(rec.events_in_files, built, "{}", rep.summary());
    assert!(rec.disk_alarm && rec.throttled_s > 0.0, "{}", rep.summary());
    assert!(rec.disk_free_bytes > 0, "{}", rep.summary());
    assert!(rep.summary().contains("DISK ALARM"));
    assert!(disk.path().join("run000001.manifest.json").exists());
    let v = tessera_verify::verify_paths(&[disk.path().to_path_buf()]).unwrap();
    assert!(v.ok(), "{}", v.summary());
    assert_eq!(v.events, built);
    drill(
        "disk fills: stop at the hard watermark",
        built,
        v.events,
        0,
        rep.balance.holds,
    );
}
