//! File operations of the write/remove protocol. Each one is followed by a fault point (see
//! [`fault`]) so a test can stop the process after exactly the Nth operation.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Largest single `write` of the protocol; a large payload is several fault points.
pub const WRITE_CHUNK: usize = 8 << 20;

/// Test-only fault injection: `arm(n)` makes the process abort right after its `n`th file
/// operation (counted from process start). Inert (one relaxed atomic add per file operation)
/// unless armed. Used by the `disk_crash_writer` helper binary of the crash-safety tests.
#[doc(hidden)]
pub mod fault {
    use std::sync::atomic::{AtomicU64, Ordering};

    static OPS: AtomicU64 = AtomicU64::new(0);
    static CRASH_AT: AtomicU64 = AtomicU64::new(0);

    /// Abort the process right after file operation number `n` (1-based); 0 disarms.
    pub fn arm(n: u64) {
        CRASH_AT.store(n, Ordering::SeqCst);
    }

    /// File operations done so far by this process.
    pub fn ops() -> u64 {
        OPS.load(Ordering::SeqCst)
    }

    #[inline]
    pub(crate) fn point() {
        let n = OPS.fetch_add(1, Ordering::SeqCst) + 1;
        if n == CRASH_AT.load(Ordering::Relaxed) {
            std::process::abort();
        }
    }
}

use fault::point;

fn open_opts() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    o
}

/// Opens an existing cache file for reading; never follows a symlink, never blocks (a FIFO
/// put where a cache file should be would otherwise block the open until a writer came), and
/// refuses anything but a regular file (a directory, a FIFO, a device) with `InvalidData`.
pub fn open_read(path: &Path) -> io::Result<File> {
    let f = open_opts()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)?;
    if !f.metadata()?.file_type().is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a regular file",
        ));
    }
    Ok(f)
}

/// Writes `parts` (concatenated) to `tmp`, fsyncs it and renames it to `dst`. The caller
/// fsyncs the directory. Returns the bytes written.
pub fn write_then_rename(tmp: &Path, dst: &Path, parts: &[&[u8]]) -> io::Result<u64> {
    let mut f = open_opts()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .open(tmp)?;
    point();
    let mut n = 0u64;
    for part in parts {
        for chunk in part.chunks(WRITE_CHUNK) {
            f.write_all(chunk)?;
            point();
            n += chunk.len() as u64;
        }
    }
    f.sync_all()?;
    point();
    drop(f);
    fs::rename(tmp, dst)?;
    point();
    Ok(n)
}

/// Writes and fsyncs `tmp` without renaming it (the `.idx` is renamed at commit).
pub fn write_synced(tmp: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = open_opts()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .open(tmp)?;
    point();
    f.write_all(bytes)?;
    point();
    f.sync_all()?;
    point();
    Ok(())
}

pub fn rename(from: &Path, to: &Path) -> io::Result<()> {
    fs::rename(from, to)?;
    point();
    Ok(())
}

/// fsync of the directory itself, which makes renames and unlinks in it durable.
pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)?;
    f.sync_all()?;
    point();
    Ok(())
}

/// Removes a file; a missing file is not an error.
pub fn remove(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Ok(()) => {
            point();
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Records a use of an entry in its `.idx` file's mtime (no rewrite, no fsync: losing a touch
/// in a crash only makes the entry look older).
pub fn touch(path: &Path, when: std::time::SystemTime) -> io::Result<()> {
    let f = open_opts().write(true).open(path)?;
    f.set_modified(when)
}

/// Reads `buf.len()` bytes at `offset`; a short file is `UnexpectedEof`.
pub fn read_at(f: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    f.read_exact_at(buf, offset)
}

/// Takes an exclusive advisory lock on `<dir>/.lock` (released when the process dies), so two
/// processes never manage one cache dir at once.
pub fn lock_dir(dir: &Path) -> io::Result<File> {
    use std::os::fd::AsRawFd;
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .mode(0o644)
        .open(dir.join(".lock"))?;
    // SAFETY: flock on a valid fd we own.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!(
                "cache dir {} is in use by another store ({e})",
                dir.display()
            ),
        ));
    }
    Ok(f)
}
