//! Every thread's backtrace of a process, from gdb attached to it: how the
//! tests show what a hung or silent process was doing.

use std::time::{Duration, Instant};

/// `thread apply all bt` of process `pid` (this one included): gdb stops
/// it while it writes, so into a file, never into a pipe the process would
/// have to drain. A gdb still running after `give_up` is stuck itself and
/// killed. Without gdb, a line that says so.
pub fn all_threads(pid: u32, give_up: Duration) -> String {
    let path = std::env::temp_dir().join(format!("seckill-gdb-{}-{pid}.txt", std::process::id()));
    let Ok(file) = std::fs::File::create(&path) else {
        return "(no file for gdb's output)".into();
    };
    let gdb = std::process::Command::new("gdb")
        .args(["-p", &pid.to_string(), "-batch", "-nx"])
        .args(["-ex", "thread apply all bt"])
        .stdin(std::process::Stdio::null())
        .stdout(file)
        .stderr(std::process::Stdio::null())
        .spawn();
    let Ok(mut gdb) = gdb else {
        return "(no gdb here)".into();
    };
    let given_up = Instant::now() + give_up;
    while matches!(gdb.try_wait(), Ok(None)) {
        if Instant::now() > given_up {
            let _ = gdb.kill();
            let _ = gdb.wait();
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let _ = std::fs::remove_file(&path);
    text
}
